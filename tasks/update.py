"""Stage 4, update: GRPO-family steps on the scored rollouts, registered as the new challenger.

1. Gather this iteration's scored rollouts (and, with ``update.replay``, earlier iterations' within the
   staleness bound). Every rollout's lag is the number of updates between the policy version that
   sampled it and the trainee being trained; rollouts beyond ``update.max_staleness`` are never used.
2. Group-normalized advantages; groups whose rewards all agree carry no signal and are skipped.
3. Clipped-ratio steps with the decoupled objective, for every group: the ratio is taken against the
   log-probs of the trainee as it was before this update (the proximal policy, recomputed once), and
   each token is weighted by the truncated importance weight min(pi_prox / pi_behaviour, ``update.is_cap``)
   against the stored sampling (behaviour) log-probs. Stale rollouts need it (without such a correction,
   asynchronous GRPO is known to collapse); fresh ones need it too, because the sampler is not the
   trainer: a vLLM engine, or bfloat16 sampling, gives other log-probs than the float32 update. The
   sampler/trainer mismatch is logged per iteration (``mismatch_kl``, ``is_clipped_share``).
4. Save the checkpoint, log it to MLflow, register it with alias ``challenger``; it becomes the trainee.

The starting version is fixed on the first run of the stage (a rerun trains from the same weights).
"""

from __future__ import annotations

import logging
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
from evertrain.models.policy import (
    autocast,
    enable_gradient_checkpointing,
    grouped_logprobs,
    load_policy,
    save_checkpoint,
    update_precision,
)
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
    temperature: float = 1.0  # what it was sampled with: its log-probs are recomputed under the same


