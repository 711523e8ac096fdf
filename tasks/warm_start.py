"""What the warm-start stages (sft and its dpo method) and the update share: where the sft checkpoint lives,
which trainee a stage starts from, the selection SQL runner and the TRL arguments.

One module below all three, so that none of them imports another (the layering test forbids cycles).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_callback import PrinterCallback

from evertrain.models.precision import update_precision
from evertrain.runtime import Runtime, seed_for

SFT_STAGE = "sft"


def start_version_of(rt: Runtime, iteration: int) -> int:
    """The trainee this update starts from: the current one, or, on a rerun, the one the first run used."""
    earlier = rt.store.iteration_versions(rt.campaign, iteration)
    if not earlier.empty and earlier["parent_version"].notna().all():
        return int(earlier["parent_version"].iloc[0])
    return rt.trainee_version()


def checkpoint_dir(rt: Runtime, iteration: int) -> Path:
    return rt.checkpoints_root() / rt.campaign / f"sft-{iteration}"


def checkpoint_for(rt: Runtime, iteration: int) -> Path | None:
    """The SFT checkpoint the update of ``iteration`` starts from, or None (stage off, skipped, not finished)."""
    if not rt.config.sft.runs_in(iteration):
        return None
    if rt.store.stage_status(rt.campaign, iteration).get(SFT_STAGE) != "completed":
        return None
    path = checkpoint_dir(rt, iteration)
    return path if path.is_dir() else None


def run_select(read: Callable[[], Any]) -> Any:
    """Run ``read``, a store query around the ``sft.select`` SQL; a failure names that setting."""
    try:
        return read()
    except Exception as error:
        raise ValueError(f"sft.select failed: {error}") from error


def quiet_trainer(trainer: Any) -> Any:
    """``trainer`` without the callback that prints every log entry as a raw dictionary (what a TRL trainer does
    with its progress bar off); its ``state.log_history`` still holds them. ``EVERTRAIN_VERBOSE=1``
    (`evertrain run --verbose`) keeps them."""
    if os.environ.get("EVERTRAIN_VERBOSE") != "1":
        trainer.remove_callback(PrinterCallback)
    return trainer


def trainer_arguments(rt: Runtime, iteration: int, model: Any, stage: str) -> dict[str, Any]:
    """The TRL training arguments the sft and dpo methods share: seeded, constant learning rate, no saving,
    and the update's precision and gradient checkpointing (not TRL's defaults, which turn both on)."""
    config, cfg = rt.config, rt.config.sft
    device = next(model.parameters()).device
    return {
        "per_device_train_batch_size": cfg.batch_size, "num_train_epochs": cfg.epochs,
        "learning_rate": cfg.learning_rate, "lr_scheduler_type": "constant", "logging_steps": 1,
        "save_strategy": "no", "report_to": [], "seed": seed_for(config.seed, iteration, stage, "order"),
        "max_length": None, "disable_tqdm": True, "use_cpu": device.type == "cpu", "dataloader_num_workers": 0,
        "bf16": update_precision(config.update.precision, device) is torch.bfloat16,
        "gradient_checkpointing": config.update.gradient_checkpointing,
    }
