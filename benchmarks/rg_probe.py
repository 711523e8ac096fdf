"""Base-model pass rates on reasoning-gym environments: which ``rg:<generator>`` domains give RL signal.

A campaign only learns from groups holding both a pass and a fail, so a domain whose base pass rate is 0
gives GRPO nothing. This samples, for each domain, G completions of the base SmolLM2-135M-Instruct for
``--problems`` train-split problems, exactly as a rollout does (the environment's own messages, the chat
template, bfloat16 sampling at temperature 0.8, one seed per group), and grades every completion with
the environment's own ``verify`` (the strict grader: one final ``#### <answer>`` line, the generator's
scorer in the sandbox, full credit only). A domain is a generator plus its config: the built-in table
:data:`CANDIDATES` holds easy configs (``chain_sum:1d2t`` ...); a bare generator name means its defaults;
``--config-json`` gives the config of every listed domain on the command line instead.

``--examples-json`` gives the environment's ``examples`` option: the given (user, assistant) pairs replace its
one generic worked example (a spelling one), exactly as a campaign configured with that option sends them.
Rows measured so are marked ``"prompt": "custom examples"``.

    .venv/bin/python benchmarks/rg_probe.py [--domains chain_sum:1d2t,syllogism] [--problems 3] [--samples 8]
        [--max-new-tokens 48] [--dtype bfloat16] [--config-json '{"min_terms": 2}'] [--threads 1] [--list]
        [--examples-json '[["What is 2 + 3?", "2 + 3 = 5\\n#### 5"]]'] [--out rg_probe] [--merge]

Prints a table (passes, pass rate, groups with signal: 0 < passes < G) and saves it, with the command and
machine, to benchmarks/results/<--out>.json (default rg_probe), after every domain; ``--merge`` keeps the
rows already saved there, but those of a domain measured again with the same prompt and problems x samples.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (generator, config): easy configs of the generators a 135M model may solve now and then
CANDIDATES: dict[str, tuple[str, dict[str, Any]]] = {
    "basic_arithmetic:add1": ("basic_arithmetic", {
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
        "allow_parentheses": False, "allow_negation": False}),
    "basic_arithmetic:pm1": ("basic_arithmetic", {
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
        "allow_parentheses": False, "allow_negation": False}),
    "chain_sum:1d2t": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "chain_sum:2d2t": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    "products:1d2t": ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "leg_counting:1animal": ("leg_counting", {"min_animals": 1, "max_animals": 1, "min_instances": 1,
                                              "max_instances": 2}),
    "letter_counting:1-2words": ("letter_counting", {"min_words": 1, "max_words": 2}),
    "number_sorting:3int": ("number_sorting", {"min_numbers": 3, "max_numbers": 3, "min_decimals": 0,
                                               "max_decimals": 0, "min_value": 0.0, "max_value": 20.0}),
    "spell_backward:3-4": ("spell_backward", {"min_word_len": 3, "max_word_len": 4}),
    "gcd:small": ("gcd", {"min_value": 1, "max_value": 20}),
    "lcm:small": ("lcm", {"min_value": 1, "max_value": 10}),
    # a config with fewer distinct items than the held-out pool (100) leaves no train problem: keep >= ~200
    "count_bits:small": ("count_bits", {"min_n": 1, "max_n": 1000}),
    "base_conversion:small": ("base_conversion", {"min_base": 2, "max_base": 10, "min_value": 0, "max_value": 15}),
    "power_function:small": ("power_function", {"min_base": 1.0, "max_base": 5.0, "min_exponent": 0,
                                                "max_exponent": 2}),
    "prime_factorization:small": ("prime_factorization", {"min_value": 2, "max_value": 200}),
    "simple_equations:small": ("simple_equations", {"min_terms": 2, "max_terms": 2, "min_value": 1,
                                                    "max_value": 10, "operators": ["+"],
                                                    "operators_weights": [1.0]}),
    "word_sorting:3short": ("word_sorting", {"min_words": 3, "max_words": 3, "min_word_length": 3,
                                             "max_word_length": 5}),
    "needle_haystack:small": ("needle_haystack", {"min_num_statements": 2, "max_num_statements": 4}),
    "isomorphic_strings:short": ("isomorphic_strings", {"min_string_length": 2, "max_string_length": 3}),
    "ransom_note:short": ("ransom_note", {"min_note_length": 1, "max_note_length": 2, "min_magazine_length": 2,
                                         "max_magazine_length": 5}),
    "count_primes:small": ("count_primes", {"min_n": 1, "max_n": 20}),
    "fraction_simplification:small": ("fraction_simplification", {"min_value": 1, "max_value": 10, "min_factor": 2,
                                                                  "max_factor": 3, "styles": ["plain"]}),
    "number_filtering:3int": ("number_filtering", {"min_numbers": 3, "max_numbers": 3, "min_decimals": 0,
                                                   "max_decimals": 0, "min_value": 0.0, "max_value": 20.0}),
    "palindrome_generation:3": ("palindrome_generation", {"min_length": 3, "max_length": 3}),
    "bitwise_arithmetic:1": ("bitwise_arithmetic", {"difficulty": 1}),
    "self_reference:1": ("self_reference", {"difficulty": 1}),
    "binary_alternation:short": ("binary_alternation", {"min_n": 2, "max_n": 4}),
}


def resolve(name: str, config_json: str | None) -> tuple[str, dict[str, Any]]:
    """A domain's generator and config: ``--config-json`` first, then the table, then the defaults."""
    if name.startswith("rg:"):
        name = name[3:]
    generator, config = CANDIDATES.get(name, (name.split(":", 1)[0], {}))
    if config_json is not None:
        config = json.loads(config_json)
    return generator, dict(config)


