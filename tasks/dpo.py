"""The ``dpo`` method of the optional sft stage (``sft.method = "dpo"``): preferences from one group.

Pairs are formed inside one group (same iteration and problem_id) of the rollouts ``sft.select`` chose: a
passed rollout is *chosen* over a failed one (*rejected*). Within a group the k-th pass (by sample) is
paired with the k-th fail, so a rollout is in one pair at most, and pairs are taken one per group first
(every group's first pair, then every group's second, ...), at most ``sft.max_examples`` of them. A
group with only passes, or only fails, gives none. With ``sft.select`` left at its default (which picks
passed rollouts only) the dpo stage selects with :data:`DEFAULT_DPO_SELECT` instead.

Training is TRL's ``DPOTrainer`` (sigmoid loss, ``beta = sft.dpo_beta``) on the store's own token ids,
not re-tokenized text: both completions follow the group's prompt, and the log-prob of a completion
covers the policy's tokens only (its ``loss_mask``), so a multi-turn tool episode is handled, its tool
output being context and never scored. The reference is the trainee the stage starts from: TRL copies a
LoRA trainee's adapter into a frozen ``ref`` adapter (a fresh adapter is the base model itself), and a
fully fine-tuned trainee gets a frozen copy of itself. Precision and gradient checkpointing follow
``update.precision`` and ``update.gradient_checkpointing``.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from datasets import Dataset
from peft import PeftModel
from trl import DPOConfig, DPOTrainer

from evertrain.config import SftConfig
from evertrain.data.queries import DEFAULT_DPO_SELECT, DEFAULT_SFT_SELECT
from evertrain.runtime import Runtime
from evertrain.tasks.warm_start import quiet_trainer, run_select, trainer_arguments


def selection_sql(cfg: SftConfig) -> str:
    """The SQL choosing the stage's rollouts: ``sft.select``, or :data:`DEFAULT_DPO_SELECT` for dpo with
    ``sft.select`` left at its default (passed rollouts only, from which no pair could be formed)."""
    if cfg.method == "dpo" and cfg.select == DEFAULT_SFT_SELECT:
        return DEFAULT_DPO_SELECT
    return cfg.select


def select_pairs(rt: Runtime, iteration: int) -> Any:
    """The pairs, two rows each (``pair``, ``role`` = 'chosen' then 'rejected', token ids, loss mask, chat)."""
    cfg = rt.config.sft
    return run_select(lambda: rt.store.dpo_pairs(rt.campaign, iteration, selection_sql(cfg), cfg.max_examples))


@dataclass
class PairCollator:
    """Pads a batch of pairs into [chosen..., rejected...] rows, as ``DPOTrainer`` expects. Its
    ``completion_mask`` is the rollout's ``loss_mask``: only the policy's own tokens are scored."""

    pad_id: int

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        rows = [(e["prompt_ids"] + e[f"{side}_ids"], [0] * len(e["prompt_ids"]) + e[f"{side}_mask"])
                for side in ("chosen", "rejected") for e in examples]
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        completion = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, mask) in enumerate(rows):
            input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention[i, :len(ids)] = 1
            completion[i, :len(ids)] = torch.tensor(mask, dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion}


def pair_rows(frame: Any, prompt_of: Callable[[Any], list[int]]) -> list[dict[str, list[int]]]:
    """One training row per pair (``frame`` as :func:`select_pairs` returns it); ``prompt_of(row)`` gives
    the prompt's token ids (as sampled, or rewritten by ``sft.prompt``)."""
    rows = []
    for _, pair in frame.groupby("pair", sort=True):
        chosen, rejected = (next(pair[pair.role == role].itertuples(index=False)) for role in ("chosen", "rejected"))
        if list(chosen.prompt_ids) != list(rejected.prompt_ids):
            raise ValueError(f"sft.method = 'dpo': samples {chosen.sample} and {rejected.sample} of problem "
                             f"{chosen.problem_id} (iteration {chosen.iteration}) were sampled from different prompts")
        rows.append({"prompt_ids": prompt_of(chosen),
                     "chosen_ids": [int(t) for t in chosen.completion_ids],
                     "chosen_mask": [int(bool(m)) for m in chosen.loss_mask],
                     "rejected_ids": [int(t) for t in rejected.completion_ids],
                     "rejected_mask": [int(bool(m)) for m in rejected.loss_mask]})
    return rows


def train_dpo(rt: Runtime, iteration: int, model: Any, tokenizer: Any, rows: list[dict[str, list[int]]],
              stage: str) -> dict[str, Any]:
    """Train ``model`` in place on the pairs ``rows`` with TRL's DPOTrainer; returns the stage's metrics."""
    class TokenizedDPOTrainer(DPOTrainer):
        """DPOTrainer on pairs already tokenized (the store's token ids): nothing is re-tokenized from text."""

        def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
            return dataset

    cfg = rt.config.sft
    peft = isinstance(model, PeftModel)
    # with LoRA, TRL copies the trainee's adapter into a frozen 'ref' adapter; a full model gets a frozen copy
    reference = None if peft else copy.deepcopy(model).eval().requires_grad_(False)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="evertrain-dpo-") as scratch:
        args = DPOConfig(
            output_dir=scratch, beta=cfg.dpo_beta, **trainer_arguments(rt, iteration, model, stage),
            remove_unused_columns=False,  # the collator needs the loss masks, which DPOTrainer does not know
        )
        trainer = quiet_trainer(TokenizedDPOTrainer(model=model, ref_model=reference, args=args,
                                                    train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                                                    data_collator=PairCollator(tokenizer.pad_token_id)))
        result = trainer.train()
        log = [entry for entry in trainer.state.log_history if "loss" in entry]
    model_seconds = time.perf_counter() - began
    if peft and "ref" in model.peft_config:
        model.delete_adapter("ref")  # the checkpoint holds the trained adapter only

    def first_last(key: str) -> tuple[float, float]:
        values = [float(entry[key]) for entry in log if key in entry]
        return (values[0], values[-1]) if values else (0.0, 0.0)

    loss_first, loss_last = first_last("loss")
    margin_first, margin_last = first_last("rewards/margins")
    tokens = sum(sum(row["chosen_mask"]) + sum(row["rejected_mask"]) for row in rows)
    return {
        "pairs": len(rows), "steps": int(result.global_step), "trained_tokens": tokens * cfg.epochs,
        "loss_first": loss_first, "loss_last": loss_last,
        "reward_margin_first": margin_first, "reward_margin_last": margin_last,
        "reward_accuracy_last": first_last("rewards/accuracies")[1],
        "logp_chosen_last": first_last("logps/chosen")[1], "logp_rejected_last": first_last("logps/rejected")[1],
        "model_s": model_seconds,
    }
