"""For a machine with a GPU: sampling, update step, peak memory and weight hand-off of the demo config on CUDA.

Needs only torch, transformers, peft and accelerate (plus this repository): no vLLM, no Prefect server, no
network. Sampling goes through the rollout stage's sampler interface: vLLM where an interpreter with
vllm exists (``--vllm-python``, default ``.venv-vllm/bin/python``), else the in-house sampler on CUDA.
Writes ``benchmarks/results/gpu.json``.

1. ``sampling``: the demo's rollout (16 arithmetic prompts x G = 8 x 24 tokens) and a greedy evaluation
   of 200 held-out problems, SmolLM2-135M-Instruct (``--model`` for any local HF folder): tokens/s.
2. ``update``: one GRPO step (LoRA, the demo's settings) on those rollouts: seconds and peak GPU memory,
   float32 against bfloat16 autocast.
3. ``handoff``: seconds to hand a new LoRA checkpoint to the sampler (the engine keeps running).
4. ``memory``: peak memory of one update step (forward, loss, backward) on a model built from a config
   with a 151,936-token vocabulary and long completions, evertrain with chunked log-probs against the
   full-logits computation TRL's GRPOTrainer uses (``selective_log_softmax`` over [rows, T, V] logits).
   Also runs on a CPU (``--only memory --device cpu``: peak RSS of a subprocess per variant).

    python benchmarks/gpu.py [--device cuda] [--only sampling,update,handoff,memory]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _peak_reset(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: Any) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def sampling_and_update(args: argparse.Namespace, record: dict[str, Any]) -> None:
    import torch

    from evertrain.config import CampaignConfig
    from evertrain.envs import registry
    from evertrain.inference.backends import open_sampler
    from evertrain.inference.vllm_sampler import Engines
    from evertrain.models.checkpoint import encode_chat, load_policy, save_checkpoint, write_base_checkpoint
    from evertrain.models.grpo import LossNorm, group_advantages, policy_loss
    from evertrain.models.logprobs import grouped_logprobs
    from evertrain.models.precision import autocast

    device = torch.device(args.device)
    base = args.model
    if base is None:
        from evertrain.models.convert import convert_smollm2

        base = str(convert_smollm2(ROOT / "state" / "models" / "SmolLM2-135M-Instruct"))
    scratch = Path(tempfile.mkdtemp())
    checkpoint = write_base_checkpoint(scratch / "base", base)
    backend = "vllm" if Path(args.vllm_python).exists() else "hf"
    config = CampaignConfig.model_validate({
        "model": {"path": base, "rollout_dtype": "bfloat16", "device": args.device},
        "generation": {"backend": backend, "vllm_python": args.vllm_python, "vllm_kv_cache_gib": None,
                       "vllm_gpu_memory_utilization": 0.5}})
    env = registry.get("arithmetic")
    began = time.perf_counter()
    engines = Engines()
    sampler, _ = open_sampler(config, checkpoint, engines)
    record["sampling"] = {"backend": backend, "startup_s": time.perf_counter() - began}
    prompts = [encode_chat(sampler.tokenizer, env.messages(p)) for p in env.problems("train", 16, 0)]
    held_out = [encode_chat(sampler.tokenizer, env.messages(p)) for p in env.problems("eval", 200, 0)]
    sampler.sample(prompts[:2], 2, max_new_tokens=4, temperature=0.8)  # warm-up
    for mode, batch, n, greedy in (("rollout", prompts, 8, False), ("greedy_eval", held_out, 1, True)):
        began = time.perf_counter()
        groups, stats = sampler.sample(batch, n, max_new_tokens=24, temperature=0.8, greedy=greedy, batch_size=256)
        seconds = time.perf_counter() - began
        record["sampling"][mode] = {"seconds": seconds, "completion_tokens": stats.completion_tokens,
                                    "tokens_per_s": stats.completion_tokens / seconds,
                                    "cached_prompt_tokens": stats.cached_prompt_tokens}
        if mode == "rollout":
            rollout = groups
    print(json.dumps(record["sampling"], indent=1), flush=True)

    if "update" in args.only or "handoff" in args.only:
        rewards = torch.tensor([[float(i % 2) for i in range(8)] for _ in rollout])
        advantages = group_advantages(rewards)
        record["update"] = {}
        for precision in ("float32", "bfloat16"):
            torch.manual_seed(0)
            model, tokenizer = load_policy(checkpoint, trainable=True, device=args.device)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            completions = [[s.completion_ids for s in g] for g in rollout]
            members = [s for g in rollout for s in g]
            norm = LossNorm(sequences=len(members), tokens=sum(len(s.completion_ids) for s in members),
                            max_completion_length=24)
            _peak_reset(device)
            began = time.perf_counter()
            for start in range(0, len(prompts), 2):  # microbatches of 2 groups (16 completions)
                with autocast(torch.bfloat16 if precision == "bfloat16" else None, model):
                    logps, mask = grouped_logprobs(model, prompts[start:start + 2], completions[start:start + 2],
                                                   temperature=0.8, pad_id=tokenizer.pad_token_id, chunk=512)
                part = members[start * 8:(start + 2) * 8]
                behaviour = torch.zeros_like(logps)
                for row, s in enumerate(part):
                    behaviour[row, :len(s.logprobs)] = torch.tensor(s.logprobs, device=logps.device)
                anchor = logps.detach()
                weights = torch.exp(anchor - behaviour).clamp(max=2.0) * mask
                loss, _ = policy_loss(logps, anchor, advantages[start:start + 2].flatten().to(logps.device), mask,
                                      norm, is_weights=weights)
                loss.backward()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            record["update"][precision] = {"step_s": time.perf_counter() - began, "peak_gib": _peak_gib(device)}
        print(json.dumps(record["update"], indent=1), flush=True)
        if "handoff" in args.only:
            lora = save_checkpoint(model, scratch / "v2", base)
            began = time.perf_counter()
            _, seconds = open_sampler(config, lora, engines)
            record["handoff"] = {"backend": backend, "seconds": seconds, "wall_s": time.perf_counter() - began}
            print(json.dumps(record["handoff"]), flush=True)
    engines.close()


def memory_variant(variant: str, device_name: str, rows: int, length: int, vocab: int) -> dict[str, Any]:
    """One update step of ``variant`` in this process; its peak memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from evertrain.models.grpo import LossNorm, policy_loss
    from evertrain.models.logprobs import grouped_logprobs

    device = torch.device(device_name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length + 64,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(device)
    prompt = torch.randint(0, vocab, (32,)).tolist()
    completions = [torch.randint(0, vocab, (length,)).tolist() for _ in range(rows)]
    norm = LossNorm(sequences=rows, tokens=rows * length, max_completion_length=length)
    advantages = torch.linspace(-1, 1, rows, device=device)
    baseline = _peak_gib(device)
    _peak_reset(device)
    began = time.perf_counter()
    if variant.startswith("evertrain"):
        chunk = 256 if variant == "evertrain_chunked" else None
        logps, mask = grouped_logprobs(model, [prompt], [completions], temperature=1.0, chunk=chunk)
    else:  # TRL's GRPOTrainer: whole-batch logits, then selective_log_softmax (trl.trainer.utils)
        from trl.trainer.utils import selective_log_softmax

        ids = torch.tensor([prompt + c for c in completions], device=device)
        logits = model(input_ids=ids).logits[:, len(prompt) - 1:-1, :] / 1.0
        logps = selective_log_softmax(logits, ids[:, len(prompt):])
        mask = torch.ones_like(logps, dtype=torch.bool)
    loss, _ = policy_loss(logps, logps.detach(), advantages, mask, norm)
    loss.backward()
    seconds = time.perf_counter() - began
    return {"variant": variant, "rows": rows, "completion_tokens": length, "vocabulary": vocab,
            "peak_gib": _peak_gib(device), "baseline_gib": baseline, "step_s": seconds,
            "full_logits_float32_gib": rows * length * vocab * 4 / 2**30}


def memory(args: argparse.Namespace, record: dict[str, Any]) -> None:
    rows = []
    for variant in ("evertrain_chunked", "evertrain_unchunked", "trl_full_logits"):
        # a fresh process per variant: peak memory (RSS on a CPU) is a high-water mark
        out = subprocess.run([sys.executable, __file__, "--memory-variant", variant, "--device", args.device,
                              "--rows", str(args.rows), "--length", str(args.length), "--vocab", str(args.vocab)],
                             capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            rows.append({"variant": variant, "error": out.stderr[-2000:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    record["memory"] = rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", default="sampling,update,handoff,memory")
    parser.add_argument("--model", default=None, help="a local HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--memory-variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", default="gpu")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.memory_variant:
        print(json.dumps(memory_variant(args.memory_variant, args.device, args.rows, args.length, args.vocab)))
        return
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: benchmarks/gpu.py is for a machine with a GPU "
                         "(`--only memory --device cpu` runs the memory comparison on a CPU)")
    from benchmarks.common import save

    record: dict[str, Any] = {"settings": vars(args)}
    if {"sampling", "update", "handoff"} & set(args.only.split(",")):
        sampling_and_update(args, record)
    if "memory" in args.only:
        memory(args, record)
    path = save(args.output, record)
    print(f"saved {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
