"""Several endpoints and a campaign on one store, under traffic, while `evertrain sql` reads it.

What a team's deployment does to the embedded default store (DuckLake on a SQLite catalog): ``--endpoints``
``evertrain endpoint`` processes trace every request into it (``serving.trace_flush_seconds`` 1 s: a commit a
second each, the setting that once jammed two endpoints within a minute), a campaign writes its stages into it
(``evertrain run``, one run after another, each continuing the campaign, for ``--minutes``), client threads send
chat completions to every endpoint, and `evertrain sql` reads it every few seconds. Counted at the end:

- requests answered, and of those, traces stored (after the endpoints' clean stop): lost = answered - stored;
- campaign runs started, failed (exit status not 0), iterations completed;
- `evertrain sql` reads, failed;
- the store's catalog lock: the longest any endpoint's trace commit took (from the endpoints' logs, when slow).

Everything runs on the tests' tiny model (built from a config), as real processes.

    .venv/bin/python benchmarks/shared_store.py --minutes 10      # three endpoints, 4 clients, 10 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, save, tiny_campaign
from evertrain.processes import free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=3, help="endpoint processes (default 3)")
    parser.add_argument("--clients", type=int, default=4, help="client threads, spread over the endpoints")
    parser.add_argument("--minutes", type=float, default=10, help="how long the traffic and campaign run")
    parser.add_argument("--iterations", type=int, default=2, help="iterations per campaign run (default 2)")
    parser.add_argument("--output", default="shared_store", help="results file name under benchmarks/results/")
    args = parser.parse_args()

    import httpx

    from evertrain.data.store import Store
    from evertrain.serving.auth import create_key

    root, data = tiny_campaign("evertrain-shared-store-", "shared", "calculator")
    data["serving"] = {"trace_flush_seconds": 1.0, "poll_seconds": 2.0}
    config_path = root / "campaign.json"
    config_path.write_text(json.dumps(data))
    env = {**os.environ, "EVERTRAIN_PROGRESS": "0", "PREFECT_HOME": str(root / "prefect")}
    cli = [sys.executable, "-m", "evertrain.cli"]

    # a first campaign run makes the champion the endpoints serve (and the store's tables)
    began = time.monotonic()
    first = subprocess.run([*cli, "run", "--config", str(config_path), "--iterations", "1"], env=env, cwd=root,
                           capture_output=True, text=True)
    if first.returncode:
        raise SystemExit(f"the first campaign run failed:\n{first.stdout[-3000:]}\n{first.stderr[-3000:]}")
    print(f"first campaign run: {time.monotonic() - began:.0f} s", flush=True)
    with Store(data["paths"]["store"]) as store:
        key, _row = create_key(store, "shared-store-benchmark", "infer", actor="benchmarks/shared_store.py")

    ports = [free_port() for _ in range(args.endpoints)]
    logs = [open(root / f"endpoint-{i}.log", "w") for i in range(args.endpoints)]  # noqa: SIM115 (closed below)
    endpoints = [subprocess.Popen([*cli, "endpoint", "--campaign", "shared", "--config", str(config_path),
                                   "--port", str(port)], env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)
                 for port, log in zip(ports, logs, strict=True)]
    for port, process in zip(ports, endpoints, strict=True):
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"endpoint on {port} did not start: see {root}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"] == "ok":
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
    print(f"{args.endpoints} endpoints up", flush=True)

    stop = threading.Event()
    lock = threading.Lock()
    answered: list[str] = []
    failures: list[str] = []

    def client(index: int) -> None:
        port = ports[index % len(ports)]
        headers = {"Authorization": f"Bearer {key}"}
        body = {"model": "shared", "messages": [{"role": "user", "content": "What is 12 + 30?"}], "max_tokens": 4,
                "evertrain": {"env": "calculator", "problem": {"question": "What is 12 + 30?", "answer": "42"}}}
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                try:
                    response = http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers)
                    response.raise_for_status()
                except httpx.HTTPError as error:
                    with lock:
                        failures.append(f"{port}: {error!r}")
                    time.sleep(0.5)
                    continue
                with lock:
                    answered.append(response.json()["id"])

    reads = {"ok": 0, "failed": 0, "errors": []}

    def reader() -> None:
        while not stop.wait(5):
            result = subprocess.run([*cli, "sql", "SELECT count(*) AS n FROM traces", "--config", str(config_path),
                                     "--format", "csv"], env=env, cwd=root, capture_output=True, text=True)
            if result.returncode == 0:
                reads["ok"] += 1
            else:
                reads["failed"] += 1
                reads["errors"].append(result.stderr[-500:])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    threads.append(threading.Thread(target=reader))
    for thread in threads:
        thread.start()
    runs: list[dict[str, Any]] = []
    end = time.monotonic() + args.minutes * 60
    while time.monotonic() < end:
        began = time.monotonic()
        run = subprocess.run([*cli, "run", "--config", str(config_path), "--iterations", str(args.iterations)],
                             env=env, cwd=root, capture_output=True, text=True)
        runs.append({"exit": run.returncode, "seconds": round(time.monotonic() - began, 1),
                     "tail": "" if run.returncode == 0 else (run.stdout + run.stderr)[-2000:]})
        print(f"campaign run {len(runs)}: exit {run.returncode} in {runs[-1]['seconds']} s", flush=True)
    stop.set()
    for thread in threads:
        thread.join(180)
    for process in endpoints:  # a clean stop writes what is queued
        process.send_signal(signal.SIGINT)
    exits = [process.wait(180) for process in endpoints]
    for log in logs:
        log.close()

    with Store(data["paths"]["store"], read_only=True) as store:
        stored = set(store.query("SELECT trace_id FROM traces WHERE trace_id IN (SELECT unnest(?))",
                                 [answered])["trace_id"])
        iterations = int(store.scalar("SELECT count(*) FROM stage_runs WHERE campaign = 'shared' AND "
                                      "stage = 'promote' AND status = 'completed'"))
    journal = root / "evertrain.sqlite.trace_journal"
    left = [str(p) for p in journal.rglob("*")] if journal.exists() else []
    row = {"endpoints": args.endpoints, "minutes": args.minutes, "answered": len(answered),
           "traces_stored": len(stored), "lost": len(set(answered) - stored), "request_errors": len(failures),
           "campaign_runs": len(runs), "failed_runs": sum(r["exit"] != 0 for r in runs),
           "iterations_completed": iterations, "sql_reads": reads["ok"], "sql_failed": reads["failed"],
           "endpoint_exits": exits}
    print()
    print_table([row], ["endpoints", "minutes", "answered", "traces_stored", "lost", "request_errors",
                        "campaign_runs", "failed_runs", "iterations_completed", "sql_reads", "sql_failed"])
    path = save(args.output, {**row, "runs": runs, "request_error_samples": failures[:20],
                              "sql_errors": reads["errors"][:5], "journal_left": left[:20],
                              "load_average_1m_at_end": os.getloadavg()[0], "scratch": str(root)})
    print(f"wrote {path} (scratch: {root})")


if __name__ == "__main__":
    main()
