"""Data-parallel GRPO steps across processes with accelerate (``accelerate launch``; gloo on CPU, NCCL on GPUs).

Every process loads the same starting weights (a fresh LoRA adapter is initialised from the same seed),
takes its share of each minibatch's groups (whole groups: a group's completions share one prompt's KV
cache), computes its microbatch losses with the normaliser of the *whole* minibatch, and the gradients
are summed across processes with an all-reduce before one identical optimizer step everywhere. Summing
(not averaging, as DDP does) is what makes N processes equal one: each local loss is already its share
of the minibatch loss. Process 0 writes the checkpoint and the per-step losses.

Run it with a spec written by :func:`write_spec`::

    accelerate launch --multi_gpu --num_processes 2 -m evertrain.models.data_parallel SPEC.json

(``python -m evertrain.models.data_parallel SPEC.json`` is the same with one process.) On a CPU the
Accelerator is made with ``cpu=True`` and joins the processes over gloo; accelerate's own ``--cpu`` flag
would start a single process unless MPI is set up, so ``--multi_gpu`` (torch's elastic launcher) starts them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch


def write_spec(path: Path, *, checkpoint: str, groups: list[dict[str, Any]], minibatches: list[list[int]],
               out: str, learning_rate: float, microbatch_size: int, temperature: float = 1.0, seed: int = 0,
               algorithm: str = "grpo", clip_low: float = 0.2, clip_high: float = 0.2, is_cap: float = 2.0,
               finetune: str = "lora", lora: dict[str, Any] | None = None, max_grad_norm: float = 1.0) -> Path:
    """A JSON spec of the steps to take: ``groups`` are ``{"prompt", "members": [{"ids", "logprobs",
    "advantage", "loss_mask"}]}``; ``minibatches`` lists group indices per optimizer step."""
    path.write_text(json.dumps({
        "checkpoint": checkpoint, "groups": groups, "minibatches": minibatches, "out": out,
        "learning_rate": learning_rate, "microbatch_size": microbatch_size, "temperature": temperature, "seed": seed,
        "algorithm": algorithm, "clip_low": clip_low, "clip_high": clip_high, "is_cap": is_cap,
        "finetune": finetune, "lora": lora or {}, "max_grad_norm": max_grad_norm}))
    return path


def _micro(groups: list[dict[str, Any]], size: int) -> list[list[dict[str, Any]]]:
    batches: list[list[dict[str, Any]]] = [[]]
    count = 0
    for group in groups:
        if batches[-1] and count + len(group["members"]) > size:
            batches.append([])
            count = 0
        batches[-1].append(group)
        count += len(group["members"])
    return [b for b in batches if b]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Take the spec's optimizer steps in this process's share; returns (on every process) the losses."""
    from accelerate import Accelerator

    from evertrain.config import LoraConfig
    from evertrain.models.grpo import LossNorm, policy_loss
    from evertrain.models.policy import grouped_logprobs, load_policy, read_manifest, save_checkpoint

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(spec["seed"])  # the same fresh adapter in every process
    model, tokenizer = load_policy(spec["checkpoint"], trainable=True, lora=LoraConfig(**spec["lora"]),
                                   finetune=spec["finetune"], device=str(accelerator.device))
    model.eval()  # deterministic forward (no dropout): every process computes the same function
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec["learning_rate"])
    groups, losses = spec["groups"], []
    for minibatch in spec["minibatches"]:
        chosen = [groups[i] for i in minibatch]
        members = [m for g in chosen for m in g["members"]]
        norm = LossNorm(sequences=len(members), tokens=sum(sum(m["loss_mask"]) for m in members),
                        max_completion_length=max(len(m["ids"]) for m in members))
        mine = chosen[rank::world]  # whole groups, dealt round-robin
        optimizer.zero_grad(set_to_none=False)
        local = torch.zeros((), device=accelerator.device)
        for micro in _micro(mine, spec["microbatch_size"]):
            part = [m for g in micro for m in g["members"]]
            logps, mask = grouped_logprobs(model, [g["prompt"] for g in micro],
                                           [[m["ids"] for m in g["members"]] for g in micro],
                                           temperature=spec["temperature"], pad_id=tokenizer.pad_token_id)
            behaviour = torch.zeros_like(logps)
            loss_mask = torch.zeros_like(mask)
            for row, m in enumerate(part):
                behaviour[row, :len(m["logprobs"])] = torch.tensor(m["logprobs"])
                loss_mask[row, :len(m["loss_mask"])] = torch.tensor(m["loss_mask"], dtype=torch.bool)
            mask = mask & loss_mask
            anchor = logps.detach()  # the proximal policy: these are one step of fresh rollouts
            weights = torch.exp(anchor - behaviour).clamp(max=spec["is_cap"]) * mask
            advantages = torch.tensor([m["advantage"] for m in part], device=logps.device)
            loss, _ = policy_loss(logps, anchor, advantages, mask, norm, algorithm=spec["algorithm"],
                                  clip_low=spec["clip_low"], clip_high=spec["clip_high"], is_weights=weights)
            loss.backward()
            local += loss.detach()
        for p in params:  # a process without groups still takes part, with zero gradients
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if world > 1:
            for p in params:
                p.grad = accelerator.reduce(p.grad, reduction="sum")
            local = accelerator.reduce(local, reduction="sum")
        torch.nn.utils.clip_grad_norm_(params, spec["max_grad_norm"])
        optimizer.step()
        losses.append(float(local))
    if accelerator.is_main_process:
        out = Path(spec["out"])
        save_checkpoint(model, out, read_manifest(spec["checkpoint"])["base_model"])
        (out / "losses.json").write_text(json.dumps({"losses": losses, "processes": world}))
    accelerator.wait_for_everyone()
    return {"losses": losses, "processes": world}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m evertrain.models.data_parallel SPEC.json")
    from evertrain.runtime import quiet_libraries

    quiet_libraries()
    run(json.loads(Path(argv[0]).read_text()))


if __name__ == "__main__":
    main()
