"""Stage 4, update: a GRPO-family step on the scored rollouts, registered as the new challenger.

The update starts from the policy version that sampled the rollouts (so a rerun trains from the same
weights), computes group-normalized advantages, drops groups whose rewards all agree, and takes
clipped-ratio steps against the stored sampling log-probs. The result is saved as a checkpoint,
logged to MLflow, registered as a model version with alias ``challenger``, and becomes the trainee.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from evertrain.config import CampaignConfig
from evertrain.data.store import now
from evertrain.models.grpo import LossNorm, group_advantages, policy_loss, zero_variance
from evertrain.models.policy import grouped_logprobs, load_policy, save_checkpoint
from evertrain.runtime import Runtime, get_runtime, seed_for
from evertrain.tasks.base import progress, run_stage


@dataclass
class Member:
    """One trainable completion: its tokens, their sampling log-probs, its advantage, which tokens are its own."""

    ids: list[int]
    logprobs: list[float]
    advantage: float
    loss_mask: list[int]  # 0 for tool output inside a multi-turn episode: context, not action


@dataclass
class Group:
    """One problem's prompt and its trainable completions."""

    prompt: list[int]
    members: list[Member]


def _batches(groups: list[Group], size: int) -> list[list[Group]]:
    """Whole groups packed in order into batches of about ``size`` completions (a group never splits)."""
    batches: list[list[Group]] = [[]]
    count = 0
    for group in groups:
        if batches[-1] and count + len(group.members) > size:
            batches.append([])
            count = 0
        batches[-1].append(group)
        count += len(group.members)
    return [b for b in batches if b]


