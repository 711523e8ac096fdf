"""Sampling throughput on this machine: the in-house sampler (float32, bfloat16) against a vLLM engine.

Both backends go through the same :class:`evertrain.inference.base.Sampler` interface the rollout and
evaluate stages use, on SmolLM2-135M-Instruct: a rollout of G completions for a batch of `arithmetic`
prompts, and a greedy evaluation of held-out problems. Reported per backend and precision: completion
tokens per second, wall and CPU seconds (for vLLM: the engine process and its worker, read from /proc),
prompt tokens served from the prefix cache, effective GFLOP/s (about 2 x 135M FLOP per token computed),
and the engine's start-up time (paid once per campaign process, never per stage).

    .venv/bin/python benchmarks/sampling.py [--prompts 16] [--group 8] [--tokens 24] [--eval 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FLOP_PER_TOKEN = 0.27e9  # SmolLM2-135M forward, as DESIGN.md measured


def cpu() -> float:
    t = os.times()
    return t.user + t.system


def process_tree_cpu(pid: int) -> float:
    from evertrain.inference.vllm_sampler import process_tree_cpu as tree

    return tree(pid)


def measure(sampler: Any, prompts: list[list[int]], n: int, greedy: bool, tokens: int, repeats: int,
            engine_pid: int | None) -> dict[str, Any]:
    wall0, cpu0 = time.perf_counter(), cpu()
    engine0 = process_tree_cpu(engine_pid) if engine_pid else 0.0
    for repeat in range(repeats):
        _, stats = sampler.sample(prompts, n, max_new_tokens=tokens, temperature=0.8, greedy=greedy, batch_size=64,
                                  seed=repeat)
    wall = (time.perf_counter() - wall0) / repeats
    used = (cpu() - cpu0 + (process_tree_cpu(engine_pid) - engine0 if engine_pid else 0.0)) / repeats
    computed = stats.prompt_tokens + stats.completion_tokens
    return {"completions": len(prompts) * n, "completion_tokens": stats.completion_tokens, "wall_s": wall,
            "cpu_s": used, "tokens_per_s": stats.completion_tokens / wall,
            "prompt_tokens_cached": stats.cached_prompt_tokens,
            "effective_gflops": computed * FLOP_PER_TOKEN / wall / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--eval", type=int, default=200, help="held-out problems answered greedily")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--results-name", default="sampling",
                        help="write benchmarks/results/<name>.json (another machine's numbers beside this one's)")
    parser.add_argument("--backends", default="hf:float32,vllm:bfloat16,hf:bfloat16,vllm:float32")
    args = parser.parse_args()
    from evertrain.quiet import quiet_libraries

    quiet_libraries()
    from benchmarks.common import print_table, save
    from evertrain.config import CampaignConfig
    from evertrain.envs import registry
    from evertrain.inference.backends import open_sampler
    from evertrain.inference.vllm_sampler import Engines
    from evertrain.models.checkpoint import encode_chat, write_base_checkpoint
    from evertrain.models.convert import convert_smollm2
    from evertrain.models.precision import set_threads

    set_threads(None)
    base = convert_smollm2(ROOT / "state" / "models" / "SmolLM2-135M-Instruct")
    checkpoint = write_base_checkpoint(Path(tempfile.mkdtemp()) / "base", str(base))
    env = registry.get("arithmetic")
    train, held_out = env.problems("train", args.prompts, 0), env.problems("eval", args.eval, 0)
    rows = []
    load0 = os.getloadavg()[0]
    for spec in args.backends.split(","):
        backend, dtype = spec.split(":")
        config = CampaignConfig.model_validate({"model": {"path": str(base), "rollout_dtype": dtype},
                                                "generation": {"backend": backend}})
        began = time.perf_counter()
        engines = Engines()  # this backend's engine, stopped before the next is measured
        sampler, _ = open_sampler(config, checkpoint, engines)
        startup = time.perf_counter() - began
        engine_pid = sampler.engine.process.pid if backend == "vllm" else None
        tokenizer = sampler.tokenizer
        rollout = [encode_chat(tokenizer, env.messages(p)) for p in train]
        evaluation = [encode_chat(tokenizer, env.messages(p)) for p in held_out]
        sampler.sample(rollout[:2], 2, max_new_tokens=4, temperature=0.8)  # warm-up
        for mode, prompts, n, greedy in (("rollout", rollout, args.group, False),
                                         ("greedy eval", evaluation, 1, True)):
            row = measure(sampler, prompts, n, greedy, args.tokens, args.repeats, engine_pid)
            rows.append({"backend": backend, "dtype": dtype, "mode": mode, "startup_s": startup,
                         "load_average": os.getloadavg()[0], **row})
            print(rows[-1], flush=True)
        del sampler
        engines.close()
        # saved after every backend: a long run interrupted still leaves what it measured
        path = save(args.results_name, {
            "settings": vars(args), "rows": rows, "load_average_before": load0,
            "note": "startup_s: loading the weights (hf) or starting the vLLM engine (vllm, enforce_eager), paid "
                    "once per process. load_average: of the machine (2 cores) when the row was measured. Ceilings "
                    "measured here (DESIGN.md): 212 GFLOP/s float32, 925 GFLOP/s bfloat16 for a 2048x2048 matrix "
                    "product."})
    print_table(rows, ["backend", "dtype", "mode", "startup_s", "completions", "completion_tokens", "wall_s",
                       "cpu_s", "tokens_per_s", "prompt_tokens_cached", "effective_gflops", "load_average"])
    print(f"\nsaved {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
