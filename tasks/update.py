"""Stage 4, update: GRPO-family steps on the scored rollouts, registered as the new challenger.

1. Gather this iteration's scored rollouts (and, with ``update.replay``, earlier iterations' within the
   staleness bound). Every rollout's lag is the number of updates between the policy version that
   sampled it and the trainee being trained; rollouts beyond ``update.max_staleness`` are never used.
2. Group-normalized advantages; groups whose rewards all agree carry no signal and are skipped.
3. Clipped-ratio steps. On-policy rollouts take the ratio against their stored sampling log-probs.
   Stale ones use the decoupled objective: the ratio is taken against the log-probs of the trainee as
   it was before this update (the proximal policy, recomputed once), and each token is weighted by the
   truncated importance weight min(pi_prox / pi_behaviour, ``update.is_cap``) against the stored
   sampling log-probs. Without such a correction, asynchronous GRPO is known to collapse.
4. Save the checkpoint, log it to MLflow, register it with alias ``challenger``; it becomes the trainee.

The starting version is fixed on the first run of the stage (a rerun trains from the same weights).
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
    lag: int = 0  # updates between the policy that sampled it and the trainee
    proximal: list[float] | None = None  # the trainee's own log-probs before this update (stale rollouts)


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


def start_version_of(rt: Runtime, iteration: int) -> int:
    """The trainee this update starts from: the current one, or, on a rerun, the one the first run used."""
    earlier = rt.store.query("SELECT parent_version FROM model_versions WHERE campaign = ? AND iteration = ?",
                             [rt.campaign, iteration])
    if not earlier.empty and earlier["parent_version"].notna().all():
        return int(earlier["parent_version"].iloc[0])
    return rt.trainee_version()


def lags_from(rt: Runtime, start: int, depth: int) -> dict[int, int]:
    """Policy versions reachable from ``start`` through at most ``depth`` parent links, with their distance."""
    lags, version = {start: 0}, start
    for distance in range(1, depth + 1):
        parent = rt.store.scalar("SELECT parent_version FROM model_versions WHERE campaign = ? AND version = ?",
                                 [rt.campaign, version])
        if parent is None or parent != parent:  # None or NaN: the base model has no parent
            break
        version = int(parent)
        lags[version] = distance
    return lags


def gather_groups(rt: Runtime, iteration: int, start: int) -> tuple[list[Group], dict[str, Any]]:
    """Trainable groups with advantages, within the staleness bound, and what was left out and why."""
    cfg = rt.config.update
    first = iteration - cfg.max_staleness if cfg.replay else iteration
    frame = rt.store.query(
        """SELECT iteration, problem_id, sample, policy_version, prompt_ids, completion_ids, logprobs, loss_mask,
                  reward FROM rollouts WHERE campaign = ? AND iteration BETWEEN ? AND ?
           ORDER BY iteration, problem_id, sample""",
        [rt.campaign, max(first, 0), iteration],
    )
    current = frame[frame["iteration"] == iteration]
    if current.empty:
        raise RuntimeError(f"iteration {iteration} has no rollouts: run the rollout stage first")
    if current["reward"].isna().any():
        raise RuntimeError(f"iteration {iteration} has unscored rollouts: run the score stage first")
    lags = lags_from(rt, start, cfg.max_staleness)
    info: dict[str, Any] = {"groups": 0, "skipped_zero_variance_groups": 0, "dropped_stale_groups": 0,
                            "replayed_groups": 0, "max_lag": 0}
    groups: list[Group] = []
    for (source, _), rows in frame.groupby(["iteration", "problem_id"], sort=True):
        if rows["reward"].isna().any():
            continue
        info["groups"] += int(source == iteration)
        lag = max(lags.get(int(v), math.inf) for v in rows["policy_version"])
        if lag > cfg.max_staleness:
            info["dropped_stale_groups"] += 1
            continue
        rewards = torch.tensor(rows["reward"].to_numpy(), dtype=torch.float32)[None, :]
        if cfg.skip_zero_variance and bool(zero_variance(rewards)[0]):
            info["skipped_zero_variance_groups"] += int(source == iteration)
            continue
        advantages = group_advantages(rewards, cfg.algorithm)[0].tolist()
        members = [Member(list(r.completion_ids), list(r.logprobs), a,
                          [int(x) for x in r.loss_mask] if r.loss_mask is not None else [1] * len(r.completion_ids),
                          lag=int(lag))
                   for r, a in zip(rows.itertuples(index=False), advantages, strict=True) if len(r.completion_ids)]
        if members:
            groups.append(Group(list(rows["prompt_ids"].iloc[0]), members))
            info["replayed_groups"] += int(source != iteration)
            info["max_lag"] = max(info["max_lag"], int(lag))
    return groups, info


@torch.no_grad()
def _fill_proximal(model: Any, groups: list[Group], batch: int, temperature: float, pad: int) -> None:
    """Log-probs of the stale members under the trainee before any step: the decoupled objective's anchor."""
    stale = [g for g in groups if any(m.lag > 0 for m in g.members)]
    was_training = model.training
    model.eval()
    for part in _batches(stale, batch):
        logps, _ = grouped_logprobs(model, [g.prompt for g in part], [[m.ids for m in g.members] for g in part],
                                    temperature=temperature, pad_id=pad)
        row = 0
        for g in part:
            for m in g.members:
                m.proximal = logps[row, :len(m.ids)].float().cpu().tolist()
                row += 1
    model.train(was_training)


