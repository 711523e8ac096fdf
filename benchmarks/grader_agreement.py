"""Base-model answers graded by this checkout's graders and by another checkout's: do pass rates change?

    python benchmarks/grader_agreement.py --old-checkout /path/to/main [--samples 2] [--tokens 48]
        [--envs terminal,rg:basic_arithmetic,rg:products] [--rg-tokens N] [--items 30] [--seed 1]
        [--shipped-options] [--out FILE]

The embedded SmolLM2-135M-Instruct (the shipped configs' base model) answers the environments whose graders
or pools changed in issue 41 (configs/terminal.toml's: the terminal's generated held-out gate tasks and level-0
training tasks, 48 tokens a turn; configs/domains.toml's: rg:basic_arithmetic and rg:products, by default with
reasoning-gym's default configs, not the 1-digit ones that file sets: see ``--shipped-options``), greedily and with
``--samples`` samples at temperature 0.5. Every episode is graded here and, in a
child process whose ``PYTHONPATH`` is ``--old-checkout``, by the old graders on the same text (the terminal's
old command log included prose, so it is rebuilt there from the same turns). Prints a table and writes
benchmarks/results/grader_agreement.json: pass rates under both, every disagreement, and the held-out pools'
sizes and ids dropped.

``--envs`` (comma-separated) picks other environments (any ``rg:<generator>``; ``terminal``), ``--rg-tokens``
the token budget of the single-turn rg environments (default ``--tokens``), ``--items`` the held-out items per
rg environment, ``--seed`` the sampling seed. ``--shipped-options``: an rg environment that
configs/domains.toml lists is built with that file's options (its generator config and worked example); without
it, and for the environments that file does not list, with reasoning-gym's default config (as the first run
did). The plan is written to ``--out`` before sampling starts and replaced by the results at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine  # noqa: E402

# Run in the old checkout's child process: grade the stored episodes there (stdin: JSON; stdout: JSON).
_OLD_GRADER = r"""
import json, sys
import evertrain
from evertrain.envs import registry
from evertrain.envs.terminal_levels import task_names
data = json.load(sys.stdin)
out = {}
for env_name, options, items in data:
    env = registry.get(env_name, **options)
    if env_name == "terminal":
        problems = {p.id: p for p in env.generated_problems([i["task"] for i in items], "train")}
    else:
        problems = {p.id: p for p in env.problems("eval", min(100, getattr(env, "eval_size", 100)), 0)}
    rewards = []
    for item in items:
        problem = problems.get(item["problem_id"])
        if problem is None:
            rewards.append(None)  # not in the old pool (or not rebuilt): counted apart
            continue
        text = env.episode_text(item["turns"]) if env_name == "terminal" else item["text"]
        rewards.append(env.verify(problem, text).reward)
    out[env_name] = {"pool": sorted(problems) if env_name != "terminal" else [], "rewards": rewards}
