"""Data-parallel GRPO steps across processes with accelerate (``accelerate launch``; gloo on CPU, NCCL on GPUs).

Every process loads the same starting weights (a fresh LoRA adapter is initialised from the same seed),
takes its share of each minibatch's groups (whole groups: a group's completions share one prompt's KV
cache) and runs the update's own step, :func:`evertrain.models.grpo.train_step`, through torch's
DistributedDataParallel: each pass's loss is normalised by the *whole* minibatch, and the gradients are
summed across processes by DDP's bucketed all-reduce (a communication hook that sums, where DDP's default
averages) in the backward of the step's last pass, before one identical optimizer step everywhere.
Summing is what makes N processes equal one: each local loss is already its share of the minibatch loss.
Process 0 writes the checkpoint, the optimizer state and the per-step report.

The update stage (``update.processes > 1``, :func:`evertrain.tasks.update.update`) writes the spec and
launches this module with :func:`launch`. The step being the stage's, everything is done the same: the
ratio's anchor is the proximal log-probs the stage computed, each token is weighted by the truncated
importance weight against the sampler's, per-completion temperatures and top-p, Dr.GRPO's constant length,
the KL penalty to a reference, AdamW weight decay and restored moments, bfloat16 autocast, chunked
log-probs and gradient checkpointing. What it cannot do the same is refused before launching (see the
stage's docstring).

Run it with a spec written by :func:`write_spec`::

    accelerate launch --multi_gpu --num_processes 2 -m evertrain.models.data_parallel SPEC.json

(``python -m evertrain.models.data_parallel SPEC.json`` is the same with one process.) On a CPU the
Accelerator is made with ``cpu=True`` and joins the processes over gloo; accelerate's own ``--cpu`` flag
would start a single process unless MPI is set up, so ``--multi_gpu`` (torch's elastic launcher) starts them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from evertrain.config import LoraConfig
from evertrain.models.checkpoint import load_policy, read_manifest, save_checkpoint
from evertrain.models.grpo import Group, LogProbs, Member, StepSettings, train_step
from evertrain.models.precision import enable_gradient_checkpointing, update_precision
from evertrain.processes import free_port
from evertrain.quiet import quiet_libraries

REPORT = "losses.json"  # process 0's report in the output folder: losses, grad norms, statistics
_RAISED = re.compile(r"^(?!.*ChildFailedError)(\[rank\d+\]: )?([\w.]+(Error|Exception)(: .*|$))")


def write_spec(path: Path, *, checkpoint: str, groups: list[dict[str, Any]], minibatches: list[list[int]],
               out: str, learning_rate: float, microbatch_size: int, microbatch_tokens: int | None = None,
               temperature: float = 1.0, seed: int = 0,
               algorithm: str = "grpo", clip_low: float = 0.2, clip_high: float = 0.2, is_cap: float = 2.0,
               finetune: str = "lora", lora: dict[str, Any] | None = None, max_grad_norm: float = 1.0,
               weight_decay: float = 0.0, max_completion_length: int | None = None, kl_coef: float = 0.0,
               reference: str | None = None, precision: str = "float32", gradient_checkpointing: bool = False,
               logprob_chunk: int | None = None, optimizer_state: str | None = None, cpu: bool | None = None,
               threads: int | None = None) -> Path:
    """A JSON spec of the steps to take: ``groups`` are ``{"prompt", "members": [{"ids", "logprobs",
    "advantage", "loss_mask"}]}`` (a member may add ``"proximal"``: the ratio's anchor, the trainee's log-probs
    before the update; without it the anchor is the current log-probs, right for one step of fresh rollouts;
    and ``"temperature"``, ``"top_p"``: what it was sampled with, default ``temperature`` and 1);
    ``minibatches`` lists group indices per optimizer step. ``max_completion_length``: Dr.GRPO's constant
    (default: the minibatch's longest completion); ``reference``: the KL penalty's checkpoint (with
    ``kl_coef > 0``); ``optimizer_state``: an ``optimizer.pt`` whose AdamW moments to start from; ``cpu``:
    gloo on the CPU even where GPUs exist (default: GPUs when there are any); ``threads``: torch threads per
    process."""
    path.write_text(json.dumps({
        "checkpoint": checkpoint, "groups": groups, "minibatches": minibatches, "out": out,
        "learning_rate": learning_rate, "microbatch_size": microbatch_size,
        "microbatch_tokens": microbatch_tokens, "temperature": temperature, "seed": seed,
        "algorithm": algorithm, "clip_low": clip_low, "clip_high": clip_high, "is_cap": is_cap,
        "finetune": finetune, "lora": lora or {}, "max_grad_norm": max_grad_norm, "weight_decay": weight_decay,
        "max_completion_length": max_completion_length, "kl_coef": kl_coef, "reference": reference,
        "precision": precision, "gradient_checkpointing": gradient_checkpointing, "logprob_chunk": logprob_chunk,
        "optimizer_state": optimizer_state, "cpu": cpu, "threads": threads}))
    return path


def _groups(spec: dict[str, Any]) -> list[Any]:
    """The spec's groups as the update's :class:`~evertrain.models.grpo.Group` objects."""
    default = float(spec.get("temperature", 1.0))
    return [Group([int(t) for t in g["prompt"]], [
        Member(ids=m["ids"], logprobs=m["logprobs"], advantage=float(m["advantage"]), loss_mask=m["loss_mask"],
               proximal=m.get("proximal"), temperature=float(m.get("temperature", default)),
               top_p=float(m.get("top_p", 1.0))) for m in g["members"]]) for g in spec["groups"]]


def _summed(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the hook's annotations: none, or its own
    """DDP communication hook: gradients summed over the processes (DDP's default averages them). Each
    process's loss is already its share of the minibatch's, so the sum is the gradient of one process."""
    del state
    return torch.distributed.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Take the spec's optimizer steps in this process's share; returns (on every process) the losses."""
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    cpu = spec.get("cpu")
    accelerator = Accelerator(cpu=not torch.cuda.is_available() if cpu is None else bool(cpu))
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    rank, world = accelerator.process_index, accelerator.num_processes
    device = str(accelerator.device)
    torch.manual_seed(spec["seed"])  # the same fresh adapter in every process
    model, tokenizer = load_policy(spec["checkpoint"], trainable=True, lora=LoraConfig(**spec["lora"]),
                                   finetune=spec["finetune"], device=device)
    # train mode, as the stage's own loop (what gradient checkpointing needs); dropout would make the
    # processes differ, so the stage refuses a model with any
    model.train()
    checkpointing = bool(spec.get("gradient_checkpointing"))
    if checkpointing:
        enable_gradient_checkpointing(model)
    settings = StepSettings(
        algorithm=spec["algorithm"], clip_low=spec["clip_low"], clip_high=spec["clip_high"], is_cap=spec["is_cap"],
        kl_coef=float(spec.get("kl_coef") or 0.0), max_grad_norm=spec["max_grad_norm"],
        microbatch_size=spec["microbatch_size"], microbatch_tokens=spec.get("microbatch_tokens"),
        autocast_dtype=update_precision(spec.get("precision", "float32"), accelerator.device),
        pad_id=tokenizer.pad_token_id, chunk=spec.get("logprob_chunk"), shared_prefix=not checkpointing)
    reference = None
    if settings.kl_coef > 0:
        if not spec.get("reference"):
            raise ValueError("kl_coef > 0 needs a reference checkpoint in the spec")
        reference, _ = load_policy(spec["reference"], trainable=False, device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=spec["learning_rate"], weight_decay=spec.get("weight_decay", 0.0))
    if spec.get("optimizer_state"):
        optimizer.load_state_dict(torch.load(spec["optimizer_state"], weights_only=True))
    scorer: Any = LogProbs(model)
    if world > 1:
        # bucketed all-reduce in the backward of each step's last pass (the earlier passes run in no_sync)
        scorer = DistributedDataParallel(scorer, device_ids=[accelerator.device.index]
                                         if accelerator.device.type == "cuda" else None, broadcast_buffers=False)
        scorer.register_comm_hook(None, _summed)
    groups, losses, grad_norms, is_weights = _groups(spec), [], [], []
    stats_sum: dict[str, float] = {}
    began = time.perf_counter()
    for minibatch in spec["minibatches"]:
        chosen = [groups[i] for i in minibatch]
        step = train_step(scorer, optimizer, params, chosen, settings, reference=reference,
                          max_completion_length=spec.get("max_completion_length"),
                          share=chosen[rank::world])  # whole groups, dealt round-robin
        losses.append(step.loss)
        grad_norms.append(step.grad_norm)
        is_weights += step.is_weights
        for key, value in step.stats_sum.items():
            stats_sum[key] = stats_sum.get(key, 0.0) + value
    model_seconds = time.perf_counter() - began
    if world > 1:
        total_losses = accelerator.reduce(torch.tensor(losses, dtype=torch.float64, device=accelerator.device),
                                          reduction="sum")
        losses = [float(x) for x in total_losses.tolist()]
    report = {"losses": losses, "processes": world, "grad_norms": grad_norms, "model_s": model_seconds}
    _write_out(spec, accelerator, model, optimizer, report, {"stats_sum": stats_sum, "is_weights": is_weights})
    return {"losses": losses, "processes": world}


def _write_out(spec: dict[str, Any], accelerator: Any, model: Any, optimizer: torch.optim.Optimizer,
               report: dict[str, Any], mine: dict[str, Any]) -> None:
    """Process 0 writes the checkpoint, the optimizer state and the report, with every process's statistics."""
    parts = [mine]
    if accelerator.num_processes > 1:
        parts = [{} for _ in range(accelerator.num_processes)]
        torch.distributed.all_gather_object(parts, mine)
    if accelerator.is_main_process:
        out = Path(spec["out"])
        save_checkpoint(model, out, read_manifest(spec["checkpoint"])["base_model"])
        torch.save(optimizer.state_dict(), out / "optimizer.pt")
        total: dict[str, float] = {}
        for part in parts:
            for key, value in part["stats_sum"].items():
                total[key] = total.get(key, 0.0) + value
        (out / REPORT).write_text(json.dumps({
            **report, "stats_sum": total, "is_weights": [w for part in parts for w in part["is_weights"]]}))
    accelerator.wait_for_everyone()


def launch(spec_path: Path, processes: int, *, cpu: bool, threads: int | None = None,
           logs: Path | None = None) -> dict[str, Any]:
    """Run the spec in ``processes`` processes (``accelerate launch --multi_gpu``, one GPU each, or gloo on
    the CPU with ``cpu``) and return process 0's report. Their output goes to ``logs``/stdout.log and
    stderr.log (default: beside the spec); a failed launch raises RuntimeError with the tail of stderr."""
    spec = json.loads(spec_path.read_text())
    logs = logs or spec_path.parent
    logs.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
               str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), "-m", "evertrain.models.data_parallel", str(spec_path)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1" if cpu else "0"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(logs / "stdout.log", "w") as stdout, open(logs / "stderr.log", "w") as stderr:
        done = subprocess.run(command, stdout=stdout, stderr=stderr, env=env, check=False)
    report = Path(spec["out"]) / REPORT
    if done.returncode != 0 or not report.exists():
        text = (logs / "stderr.log").read_text(errors="replace")
        # the processes' own exceptions first (torch's launcher ends stderr with its summary of them)
        raised = [match.group(2).strip() for line in text.splitlines() if (match := _RAISED.match(line))]
        causes = "; ".join(dict.fromkeys(raised)) or "see below"
        raise RuntimeError(f"data-parallel update in {processes} processes failed (exit code {done.returncode}): "
                           f"{causes[:2000]}\ncommand: {' '.join(command)}\nlogs: {logs}\n"
                           f"the end of its stderr:\n{text[-4000:]}")
    return json.loads(report.read_text())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m evertrain.models.data_parallel SPEC.json")
    quiet_libraries()
    run(json.loads(Path(argv[0]).read_text()))


if __name__ == "__main__":
    main()
