"""Optional stage between score and update, ``sft``: supervised fine-tuning on trajectories chosen by SQL.

With ``sft.enabled = true`` the flow runs this stage after score. It selects rollouts with the SQL of
``sft.select`` (bound parameters ``$campaign`` and ``$iteration``; by default this iteration's passed
rollouts: rejection-sampling fine-tuning on the store's own successes), keeps at most
``sft.max_examples`` of them (one per group first, so one easy problem cannot fill the batch), and
trains the trainee on them with TRL's ``SFTTrainer``: the loss covers only the policy's own tokens
(the rollout's ``loss_mask``; prompt and tool output are context). The result is a checkpoint that the
update of the same iteration starts from (:func:`checkpoint_for`), so the challenger is SFT then RL.

Rerun and crash guarantees, like the other stages:

- The stage starts from the same trainee on every run of the iteration (the update's own
  ``start_version_of``: the trainee now, or the parent of what an earlier run of this iteration's
  update registered), with a seed fixed by (campaign seed, iteration), and writes its checkpoint with
  the same write-then-rename as every checkpoint, so a kill leaves no half checkpoint.
- The checkpoint is used only when this stage's row in ``stage_runs`` says completed: a checkpoint left
  by a killed run is ignored, and the rerun replaces it. A run that selects nothing removes any earlier
  run's checkpoint, so the update then starts from the trainee itself.
- Which rollouts were trained on is recorded in the ``sft_examples`` table (replaced per iteration).

With ``sft.method = "dpo"`` the stage trains on preference pairs instead, a passed rollout chosen over a
failed one of the same group, with TRL's ``DPOTrainer`` (tasks/dpo.py); everything above holds the same,
and ``sft_examples`` gives each rollout its ``pair`` and ``role`` ('chosen' or 'rejected').
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset
from prefect import task
from prefect.cache_policies import NO_CACHE
from trl import SFTConfig, SFTTrainer

from evertrain.models.checkpoint import encode_chat, load_policy, save_checkpoint
from evertrain.runtime import Runtime, seed_for
from evertrain.tasks.base import run_stage
from evertrain.tasks.dpo import pair_rows, select_pairs, train_dpo
from evertrain.tasks.warm_start import (  # noqa: F401  (checkpoint_dir, checkpoint_for: the stage's API)
    checkpoint_dir,
    checkpoint_for,
    quiet_trainer,
    run_select,
    start_version_of,
    trainer_arguments,
)

STAGE = "sft"


def select(rt: Runtime, iteration: int) -> Any:
    """The selected rollouts (token ids and loss masks), one per group first, at most ``max_examples``."""
    cfg = rt.config.sft
    return run_select(lambda: rt.store.sft_rollouts(rt.campaign, iteration, cfg.select, cfg.max_examples))


def bare_chat(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """``messages`` without worked examples: the leading system prompt(s) and the last message (the question)."""
    if not messages:
        raise ValueError("sft.prompt = 'bare': a selected rollout's problem has no stored chat")
    system = []
    for message in messages[:-1]:
        if message.get("role") != "system":
            break
        system.append(message)
    return [*system, messages[-1]]


def prompt_ids_for(row: Any, tokenizer: Any, prompt: str) -> list[int]:
    """The prompt a selected completion is trained after: as sampled, or (``sft.prompt = 'bare'``) its chat
    without worked examples, re-encoded."""
    if prompt != "bare":
        return [int(t) for t in row.prompt_ids]
    # context distillation: the same completion after the prompt without examples
    if not isinstance(row.messages, str):
        raise ValueError(f"sft.prompt = 'bare': problem {row.problem_id} of iteration {row.iteration} "
                         "is not in the problems table")
    return encode_chat(tokenizer, bare_chat(json.loads(row.messages)))


def sft(rt: Runtime, iteration: int) -> dict[str, Any]:
    config, cfg = rt.config, rt.config.sft
    dpo = cfg.method == "dpo"
    start_version = start_version_of(rt, iteration)
    frame = select_pairs(rt, iteration) if dpo else select(rt, iteration)
    path = checkpoint_dir(rt, iteration)
    examples = [{"campaign": rt.campaign, "iteration": iteration, "source_iteration": int(row.iteration),
                 "problem_id": row.problem_id, "sample": int(row.sample), "env": row.env,
                 **({"pair": int(row.pair), "role": row.role} if dpo else {})}
                for row in frame.itertuples(index=False)]
    rt.store.replace("sft_examples", {"campaign": rt.campaign, "iteration": iteration}, examples)
    if frame.empty:
        if path.exists():
            shutil.rmtree(path)
        why = ("no selected group holds both a passed and a failed rollout" if dpo
               else "sft.select chose no rollouts")
        return {"selected": 0, "start_version": start_version, "steps": 0, **({"pairs": 0} if dpo else {}),
                "skipped": f"{why}: the update starts from the trainee"}

    torch.manual_seed(seed_for(config.seed, iteration, STAGE, "init"))
    model, tokenizer = load_policy(rt.checkpoint(start_version), trainable=True, lora=config.update.lora,
                                   finetune=config.update.finetune, device=config.model.device)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rewritten = 0

    def prompt_of(row: Any) -> list[int]:
        nonlocal rewritten
        prompt = prompt_ids_for(row, tokenizer, cfg.prompt)
        rewritten += prompt != [int(t) for t in row.prompt_ids]
        return prompt

    if dpo:
        metrics = train_dpo(rt, iteration, model, tokenizer, pair_rows(frame, prompt_of), STAGE)
    else:
        metrics = _train_sft(rt, iteration, model, tokenizer, frame, prompt_of)
    model.eval()
    save_checkpoint(model, path, rt.base_model, parent_version=start_version, iteration=iteration, stage=STAGE,
                    method=cfg.method)
    return {
        "selected": len(frame), "groups": int(frame[["iteration", "problem_id"]].drop_duplicates().shape[0]),
        "start_version": start_version, "prompts_rewritten": rewritten, **metrics,
    }


def _train_sft(rt: Runtime, iteration: int, model: Any, tokenizer: Any, frame: Any,
               prompt_of: Callable[[Any], list[int]]) -> dict[str, Any]:
    """Train ``model`` in place on the selected rollouts with TRL's SFTTrainer; returns the stage's metrics."""
    cfg = rt.config.sft
    rows = []
    trained_tokens = 0
    for row in frame.itertuples(index=False):
        prompt, completion, mask = prompt_of(row), list(row.completion_ids), list(row.loss_mask)
        # the loss covers the policy's own tokens only: never the prompt, never a tool's output
        labels = [-100] * len(prompt) + [t if m else -100 for t, m in zip(completion, mask, strict=True)]
        trained_tokens += sum(1 for m in mask if m)
        rows.append({"input_ids": prompt + completion, "labels": labels})
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="evertrain-sft-") as scratch:
        args = SFTConfig(output_dir=scratch, **trainer_arguments(rt, iteration, model, STAGE))
        trainer = quiet_trainer(SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                           processing_class=tokenizer))
        result = trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    model_seconds = time.perf_counter() - began
    return {
        "steps": int(result.global_step), "trained_tokens": trained_tokens * cfg.epochs,
        "loss_first": losses[0] if losses else 0.0, "loss_last": losses[-1] if losses else 0.0,
        "model_s": model_seconds,
    }


# log_prints off: Prefect's print capture would break dill's own stdout capture inside `datasets` (its
# fingerprinting disassembles functions with dis.dis and reads the text back), spilling bytecode into the log
@task(name="sft", cache_policy=NO_CACHE, log_prints=False)
def sft_task(rt: Runtime, iteration: int) -> dict[str, Any]:
    return run_stage(rt, STAGE, iteration, sft)