def _trainable_snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def update(rt: Runtime, iteration: int) -> dict[str, Any]:
    config, cfg = rt.config, rt.config.update
    frame = rt.store.query(
        """SELECT problem_id, sample, policy_version, prompt_ids, completion_ids, logprobs, loss_mask, reward
           FROM rollouts WHERE campaign = ? AND iteration = ? ORDER BY problem_id, sample""",
        [rt.campaign, iteration],
    )
    if frame.empty:
        raise RuntimeError(f"iteration {iteration} has no rollouts: run the rollout stage first")
    if frame["reward"].isna().any():
        raise RuntimeError(f"iteration {iteration} has unscored rollouts: run the score stage first")
    start_version = int(frame["policy_version"].max())

    # advantages per group; groups whose rewards all agree carry no signal
    groups: list[Group] = []
    all_groups = list(frame.groupby("problem_id", sort=True))
    skipped = 0
    for _, rows in all_groups:
        rewards = torch.tensor(rows["reward"].to_numpy(), dtype=torch.float32)[None, :]
        if cfg.skip_zero_variance and bool(zero_variance(rewards)[0]):
            skipped += 1
            continue
        advantages = group_advantages(rewards, cfg.algorithm)[0].tolist()
        members = [Member(list(r.completion_ids), list(r.logprobs), a,
                          [int(x) for x in r.loss_mask] if r.loss_mask is not None else [1] * len(r.completion_ids))
                   for r, a in zip(rows.itertuples(index=False), advantages, strict=True) if len(r.completion_ids)]
        if members:
            groups.append(Group(list(rows["prompt_ids"].iloc[0]), members))

    model, tokenizer = load_policy(rt.checkpoint(start_version), trainable=True, lora=cfg.lora,
                                   finetune=cfg.finetune, device=config.model.device)
    reference = None
    if cfg.kl_coef > 0:
        reference, _ = load_policy(rt.checkpoint(rt.champion_version()), trainable=False, device=config.model.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    optimizer_file = rt.checkpoint(start_version) / "optimizer.pt"
    if optimizer_file.exists():
        # a different parameter layout (e.g. the trainee was reset) starts the moments afresh
        with contextlib.suppress(ValueError, RuntimeError, KeyError):
            optimizer.load_state_dict(torch.load(optimizer_file, weights_only=True))
    before = _trainable_snapshot(model)

    rng = random.Random(seed_for(config.seed, iteration, "update"))
    steps, stats_sum, losses, grad_norms = 0, {}, [], []
    model_seconds = 0.0
    temperature, pad = config.generation.temperature, tokenizer.pad_token_id
    longest = max(config.max_new_tokens(spec.name) for spec in config.environments)
    schedule = []
    for _epoch in range(cfg.epochs if groups else 0):
        order = groups[:]
        rng.shuffle(order)
        schedule += _batches(order, cfg.minibatch_size)
    with progress(len(schedule), f"update   i={iteration}", "step") as bar:
        for minibatch in schedule:
            members = [m for g in minibatch for m in g.members]
            norm = LossNorm(sequences=len(members), tokens=sum(sum(m.loss_mask) for m in members),
                            max_completion_length=longest)
            optimizer.zero_grad(set_to_none=True)
            began = time.perf_counter()
            total = 0.0
            for micro in _batches(minibatch, cfg.microbatch_size):
                prompts = [g.prompt for g in micro]
                completions = [[m.ids for m in g.members] for g in micro]
                part = [m for g in micro for m in g.members]
                new_logps, mask = grouped_logprobs(model, prompts, completions, temperature=temperature,
                                                   pad_id=pad)
                old = torch.zeros_like(new_logps)
                own = torch.zeros_like(mask)
                for i, m in enumerate(part):
                    old[i, :len(m.logprobs)] = torch.tensor(m.logprobs, device=old.device)
                    own[i, :len(m.loss_mask)] = torch.tensor(m.loss_mask, device=own.device, dtype=torch.bool)
                mask = mask & own
                ref_logps = None
                if reference is not None:
                    with torch.no_grad():
                        ref_logps, _ = grouped_logprobs(reference, prompts, completions,
                                                        temperature=temperature, pad_id=pad)
                advantages = torch.tensor([m.advantage for m in part], dtype=torch.float32, device=old.device)
                loss, stats = policy_loss(
                    new_logps, old, advantages, mask, norm, algorithm=cfg.algorithm,
                    clip_low=cfg.clip_low, clip_high=cfg.clip_high, ref_logps=ref_logps, kl_coef=cfg.kl_coef,
                )
                loss.backward()
                total += float(loss.detach())
                for key, value in stats.items():
                    stats_sum[key] = stats_sum.get(key, 0.0) + value * len(part)
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)))
            optimizer.step()
            model_seconds += time.perf_counter() - began
            losses.append(total)
            steps += 1
            bar.update(1)

    delta = math.sqrt(sum(float((p.detach() - before[n]).pow(2).sum())
                          for n, p in model.named_parameters() if p.requires_grad))
    path = save_checkpoint(model, rt.checkpoint_dir(iteration), rt.base_model, parent_version=start_version,
                           iteration=iteration)
    torch.save(optimizer.state_dict(), path / "optimizer.pt")

    # rerun-safe registration: drop what an earlier (or killed) run of this stage registered for this
    # iteration, unless the registry already serves it as champion
    protected = {rt.tracker.alias("champion"), rt.tracker.alias("previous_champion")}
    for old_version in rt.tracker.versions_of(iteration):
        if old_version not in protected:
            rt.tracker.delete_version(old_version)
    version = rt.tracker.register(path, rt.tracker.run_id(iteration), iteration)
    rt.tracker.set_alias("challenger", version)
    with rt.store.transaction() as con:
        con.execute("DELETE FROM model_versions WHERE campaign = ? AND iteration = ?", [rt.campaign, iteration])
    rt.store.replace("model_versions", {"campaign": rt.campaign, "version": version}, [{
        "campaign": rt.campaign, "version": version, "iteration": iteration,
        "kind": cfg.finetune, "path": str(path), "parent_version": start_version, "created_at": now(),
    }])
    rt.store.set_campaign_state(rt.campaign, trainee_version=version)
    trained_sequences = sum(len(g.members) for g in groups)
    trained = max(trained_sequences * cfg.epochs, 1)
    metrics: dict[str, Any] = {
        "challenger_version": version, "start_version": start_version, "steps": steps,
        "trained_sequences": trained_sequences, "groups": len(all_groups), "skipped_zero_variance_groups": skipped,
        "trained_tokens": sum(sum(m.loss_mask) for g in groups for m in g.members) * cfg.epochs,
        "loss": sum(losses) / len(losses) if losses else 0.0,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "weight_delta_norm": delta, "model_s": model_seconds,
    }
    metrics.update({key: value / trained for key, value in stats_sum.items() if key != "tokens"})
    return metrics


@task(name="update", cache_policy=NO_CACHE)
def update_task(config: CampaignConfig, iteration: int) -> dict[str, Any]:
    return run_stage(get_runtime(config), "update", iteration, update)