def probe(domain: str, generator: str, config: dict[str, Any], model: Any, tokenizer: Any,
          args: argparse.Namespace) -> dict[str, Any]:
    """Sample and grade one domain; a row of the table (``error`` set if the environment cannot be built)."""
    from evertrain.envs import registry
    from evertrain.inference.local import sample
    from evertrain.models.checkpoint import encode_chat
    from evertrain.runtime import seed_for

    row: dict[str, Any] = {"domain": domain, "env": f"rg:{generator}", "config": config,
                           "prompt": "custom examples" if args.examples_json else "environment's own",
                           "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "dtype": args.dtype}
    try:
        examples = json.loads(args.examples_json) if args.examples_json else None
        env = registry.get(f"rg:{generator}", config=config, **({"examples": examples} if examples else {}))
        problems = env.problems("train", args.problems, seed_for(args.seed, 0, env.name))
    except Exception as error:  # a config the generator refuses: reported, not fatal to the sweep
        return {**row, "error": f"{type(error).__name__}: {error}"[:300]}
    began = time.perf_counter()
    prompts = [encode_chat(tokenizer, env.messages(p)) for p in problems]
    # as the rollout stage does: temperature sampling, each group seeded by (seed, iteration, problem id)
    groups, stats = sample(model, tokenizer, prompts, args.samples, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, batch_size=64,
                           seeds=[seed_for(args.seed, 0, "rollout", p.id) for p in problems])
    sampled = time.perf_counter()
    passes, reasons, per_group, passing, failures = 0, Counter[str](), [], [], []
    for problem, group in zip(problems, groups, strict=True):
        group_passes = 0
        for completion in group:
            verdict = env.verify(problem, completion.text)
            reasons[verdict.reason] += 1
            if verdict.passed:
                group_passes += 1
                if len(passing) < 3:
                    passing.append({"question": problem.prompt[:300], "completion": completion.text})
            elif len(failures) < 2:
                failures.append({"question": problem.prompt[:300], "answer": problem.payload.get("answer"),
                                 "completion": completion.text, "reason": verdict.reason})
        per_group.append(group_passes)
        passes += group_passes
    total = len(problems) * args.samples
    return {**row, "problems": len(problems), "samples": args.samples, "completions": total, "passes": passes,
            "pass_rate": passes / total if total else 0.0,
            "signal_groups": sum(0 < k < args.samples for k in per_group), "per_group": per_group,
            "reasons": dict(reasons.most_common()), "completion_tokens": stats.completion_tokens,
            "sample_s": round(sampled - began, 1), "grade_s": round(time.perf_counter() - sampled, 1),
            "passing_examples": passing, "failing_examples": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", default=",".join(CANDIDATES),
                        help="comma-separated: names of the built-in table, or generators (their defaults)")
    parser.add_argument("--problems", type=int, default=3, help="train-split problems per domain")
    parser.add_argument("--samples", type=int, default=8, help="completions per problem (the group size G)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--config-json", default=None, help="the generator config of every listed domain")
    parser.add_argument("--examples-json", default=None,
                        help="[[user, assistant], ...]: the environment's examples option (replacing its generic one)")
    parser.add_argument("--seed", type=int, default=0, help="the campaign seed problems and samples derive from")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default="rg_probe", help="results file name under benchmarks/results/")
    parser.add_argument("--merge", action="store_true", help="keep saved rows of domains not measured again")
    parser.add_argument("--list", action="store_true", help="print the built-in table of configs and exit")
    args = parser.parse_args()
    if args.list:
        for name, (generator, config) in CANDIDATES.items():
            print(f"{name:32s} rg:{generator} {json.dumps(config)}")
        return
    from evertrain.quiet import quiet_libraries

    quiet_libraries()
    import torch

    from benchmarks.common import RESULTS, print_table, save
    from evertrain.config import ModelConfig
    from evertrain.models.checkpoint import load_policy, resolve_base, write_base_checkpoint
    from evertrain.models.precision import set_threads

    set_threads(args.threads)
    base = resolve_base(ModelConfig(path="embedded:smollm2-135m-instruct",
                                    models_dir=str(ROOT / "state" / "models")))
    checkpoint = write_base_checkpoint(Path(tempfile.mkdtemp()) / "base", base)
    model, tokenizer = load_policy(checkpoint, dtype=getattr(torch, args.dtype))
    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    earlier: list[dict[str, Any]] = []
    saved = RESULTS / f"{args.out}.json"
    if args.merge and saved.exists():
        measured = {(d, "custom examples" if args.examples_json else "environment's own", args.problems, args.samples)
                    for d in domains}
        earlier = [r for r in json.loads(saved.read_text()).get("rows", [])
                   if (r["domain"], r.get("prompt", "environment's own"), r.get("problems"), r.get("samples"))
                   not in measured]
    rows: list[dict[str, Any]] = []
    wall0 = time.perf_counter()
    for domain in domains:
        generator, config = resolve(domain, args.config_json)
        row = probe(domain, generator, config, model, tokenizer, args)
        rows.append(row)
        shown = {k: v for k, v in row.items() if k not in ("passing_examples", "failing_examples", "config")}
        print(json.dumps(shown), flush=True)
        save(args.out, {
            "settings": {k: v for k, v in vars(args).items() if k != "list"}, "wall_s": time.perf_counter() - wall0,
            "rows": earlier + rows,
            "note": "base SmolLM2-135M-Instruct, sampled as a rollout (temperature, one seed per group), graded by "
                    "the environment's own verify (strict: full credit only). signal_groups: groups with "
                    "0 < passes < samples, the ones GRPO learns from."})
    table = []
    for r in earlier + rows:
        label = r["domain"] + (" +ex" if r.get("prompt") == "custom examples" else "")
        table.append({**r, "domain": label, "rate": r.get("pass_rate", ""),
                      "n": f"{r.get('problems', 0)}x{r.get('samples', 0)}",
                      "top_reason": next(iter(r.get("reasons", {})), r.get("error", ""))[:40]})
    print_table(table, ["domain", "n", "passes", "rate", "signal_groups", "top_reason", "sample_s", "grade_s"])
    print(f"\nsaved {saved.relative_to(ROOT)}  ({time.perf_counter() - wall0:.0f} s)")


if __name__ == "__main__":
    main()