@dataclass
class Group:
    """One problem's prompt and its trainable completions."""

    prompt: list[int]
    members: list[Member]
    env: str = ""


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
        """SELECT iteration, problem_id, sample, env, policy_version, prompt_ids, completion_ids, logprobs,
                  loss_mask, finish_reason, reward, temperature
           FROM rollouts WHERE campaign = ? AND iteration BETWEEN ? AND ?
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
                            "replayed_groups": 0, "max_lag": 0, "overlong_completions": 0}
    overlong = cfg.overlong_rule
    groups: list[Group] = []
    for (source, _), rows in frame.groupby(["iteration", "problem_id"], sort=True):
        if rows["reward"].isna().any():
            continue
        info["groups"] += int(source == iteration)
        lag = max(lags.get(int(v), math.inf) for v in rows["policy_version"])
        if lag > cfg.max_staleness:
            info["dropped_stale_groups"] += 1
            continue
        cut = (rows["finish_reason"] == "length").to_numpy()
        info["overlong_completions"] += int(cut.sum()) * int(source == iteration)
        rewards = torch.tensor(rows["reward"].to_numpy(), dtype=torch.float32)[None, :]
        if overlong == "penalty" and cut.any():
            # DAPO's overlong penalty, in its simplest form: a cut completion earns less than any finished one
            rewards[0, torch.tensor(cut)] = -1.0
        if cfg.skip_zero_variance and bool(zero_variance(rewards)[0]):
            info["skipped_zero_variance_groups"] += int(source == iteration)
            continue
        advantages = group_advantages(rewards, cfg.algorithm)[0].tolist()
        members = [Member(list(r.completion_ids), list(r.logprobs), a,
                          [int(x) for x in r.loss_mask] if r.loss_mask is not None else [1] * len(r.completion_ids),
                          lag=int(lag), temperature=_stored_temperature(r, rt.config.generation.temperature))
                   for r, a in zip(rows.itertuples(index=False), advantages, strict=True) if len(r.completion_ids)
                   # DAPO's overlong filtering: a cut completion's advantage is still counted in its group,
                   # but its tokens are not trained on (its reward says nothing about the answer it never gave)
                   and not (overlong == "mask" and r.finish_reason == "length")]
        if members:
            groups.append(Group(list(rows["prompt_ids"].iloc[0]), members, str(rows["env"].iloc[0])))
            info["replayed_groups"] += int(source != iteration)
            info["max_lag"] = max(info["max_lag"], int(lag))
    return groups, info


def _stored_temperature(row: Any, default: float) -> float:
    """The temperature a rollout was sampled with (rows written before it was stored: the config's)."""
    value = getattr(row, "temperature", None)
    return default if value is None or value != value else float(value)


def _temperatures(part: list[Member]) -> torch.Tensor:
    return torch.tensor([m.temperature for m in part], dtype=torch.float32)


@torch.no_grad()
def _fill_proximal(model: Any, groups: list[Group], batch: int, temperature: float, pad: int,
                   **options: Any) -> None:
    """Log-probs of every member under the trainee before any step: the decoupled objective's anchor."""
    was_training = model.training
    model.eval()
    for part in _batches(groups, batch):
        logps, _ = grouped_logprobs(model, [g.prompt for g in part], [[m.ids for m in g.members] for g in part],
                                    temperature=_temperatures([m for g in part for m in g.members]), pad_id=pad,
                                    **options)
        row = 0
        for g in part:
            for m in g.members:
                m.proximal = logps[row, :len(m.ids)].float().cpu().tolist()
                row += 1
    model.train(was_training)


def mismatch_stats(groups: list[Group], cap: float) -> dict[str, float]:
    """How far the sampler's (behaviour) log-probs are from the trainer's before the update, on policy tokens.

    ``mismatch_kl``: the k3 estimate of KL(behaviour || trainer) per token (nonnegative; 0 when they agree);
    ``is_clipped_share``: the share of tokens whose importance weight pi_prox / pi_behaviour exceeded
    ``cap`` and was truncated; ``is_weight_max``: the largest weight before truncation.
    """
    log_ratios = [p - b for g in groups for m in g.members if m.proximal is not None
                  for p, b, keep in zip(m.proximal, m.logprobs, m.loss_mask, strict=False) if keep]
    if not log_ratios:
        return {"mismatch_kl": 0.0, "is_clipped_share": 0.0, "is_weight_max": 1.0}
    r = torch.tensor(log_ratios, dtype=torch.float64)
    return {"mismatch_kl": float((torch.exp(r) - 1 - r).mean()),
            "is_clipped_share": float((torch.exp(r) > cap).double().mean()),
            "is_weight_max": float(torch.exp(r).max()), "mismatch_tokens": float(len(log_ratios))}


def _padded(rows: list[list[float]], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    out = torch.zeros(like.shape, dtype=dtype or like.dtype, device=like.device)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor(row, dtype=out.dtype, device=out.device)
    return out


def normaliser_length(rt: Runtime, groups: list[Group]) -> int:
    """Dr.GRPO's constant completion length: the longest completion the environments actually trained on
    can produce (token limit times turn limit), not the longest limit of any environment in the campaign:
    a weight-0 environment with 160 tokens would otherwise cut a 24-token one's effective step by 6.7x."""
    envs = {g.env for g in groups if g.env}
    if not envs:
        return 1
    return max(rt.config.max_new_tokens(env) * max(1, rt.env(env).max_turns) for env in envs)


def _drop_registration(rt: Runtime, iteration: int, start_version: int) -> None:
    """Undo what an earlier run of this iteration's update registered (a rerun that now trains nothing)."""
    protected = {rt.tracker.alias("champion"), rt.tracker.alias("previous_champion")}
    dropped = [v for v in rt.tracker.versions_of(iteration) if v not in protected]
    for old_version in dropped:
        rt.tracker.delete_version(old_version)
    with rt.store.transaction() as con:
        con.execute("DELETE FROM model_versions WHERE campaign = ? AND iteration = ?", [rt.campaign, iteration])
    if rt.trainee_version() in dropped:
        rt.store.set_campaign_state(rt.campaign, trainee_version=start_version)


def restore_optimizer(rt: Runtime, optimizer: torch.optim.Optimizer, start_version: int, iteration: int) -> str:
    """Load the AdamW moments saved with ``start_version``; say so (log and MLflow tag) when that fails.

    Returns "restored", "fresh: <why>" or "fresh: base model" (a base version has none to restore).
    """
    kind = rt.store.model_version(rt.campaign, start_version)["kind"]
    optimizer_file = rt.checkpoint(start_version) / "optimizer.pt"
    if kind == "base":
        outcome = "fresh: base model"
    elif not optimizer_file.exists():
        outcome = f"fresh: v{start_version} has no optimizer.pt"
    else:
        try:
            optimizer.load_state_dict(torch.load(optimizer_file, weights_only=True))
            outcome = "restored"
        except (ValueError, RuntimeError, KeyError) as error:  # e.g. a different parameter layout
            outcome = f"fresh: v{start_version}'s optimizer state does not fit ({str(error)[:200]})"
    if outcome.startswith("fresh") and kind != "base":
        logging.getLogger("evertrain").warning("update i=%d: optimizer state not restored, AdamW starts "
                                               "afresh: %s", iteration, outcome)
    rt.tracker.set_tags(rt.tracker.run_id(iteration), {"update.optimizer_state": outcome})
    return outcome


def update(rt: Runtime, iteration: int) -> dict[str, Any]:
    config, cfg = rt.config, rt.config.update
    start_version = start_version_of(rt, iteration)
    groups, info = gather_groups(rt, iteration, start_version)
    from evertrain.tasks.sft import checkpoint_for

    if not groups and checkpoint_for(rt, iteration) is None:
        # nothing to learn from (and no SFT result to register): the weights would equal the trainee's, so
        # no challenger is registered and evaluate and promote record themselves as skipped instead of
        # judging a copy of the champion
        _drop_registration(rt, iteration, start_version)
        return {**info, "start_version": start_version, "steps": 0, "trained_sequences": 0, "trained_tokens": 0,
                "skipped": "no informative group: every group's rewards agreed (or were too stale)"}

    # a fresh adapter's initialisation, dropout and (below) the minibatch order all come from the campaign
    # seed and the iteration, so a rerun of this stage trains from the same weights
    torch.manual_seed(seed_for(config.seed, iteration, "update", "init"))
    # the optional sft stage's result, when it ran for this iteration: the challenger is then SFT, then RL
    source = checkpoint_for(rt, iteration) or rt.checkpoint(start_version)
    model, tokenizer = load_policy(source, trainable=True, lora=cfg.lora,
                                   finetune=cfg.finetune, device=config.model.device)
    autocast_dtype = update_precision(cfg.precision, next(model.parameters()).device)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    # chunked log-probs; gradient checkpointing recomputes layers, which must not write to a shared KV cache twice
    logprob_options = {"chunk": cfg.logprob_chunk, "shared_prefix": not cfg.gradient_checkpointing}
    reference = None
    if cfg.kl_coef > 0:
        anchor_version = rt.champion_version() if cfg.kl_reference == "champion" else int(rt.store.scalar(
            "SELECT min(version) FROM model_versions WHERE campaign = ? AND kind = 'base'", [rt.campaign]))
        reference, _ = load_policy(rt.checkpoint(anchor_version), trainable=False, device=config.model.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    optimizer_state = restore_optimizer(rt, optimizer, start_version, iteration)
    before = _trainable_snapshot(model)
    temperature, pad = config.generation.temperature, tokenizer.pad_token_id
    began = time.perf_counter()
    with autocast(autocast_dtype, model):
        _fill_proximal(model, groups, cfg.microbatch_size, temperature, pad, **logprob_options)
    model_seconds = time.perf_counter() - began
    mismatch = mismatch_stats(groups, cfg.is_cap)

    rng = random.Random(seed_for(config.seed, iteration, "update"))
    steps, stats_sum, losses, grad_norms, is_weights = 0, {}, [], [], []
    longest = normaliser_length(rt, groups)
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
                with autocast(autocast_dtype, model):
                    new_logps, mask = grouped_logprobs(model, prompts, completions, temperature=_temperatures(part),
                                                       pad_id=pad, **logprob_options)
                behaviour = _padded([m.logprobs for m in part], new_logps)
                mask = mask & _padded([m.loss_mask for m in part], mask, torch.bool)
                # the ratio's anchor is the proximal policy (the trainee before this update); every token is
                # weighted by the truncated importance weight against the sampler's behaviour log-probs
                anchor = _padded([m.proximal if m.proximal is not None else m.logprobs for m in part], new_logps)
                weights = torch.exp(anchor - behaviour).clamp(max=cfg.is_cap) * mask
                is_weights.append(float(weights.sum() / mask.sum().clamp(min=1)))
                ref_logps = None
                if reference is not None:
                    with torch.no_grad():
                        ref_logps, _ = grouped_logprobs(reference, prompts, completions,
                                                        temperature=_temperatures(part), pad_id=pad)
                advantages = torch.tensor([m.advantage for m in part], dtype=torch.float32, device=mask.device)
                loss, stats = policy_loss(
                    new_logps, anchor, advantages, mask, norm, algorithm=cfg.algorithm, clip_low=cfg.clip_low,
                    clip_high=cfg.clip_upper, ref_logps=ref_logps, kl_coef=cfg.kl_coef, is_weights=weights,
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
        "kind": cfg.finetune, "path": rt.stored_path(path), "parent_version": start_version, "created_at": now(),
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
        "weight_delta_norm": delta, "model_s": model_seconds, "normaliser_length": longest,
        "clip_high": cfg.clip_upper, "optimizer_restored": float(optimizer_state == "restored"),
    }
    metrics.update({key: value / trained for key, value in stats_sum.items() if key != "tokens"})
    metrics.update(mismatch)
    return metrics


@task(name="update", cache_policy=NO_CACHE)
def update_task(config: CampaignConfig, iteration: int) -> dict[str, Any]:
    return run_stage(get_runtime(config), "update", iteration, update)