def _padded(rows: list[list[float]], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    out = torch.zeros(like.shape, dtype=dtype or like.dtype, device=like.device)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=out.dtype, device=out.device)
    return out


def update(rt: Runtime, iteration: int) -> dict[str, Any]:
    config, cfg = rt.config, rt.config.update
    start_version = start_version_of(rt, iteration)
    groups, info = gather_groups(rt, iteration, start_version)

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
    temperature, pad = config.generation.temperature, tokenizer.pad_token_id
    began = time.perf_counter()
    _fill_proximal(model, groups, cfg.microbatch_size, temperature, pad)
    model_seconds = time.perf_counter() - began

    rng = random.Random(seed_for(config.seed, iteration, "update"))
    steps, stats_sum, losses, grad_norms, is_weights = 0, {}, [], [], []
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
                behaviour = _padded([m.logprobs for m in part], new_logps)
                mask = mask & _padded([m.loss_mask for m in part], mask, torch.bool)
                # the ratio's anchor: the stored sampling log-probs on-policy, the proximal policy when stale
                anchor = _padded([m.proximal if m.proximal is not None else m.logprobs for m in part], new_logps)
                weights = None
                if any(m.proximal is not None for m in part):
                    weights = torch.exp(anchor - behaviour).clamp(max=cfg.is_cap) * mask
                    is_weights.append(float(weights.sum() / mask.sum().clamp(min=1)))
                ref_logps = None
                if reference is not None:
                    with torch.no_grad():
                        ref_logps, _ = grouped_logprobs(reference, prompts, completions,
                                                        temperature=temperature, pad_id=pad)
                advantages = torch.tensor([m.advantage for m in part], dtype=torch.float32, device=mask.device)
                loss, stats = policy_loss(
                    new_logps, anchor, advantages, mask, norm, algorithm=cfg.algorithm, clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high, ref_logps=ref_logps, kl_coef=cfg.kl_coef, is_weights=weights,
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
        **info, "challenger_version": version, "start_version": start_version, "steps": steps,
        "trained_sequences": trained_sequences,
        "trained_tokens": sum(sum(m.loss_mask) for g in groups for m in g.members) * cfg.epochs,
        "loss": sum(losses) / len(losses) if losses else 0.0,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "is_weight_mean": sum(is_weights) / len(is_weights) if is_weights else 1.0,
        "weight_delta_norm": delta, "model_s": model_seconds,
    }
    metrics.update({key: value / trained for key, value in stats_sum.items() if key != "tokens"})
    return metrics


@task(name="update", cache_policy=NO_CACHE)
def update_task(config: CampaignConfig, iteration: int) -> dict[str, Any]:
    return run_stage(get_runtime(config), "update", iteration, update)