out["_evertrain_file"] = evertrain.__file__  # which checkout's package graded: checked in the parent
print(json.dumps(out))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-checkout", required=True)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/grader_agreement.json"))
    parser.add_argument("--envs", default="terminal,rg:basic_arithmetic,rg:products",
                        help="comma-separated environments (terminal, rg:<generator>)")
    parser.add_argument("--rg-tokens", type=int, default=None, help="tokens for the rg envs (default --tokens)")
    parser.add_argument("--items", type=int, default=30, help="held-out items per rg environment")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--shipped-options", action="store_true",
                        help="rg envs listed in configs/domains.toml take that file's options")
    args = parser.parse_args()
    rg_tokens = args.rg_tokens or args.tokens
    shipped: dict[str, dict] = {}
    if args.shipped_options:
        import tomllib

        domains = tomllib.loads((ROOT / "configs/domains.toml").read_text())
        shipped = {e["name"]: e.get("options", {}) for e in domains.get("environments", [])}
    plan = []
    for name in filter(None, (n.strip() for n in args.envs.split(","))):
        if name == "terminal":
            plan.append((name, {"held_out": "generated"}))
        elif name.startswith("rg:"):
            plan.append((name, shipped.get(name, {})))
        else:
            raise SystemExit(f"unknown environment {name!r}: terminal or rg:<generator>")
    plan_record = {"envs": [{"env": n, "options": o} for n, o in plan], "tokens": args.tokens,
                   "rg_tokens": rg_tokens, "rg_items": args.items, "samples": args.samples, "temperature": 0.5,
                   "greedy": True, "seed": args.seed, "shipped_options": args.shipped_options}
    Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "status": "running",
                                          "started": datetime.now(UTC).isoformat(), "plan": plan_record},
                                         indent=1) + "\n")

    import torch
    from transformers import AutoModelForCausalLM

    from evertrain.config import ModelConfig
    from evertrain.envs import registry
    from evertrain.envs.terminal_levels import task_names
    from evertrain.inference.episodes import sample_episodes
    from evertrain.inference.local import HFSampler
    from evertrain.models.checkpoint import encode_chat, load_tokenizer, resolve_base

    torch.set_num_threads(2)
    started = time.time()
    path = resolve_base(ModelConfig())
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    stored: list[tuple[str, dict, list[dict]]] = []
    new_rewards: dict[str, list[float]] = {}
    rows: list[dict] = []
    pools: dict[str, list[str]] = {}
    for name, options in plan:
        env = registry.get(name, **options)
        if name == "terminal":  # the gate's 27 generated held-out tasks and 18 level-0 training tasks
            problems = env.problems("eval", 27, 0) + env.generated_problems(task_names(18, 0), "train")
        else:
            problems = env.problems("eval", args.items, 0)
            pools[name] = sorted(p.id for p in env.problems("eval", min(100, env.eval_size), 0))
        prompts = [encode_chat(tokenizer, env.messages(p)) for p in problems]
        items: list[dict] = []
        rewards: list[float] = []
        for greedy, n in ((True, 1), (False, args.samples))[:1 + (args.samples > 0)]:
            groups, _ = sample_episodes(HFSampler(model, tokenizer), env, problems, prompts, n,
                                        max_new_tokens=args.tokens if name == "terminal" else rg_tokens,
                                        temperature=0.5, greedy=greedy, seed=args.seed)
            for problem, group in zip(problems, groups, strict=True):
                for episode in group:
                    turns = [{k: v for k, v in t.items() if k != "tokens"} for t in episode.turns]
                    items.append({"problem_id": problem.id, "task": problem.payload.get("task"), "turns": turns,
                                  "text": episode.text, "greedy": greedy,
                                  "oracle": problem.payload.get("answer") if name != "terminal" else None})
                    verdict = env.verify(problem, episode.text)
                    rewards.append(verdict.reward)
                    items[-1]["new_reason"] = verdict.reason
                    items[-1]["answer"] = verdict.detail.get("answer")  # what the grader read (rg: after ####)
        stored.append((name, options, items))
        new_rewards[name] = rewards
        print(f"{name}: {len(items)} episodes sampled and graded ({time.time() - started:.0f} s)", file=sys.stderr)
        # graded by the old checkout and written at once, env by env: a run cut short keeps what it finished
        done = subprocess.run([sys.executable, "-c", _OLD_GRADER], input=json.dumps([stored[-1]]),
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": args.old_checkout},
                              cwd=args.old_checkout, check=True)
        old = json.loads(done.stdout.strip().splitlines()[-1])
        old_package = old.pop("_evertrain_file")
        if not Path(old_package).resolve().is_relative_to(Path(args.old_checkout).resolve()):
            raise SystemExit(f"the old graders came from {old_package}, not from {args.old_checkout}")
        old_rewards, mine = old[name]["rewards"], new_rewards[name]
        both = [(o, n) for o, n in zip(old_rewards, mine, strict=True) if o is not None]
        disagree = [{"task": item["task"], "problem_id": item["problem_id"], "old": o, "new": n,
                     "commands": item["text"][:300], "new_reason": item.get("new_reason"),
                     "answer": item.get("answer"), "text_end": item["text"][-300:],
                     "oracle": item.get("oracle")}
                    for item, o, n in zip(items, old_rewards, mine, strict=True) if o is not None and o != n]
        dropped = sorted(set(old[name]["pool"]) - set(pools[name])) if name in pools else []
        row = {"env": name, "episodes": len(items), "graded_by_both": len(both),
               "old_pass": sum(o for o, _ in both) / max(1, len(both)),
               "new_pass": sum(n for _, n in both) / max(1, len(both)), "disagreements": disagree,
               "pool_dropped": dropped, "done_after_s": round(time.time() - started, 1)}
        rows.append(row)
        print(f"{name:22s} {len(items):>8} {row['old_pass']:>9.3f} {row['new_pass']:>9.3f} {len(disagree):>8} "
              f"{len(dropped):>12}  (old graders: {old_package})")
        final = len(rows) == len(plan)
        out = {"command": "python " + " ".join(sys.argv), "date": datetime.now(UTC).isoformat(),
               "machine": {**machine(), "note": "shared with other work"}, "old_checkout": args.old_checkout,
               "old_evertrain": old_package, "plan": plan_record,
               "status": "done" if final else f"running: {len(rows)} of {len(plan)} environments done",
               "wall_s": round(time.time() - started, 1), "environments": rows}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
