"""The endpoint's throughput and latency with tracing off, on, and on without its journal; the store's files after many
traced requests.

A tiny model (the test model: two layers, a few hundred thousand parameters, built from a config) is
served by `evertrain.serving` on a real port; a concurrent client (threads sharing one official ``openai``
client) sends short chat completions. Tracing off, on (every row written to the writer's journal before it is
queued: what a SIGKILL cannot lose) and on without the journal alternate in rounds on the same server (the trace
writer and its journal are switched between rounds), so a change in the machine's load hits each alike.
Then ``--traced`` requests are sent with tracing on, and the store's data files are counted before and
after compaction: the writer commits batches (one commit per ``serving.trace_batch_rows`` traces or per
``serving.trace_flush_seconds``), never one per request.

With a tiny model the time per request is mostly HTTP, JSON and the client, not the model: the worst case
for tracing's share of the cost. A real model's generation makes that share smaller.

    .venv/bin/python benchmarks/endpoint.py                   # the defaults: 4 clients, 3 rounds, 10,000 traced
    .venv/bin/python benchmarks/endpoint.py --traced 1000     # quicker
    .venv/bin/python benchmarks/endpoint.py --auth-ab          # API keys and quotas on against off (tracing on)

``--auth-ab`` measures what identity costs instead: two endpoints on one store, one requiring API keys with the
default per-key quotas, one with ``serving.auth = "none"`` and no quotas, served at once, in alternating rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, save, tiny_campaign
from evertrain.stats import percentile


def drive(client: Any, requests: int, clients: int, max_tokens: int) -> dict[str, Any]:
    """``requests`` chat completions from ``clients`` threads; requests per second and latency percentiles (ms)."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    left = [requests]

    def worker() -> None:
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            began = time.perf_counter()
            try:
                client.chat.completions.create(model="bench", messages=[{"role": "user", "content": "What is 7 + 5?"}],
                                               max_tokens=max_tokens)
            except Exception as error:
                with lock:
                    failures.append(repr(error))
                continue
            with lock:
                latencies.append((time.perf_counter() - began) * 1000)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    return {"requests": requests, "failed": len(failures), "wall_s": round(wall, 2),
            "rps": round(len(latencies) / wall, 1), "p50_ms": round(percentile(latencies, 50), 1),
            "p90_ms": round(percentile(latencies, 90), 1), "p99_ms": round(percentile(latencies, 99), 1),
            "mean_ms": round(statistics.fmean(latencies), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4, help="concurrent client threads (default 4)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of tracing off then on (default 3)")
    parser.add_argument("--per-round", type=int, default=300, help="requests per round (default 300)")
    parser.add_argument("--traced", type=int, default=10_000, help="traced requests before counting files")
    parser.add_argument("--max-tokens", type=int, default=2, help="completion tokens per request (default 2)")
    parser.add_argument("--flush-seconds", type=float, help="serving.trace_flush_seconds (default: the config's)")
    parser.add_argument("--max-batch", type=int, help="serving.max_batch: concurrent requests sampled in one call "
                        "(1: one at a time; default: the config's)")
    parser.add_argument("--auth-ab", action="store_true", help="API keys and quotas on against off, tracing on")
    parser.add_argument("--output", default="endpoint", help="results file name under benchmarks/results/")
    args = parser.parse_args()

    os.environ.setdefault("EVERTRAIN_PROGRESS", "0")
    from evertrain.quiet import quiet_libraries
    from evertrain.runtime import Runtime

    quiet_libraries()
    import openai

    from evertrain.config import load_config
    from evertrain.serving.app import EndpointServer
    from evertrain.serving.auth import create_key

    _root, data = tiny_campaign("evertrain-endpoint-bench-", "bench", "arithmetic")
    # compaction only at the end, where it is measured
    data["serving"] = {"compact_seconds": 1e9}
    if args.flush_seconds:
        data["serving"]["trace_flush_seconds"] = args.flush_seconds
    if args.max_batch:
        data["serving"]["max_batch"] = args.max_batch
    config = type(load_config(None)).model_validate(data)
    with Runtime.open(config) as rt:  # closed before the endpoint opens the store
        rt.ensure_started()

    if args.auth_ab:
        auth_ab(config, args)
        return

    with EndpointServer(config, port=0) as server:
        endpoint = server.endpoint
        writer = endpoint.writer
        assert writer is not None
        # the endpoint requires a key (serving.auth = "keys"): one made in the benchmark's own store
        key, _row = create_key(endpoint.store, "benchmark", "infer", actor="benchmarks/endpoint.py")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)
        drive(client, 50, args.clients, args.max_tokens)  # warm-up
        journal = writer.journal
        rounds: dict[str, list[dict[str, Any]]] = {"off": [], "on": [], "on, no journal": []}
        for _ in range(args.rounds):
            for mode in rounds:
                endpoint.writer = None if mode == "off" else writer
                writer.journal = journal if mode == "on" else None
                rounds[mode].append(drive(client, args.per_round, args.clients, args.max_tokens))
        endpoint.writer, writer.journal = writer, journal
        writer.flush(120)
        summary = []
        for mode, parts in rounds.items():
            summary.append({"tracing": mode, "requests": sum(p["requests"] for p in parts),
                            "failed": sum(p["failed"] for p in parts),
                            "rps": round(statistics.median(p["rps"] for p in parts), 1),
                            **{k: round(statistics.median(p[k] for p in parts), 1)
                               for k in ("p50_ms", "p90_ms", "p99_ms")}})
        cost = 1 - summary[1]["rps"] / summary[0]["rps"]
        journal_cost = 1 - summary[1]["rps"] / summary[2]["rps"]

        store = endpoint.store
        before_traced = int(store.scalar("SELECT count(*) FROM traces"))
        files_before = store.disk_usage()["files"]
        commits_before = writer.commits
        bulk = drive(client, args.traced, args.clients, args.max_tokens)
        writer.flush(300)
        traces = int(store.scalar("SELECT count(*) FROM traces")) - before_traced
        files_traced = store.disk_usage()["files"]
        began = time.perf_counter()
        writer.compact(keep_seconds=0)
        compact_s = time.perf_counter() - began
        files_compacted = store.disk_usage()["files"]
        files = {"traced_requests": args.traced, "traces_stored": traces, "failed": bulk["failed"],
                 "commits": writer.commits - commits_before, "files_before": files_before,
                 "files_after_requests": files_traced, "files_after_compaction": files_compacted,
                 "compact_s": round(compact_s, 2), "rps": bulk["rps"], "p50_ms": bulk["p50_ms"],
                 "p99_ms": bulk["p99_ms"], "batch_rows": config.serving.trace_batch_rows,
                 "flush_seconds": config.serving.trace_flush_seconds}

    print(f"\nendpoint, tiny model, {args.clients} concurrent clients, {args.max_tokens} completion tokens per request "
          f"(median of {args.rounds} rounds of {args.per_round} requests each)")
    print_table(summary, ["tracing", "requests", "failed", "rps", "p50_ms", "p90_ms", "p99_ms"])
    print(f"tracing cost: {cost:+.1%} of requests per second; the journal's share: {journal_cost:+.1%}")
    print(f"\n{args.traced} traced requests: {traces} traces in {files['commits']} commits; store data files "
          f"{files_before} -> {files_traced} after the requests -> {files_compacted} after compaction "
          f"({compact_s:.1f} s)")
    path = save(args.output, {"model": "tiny (tests' model: 2 layers, hidden 64, byte-level tokenizer)",
                              "clients": args.clients, "max_tokens": args.max_tokens, "rounds": rounds,
                              "max_batch": config.serving.max_batch,
                              "summary": summary, "tracing_cost_rps": round(cost, 4),
                              "journal_cost_rps": round(journal_cost, 4), "files": files,
                              "load_average_1m_at_end": os.getloadavg()[0]})
    print(f"wrote {path}")


