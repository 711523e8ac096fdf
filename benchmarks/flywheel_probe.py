"""How often a model passes the calculator with tool v1 and with tool v2 (the drift demo's premise).

    python benchmarks/flywheel_probe.py [MODEL_DIR] [--versions 1,2] [--problems 24] [--tokens 48]

Greedy (pass@1) and 4 samples at temperature 0.8 per held-out problem, each a full episode with the tool run in
the sandbox and the final answer graded by the environment's verifier. MODEL_DIR: a checkpoint folder (default:
the embedded SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from evertrain.config import ModelConfig
from evertrain.envs import registry
from evertrain.inference.episodes import sample_episodes
from evertrain.inference.local import HFSampler
from evertrain.models.checkpoint import encode_chat, load_tokenizer, resolve_base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--versions", default="1,2")
    parser.add_argument("--problems", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = args.model or resolve_base(ModelConfig())
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for version in (int(v) for v in args.versions.split(",")):
        env = registry.get("calculator", tool_version=version)
        problems = env.problems("eval", args.problems, 0)
        prompts = [encode_chat(tokenizer, env.messages(p)) for p in problems]
        for greedy, n in ((True, 1), (False, 4)):
            began = time.time()
            groups, _ = sample_episodes(HFSampler(model, tokenizer), env, problems, prompts, n,
                                        max_new_tokens=args.tokens, temperature=0.8, greedy=greedy, seed=1)
            passed = sum(env.verify_transcript(p, e.turns).passed for p, g in zip(problems, groups, strict=True)
                         for e in g)
            total = sum(len(g) for g in groups)
            print(f"tool v{version} {'greedy' if greedy else 'T=0.8 '}: {passed}/{total} passed "
                  f"({time.time() - began:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
