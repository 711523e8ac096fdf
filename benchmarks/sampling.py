"""Sampling throughput of the policy on this machine: float32 against bfloat16, and effective GFLOP/s.

Samples G completions for a batch of `arithmetic` prompts with evertrain's sampler (shared-prefix
prefill, KV-cache fan-out to the group, finished rows leaving the batch) on SmolLM2-135M-Instruct, in
both precisions, and reports completion tokens per second, CPU seconds, and effective GFLOP/s counting
about 2 x 135M FLOP per token actually computed (prompt tokens computed once, plus completion tokens).

    .venv/bin/python benchmarks/sampling.py [--prompts 16] [--group 8] [--tokens 24]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FLOP_PER_TOKEN = 0.27e9  # SmolLM2-135M forward, as DESIGN.md measured


def cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from evertrain.runtime import quiet_libraries

    quiet_libraries()
    import torch

    from benchmarks.common import print_table, save
    from evertrain.envs import registry
    from evertrain.models.convert import convert_smollm2
    from evertrain.models.policy import encode_chat, load_policy, sample, set_threads, write_base_checkpoint

    set_threads(None)
    base = convert_smollm2(ROOT / "models" / "SmolLM2-135M-Instruct")
    checkpoint = write_base_checkpoint(Path(tempfile.mkdtemp()) / "base", str(base))
    env = registry.get("arithmetic")
    problems = env.problems("train", args.prompts, 0)
    rows = []
    for dtype in ("float32", "bfloat16"):
        model, tokenizer = load_policy(checkpoint, dtype=getattr(torch, dtype))
        prompts = [encode_chat(tokenizer, env.messages(p)) for p in problems]
        sample(model, tokenizer, prompts[:2], 2, max_new_tokens=4, temperature=0.8)  # warm-up
        for mode, n, greedy in (("rollout", args.group, False), ("greedy eval", 1, True)):
            wall0, cpu0 = time.perf_counter(), cpu()
            for repeat in range(args.repeats):
                _, stats = sample(model, tokenizer, prompts, n, max_new_tokens=args.tokens, temperature=0.8,
                                  greedy=greedy, batch_size=64, seed=repeat)
            wall, used = (time.perf_counter() - wall0) / args.repeats, (cpu() - cpu0) / args.repeats
            computed = stats.prompt_tokens + stats.completion_tokens
            rows.append({"dtype": dtype, "mode": mode, "completions": len(prompts) * n,
                         "completion_tokens": stats.completion_tokens, "wall_s": wall, "cpu_s": used,
                         "tokens_per_s": stats.completion_tokens / wall,
                         "prompt_tokens_cached": stats.cached_prompt_tokens,
                         "effective_gflops": computed * FLOP_PER_TOKEN / wall / 1e9})
    print_table(rows, ["dtype", "mode", "completions", "completion_tokens", "wall_s", "cpu_s", "tokens_per_s",
                       "prompt_tokens_cached", "effective_gflops"])
    path = save("sampling", {"settings": vars(args), "rows": rows,
                             "note": "ceilings measured here (DESIGN.md): 212 GFLOP/s float32, 925 GFLOP/s bfloat16 "
                                     "for a 2048x2048 matrix product"})
    print(f"\nsaved {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
