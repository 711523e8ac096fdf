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
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from evertrain.config import CampaignConfig
from evertrain.runtime import Runtime, get_runtime, seed_for
from evertrain.tasks.base import run_stage

STAGE = "sft"


def checkpoint_dir(rt: Runtime, iteration: int) -> Path:
    return rt.checkpoints_root() / rt.campaign / f"sft-{iteration}"


def checkpoint_for(rt: Runtime, iteration: int) -> Path | None:
    """The SFT checkpoint the update of ``iteration`` starts from, or None (stage off, skipped, not finished)."""
    if not rt.config.sft.enabled:
        return None
    if rt.store.stage_status(rt.campaign, iteration).get(STAGE) != "completed":
        return None
    path = checkpoint_dir(rt, iteration)
    return path if path.is_dir() else None


def select(rt: Runtime, iteration: int) -> Any:
    """The selected rollouts (token ids and loss masks), one per group first, at most ``max_examples``."""
    cfg = rt.config.sft
    params = {name: value for name, value in (("campaign", rt.campaign), ("iteration", iteration))
              if re.search(rf"\${name}\b", cfg.select)}
    sql = f"""
        WITH chosen AS ({cfg.select}),
        picked AS (
            SELECT r.iteration, r.problem_id, r.sample, r.env, r.prompt_ids, r.completion_ids, r.loss_mask,
                   row_number() OVER (PARTITION BY r.iteration, r.problem_id ORDER BY r.sample) AS rank_in_group
            FROM rollouts r JOIN chosen c
              ON r.iteration = c.iteration AND r.problem_id = c.problem_id AND r.sample = c.sample
            WHERE r.campaign = $campaign)
        SELECT * FROM picked ORDER BY rank_in_group, iteration, problem_id, sample LIMIT {int(cfg.max_examples)}"""
    params["campaign"] = rt.campaign
    try:
        return rt.store.query(sql, params)  # type: ignore[arg-type]  # DuckDB binds named parameters too
    except Exception as error:
        raise ValueError(f"sft.select failed: {error}") from error


def sft(rt: Runtime, iteration: int) -> dict[str, Any]:
    from evertrain.tasks.update import start_version_of

    config, cfg = rt.config, rt.config.sft
    start_version = start_version_of(rt, iteration)
    frame = select(rt, iteration)
    path = checkpoint_dir(rt, iteration)
    examples = [{"campaign": rt.campaign, "iteration": iteration, "source_iteration": int(row.iteration),
                 "problem_id": row.problem_id, "sample": int(row.sample), "env": row.env}
                for row in frame.itertuples(index=False)]
    rt.store.replace("sft_examples", {"campaign": rt.campaign, "iteration": iteration}, examples)
    if frame.empty:
        if path.exists():
            shutil.rmtree(path)
        return {"selected": 0, "start_version": start_version, "steps": 0,
                "skipped": "sft.select chose no rollouts: the update starts from the trainee"}

    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from evertrain.models.policy import load_policy, save_checkpoint

    rows = []
    trained_tokens = 0
    for row in frame.itertuples(index=False):
        prompt, completion, mask = list(row.prompt_ids), list(row.completion_ids), list(row.loss_mask)
        # the loss covers the policy's own tokens only: never the prompt, never a tool's output
        labels = [-100] * len(prompt) + [t if m else -100 for t, m in zip(completion, mask, strict=True)]
        trained_tokens += sum(1 for m in mask if m)
        rows.append({"input_ids": prompt + completion, "labels": labels})
    torch.manual_seed(seed_for(config.seed, iteration, STAGE, "init"))
    model, tokenizer = load_policy(rt.checkpoint(start_version), trainable=True, lora=config.update.lora,
                                   finetune=config.update.finetune, device=config.model.device)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="evertrain-sft-") as scratch:
        args = SFTConfig(
            output_dir=scratch, per_device_train_batch_size=cfg.batch_size, num_train_epochs=cfg.epochs,
            learning_rate=cfg.learning_rate, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
            report_to=[], seed=seed_for(config.seed, iteration, STAGE, "order"), max_length=None,
            disable_tqdm=True, use_cpu=str(next(model.parameters()).device) == "cpu",
            dataloader_num_workers=0,
        )
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer)
        result = trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    model_seconds = time.perf_counter() - began
    model.eval()
    save_checkpoint(model, path, rt.base_model, parent_version=start_version, iteration=iteration, stage=STAGE)
    return {
        "selected": len(rows), "groups": int(frame[["iteration", "problem_id"]].drop_duplicates().shape[0]),
        "start_version": start_version, "steps": int(result.global_step), "trained_tokens": trained_tokens * cfg.epochs,
        "loss_first": losses[0] if losses else 0.0, "loss_last": losses[-1] if losses else 0.0,
        "model_s": model_seconds,
    }


@task(name="sft", cache_policy=NO_CACHE)
def sft_task(config: CampaignConfig, iteration: int) -> dict[str, Any]:
    return run_stage(get_runtime(config), STAGE, iteration, sft)