def auth_ab(config: Any, args: argparse.Namespace) -> None:
    """Keys and quotas on (the defaults) against off: two endpoints on one store, alternating rounds."""
    import openai

    from evertrain.serving.app import EndpointServer
    from evertrain.serving.auth import create_key

    data = config.model_dump()
    data["serving"].update(auth="none", requests_per_minute=0, tokens_per_minute=0)
    open_config = type(config).model_validate(data)
    with EndpointServer(config, port=0) as keyed, \
            EndpointServer(open_config, port=0, store=keyed.endpoint.store) as open_server:
        key, _row = create_key(keyed.endpoint.store, "benchmark-auth-ab", "infer", actor="benchmarks/endpoint.py")
        clients = {"keys and quotas": openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=key, max_retries=0,
                                                    timeout=120),
                   "no keys, no quotas": openai.OpenAI(base_url=f"{open_server.url}/v1", api_key="unused",
                                                       max_retries=0, timeout=120)}
        for client in clients.values():
            drive(client, 50, args.clients, args.max_tokens)  # warm-up
        rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in clients}
        for index in range(args.rounds):  # the order flips every round: neither mode always goes first
            for mode, client in list(clients.items())[::-1 if index % 2 else 1]:
                rounds[mode].append(drive(client, args.per_round, args.clients, args.max_tokens))
    summary = [{"mode": mode, "requests": sum(p["requests"] for p in parts), "failed": sum(p["failed"] for p in parts),
                "rps": round(statistics.median(p["rps"] for p in parts), 1),
                **{k: round(statistics.median(p[k] for p in parts), 1) for k in ("p50_ms", "p90_ms", "p99_ms")}}
               for mode, parts in rounds.items()]
    cost = 1 - summary[0]["rps"] / summary[1]["rps"]
    print(f"\nendpoint, tiny model, tracing on, {args.clients} concurrent clients (median of {args.rounds} rounds of "
          f"{args.per_round} requests each)")
    print_table(summary, ["mode", "requests", "failed", "rps", "p50_ms", "p90_ms", "p99_ms"])
    print(f"keys and quotas cost: {cost:+.1%} of requests per second")
    path = save(args.output, {"model": "tiny (tests' model: 2 layers, hidden 64, byte-level tokenizer)",
                              "clients": args.clients, "max_tokens": args.max_tokens, "rounds": rounds,
                              "summary": summary, "auth_cost_rps": round(cost, 4),
                              "load_average_1m_at_end": os.getloadavg()[0]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
