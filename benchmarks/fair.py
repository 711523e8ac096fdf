"""A small request's latency beside a heavy neighbour: shortest-first admission against first come, first served.

The endpoint serves the tests' tiny model (built from a config) on a real port. A heavy client keeps
``--heavy-clients`` requests of ``--heavy-tokens`` completion tokens in flight (greedy: the untaught tiny model never
stops early, so each takes all its tokens); a light client sends requests of 2 tokens one after another and
records their latency. Run twice on one server config, the only change being ``serving.fair_wait_seconds``: the
default (30 s: the request asking for the fewest tokens goes next) and 1 microsecond (every waiting request has
"waited long enough", so the oldest goes next: first come, first served). Each heavy request asks for a different
number of tokens, so no two share a sampling call.

    .venv/bin/python benchmarks/fair.py                 # 4 heavy clients of 1000 tokens, 30 s per mode
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


def run(config: Any, heavy_clients: int, heavy_tokens: int, seconds: float) -> dict[str, Any]:
    import httpx

    from evertrain.serving.app import EndpointServer
    from evertrain.serving.auth import create_key

    with EndpointServer(config, port=0) as server:
        key, _row = create_key(server.endpoint.store, f"benchmark-{config.serving.fair_wait_seconds:g}", "infer",
                               actor="benchmarks/fair.py")
        headers = {"Authorization": f"Bearer {key}"}
        url = f"{server.url}/v1/chat/completions"
        stop = threading.Event()
        heavy_done: list[float] = []

        def chat(max_tokens: int) -> dict[str, Any]:
            return {"model": config.name, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": max_tokens, "temperature": 0}

        def heavy(offset: int) -> None:
            with httpx.Client(timeout=600) as client:
                while not stop.is_set():
                    began = time.perf_counter()
                    client.post(url, json=chat(heavy_tokens - offset), headers=headers).raise_for_status()
                    heavy_done.append((time.perf_counter() - began) * 1000)

        threads = [threading.Thread(target=heavy, args=(i,)) for i in range(heavy_clients)]
        for thread in threads:
            thread.start()
        time.sleep(2)  # the heavy queue fills
        light: list[float] = []
        with httpx.Client(timeout=600) as client:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                began = time.perf_counter()
                client.post(url, json=chat(2), headers=headers).raise_for_status()
                light.append((time.perf_counter() - began) * 1000)
        stop.set()
        for thread in threads:
            thread.join()
    return {"light_requests": len(light), "light_p50_ms": round(percentile(light, 50), 1),
            "light_p90_ms": round(percentile(light, 90), 1), "light_max_ms": round(max(light), 1),
            "heavy_requests": len(heavy_done), "heavy_p50_ms": round(statistics.median(heavy_done), 1),
            "heavy_max_ms": round(max(heavy_done), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heavy-clients", type=int, default=4, help="heavy requests kept in flight (default 4)")
    parser.add_argument("--heavy-tokens", type=int, default=1000, help="tokens per heavy request (default 1000)")
    parser.add_argument("--seconds", type=float, default=30, help="how long the light client sends (default 30)")
    parser.add_argument("--output", default="fair", help="results file name under benchmarks/results/")
    args = parser.parse_args()

    os.environ.setdefault("EVERTRAIN_PROGRESS", "0")
    from evertrain.quiet import quiet_libraries

    quiet_libraries()
    from evertrain.config import load_config
    from evertrain.runtime import Runtime

    _root, data = tiny_campaign("evertrain-fair-bench-", "fair", "calculator")
    data["model"]["rollout_dtype"] = "float32"
    schema = type(load_config(None))
    with Runtime.open(schema.model_validate(data)) as rt:
        rt.ensure_started()
    rows = []
    for mode, wait in (("shortest first (default)", 30.0), ("first come, first served", 1e-6)):
        data["serving"] = {"fair_wait_seconds": wait}
        rows.append({"admission": mode, **run(schema.model_validate(data), args.heavy_clients, args.heavy_tokens,
                                              args.seconds)})
    print(f"\na light client (2-token requests, one at a time) beside {args.heavy_clients} heavy requests of "
          f"{args.heavy_tokens} tokens kept in flight, tiny model, {args.seconds:g} s each")
    print_table(rows, ["admission", "light_requests", "light_p50_ms", "light_p90_ms", "light_max_ms",
                       "heavy_requests", "heavy_p50_ms", "heavy_max_ms"])
    path = save(args.output, {"model": "tiny (tests' model: 2 layers, hidden 64, byte-level tokenizer)",
                              "heavy_clients": args.heavy_clients, "heavy_tokens": args.heavy_tokens,
                              "seconds": args.seconds, "rows": rows, "load_average_1m_at_end": os.getloadavg()[0]})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
