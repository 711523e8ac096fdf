"""The quality check's probes on reasoning-gym environments, scored one sandbox each and together in one sandbox.

Curation runs the wrong-answer probes (:data:`evertrain.envs.quality.CURATION_PROBES`) on every candidate of an
environment graded on a final answer. A reasoning-gym environment scores them together
(:meth:`ReasoningGym.verify_probes`): one sandbox per generator, its module loaded once, each probe scored alone in
a process forked from it. This grades the same probes both ways on ``--problems`` training problems of each
generator, checks the verdicts agree (reward, pass, reason) and measures the CPU-seconds of each way (this process
and its sandboxes).

    .venv/bin/python benchmarks/probe_batch.py [--generators basic_arithmetic,chain_sum] [--problems 6]

Prints a table and writes ``benchmarks/results/probe_batch.json``.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import print_table, save  # noqa: E402
from evertrain.envs import reasoning_gym as rg  # noqa: E402
from evertrain.envs.quality import CURATION_PROBES, probes_for  # noqa: E402

# the reasoning-gym generators of the twenty-environment test (tests/test_many_envs.py), two move-list scorers,
# propositional logic and one symbolic generator (graded in two runs: scored one run each either way)
GENERATORS = ("basic_arithmetic", "chain_sum", "leg_counting", "word_sorting", "spell_backward", "products",
              "number_sorting", "count_primes", "lcm", "base_conversion", "caesar_cipher", "simple_equations",
              "fraction_simplification", "count_bits", "rush_hour", "sokoban", "propositional_logic",
              "polynomial_multiplication")


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generators", default=",".join(GENERATORS), help="comma-separated generator names")
    parser.add_argument("--problems", type=int, default=6, help="training problems per generator")
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for generator in args.generators.split(","):
        env = rg.ReasoningGym(generator, eval_size=2)
        problems = env.problems("train", args.problems, args.seed)
        items = [(p, completion) for p in problems for _, completion in probes_for(env, p, None, CURATION_PROBES)]
        began = cpu_seconds()
        alone = [env.verify(problem, completion) for problem, completion in items]
        middle = cpu_seconds()
        together = env.verify_probes(items)
        ended = cpu_seconds()
        differ = sum((a.reward, a.passed, a.reason) != (b.reward, b.passed, b.reason)
                     for a, b in zip(alone, together, strict=True))
        rows.append({"generator": generator, "symbolic": generator in rg.SYMBOLIC, "probes": len(items),
                     "passed": sum(v.passed for v in together), "differ": differ,
                     "cpu_s_alone": round(middle - began, 3), "cpu_s_together": round(ended - middle, 3)})
        print(rows[-1], flush=True)
    batched = [r for r in rows if not r["symbolic"]]
    summary = {"probes": sum(r["probes"] for r in rows), "differ": sum(r["differ"] for r in rows),
               "batched_probes": sum(r["probes"] for r in batched),
               "batched_cpu_s_alone": round(sum(r["cpu_s_alone"] for r in batched), 2),
               "batched_cpu_s_together": round(sum(r["cpu_s_together"] for r in batched), 2)}
    print_table(rows, ["generator", "symbolic", "probes", "passed", "differ", "cpu_s_alone", "cpu_s_together"])
    print(summary)
    print(f"saved {save('probe_batch', {'problems': args.problems, 'seed': args.seed, 'rows': rows, **summary})}")


if __name__ == "__main__":
    main()
