"""Stage 4, update: GRPO-family steps on the scored rollouts, registered as the new challenger.

1. Gather this iteration's scored rollouts (and, with ``update.replay``, earlier iterations' within the
   staleness bound). Every rollout's lag is the number of updates between the policy version that
   sampled it and the trainee being trained; rollouts beyond ``update.max_staleness`` are never used.
2. Group-normalized advantages; groups whose rewards all agree carry no signal and are skipped. The groups
   DAPO's dynamic sampling drew in the score stage (``rollouts.refill_round >= 1``) are this iteration's too.
3. Clipped-ratio steps with the decoupled objective, for every group: the ratio is taken against the
   log-probs of the trainee as it was before this update (the proximal policy, recomputed once), and
   each token is weighted by the truncated importance weight min(pi_prox / pi_behaviour, ``update.is_cap``)
   against the stored sampling (behaviour) log-probs. Stale rollouts need it (without such a correction,
   asynchronous GRPO is known to collapse); fresh ones need it too, because the sampler is not the
   trainer: a vLLM engine, or bfloat16 sampling, gives other log-probs than the float32 update. The
   sampler/trainer mismatch is logged per iteration (``mismatch_kl``, ``is_clipped_share``).
4. Save the checkpoint, log it to MLflow, register it with alias ``challenger``; it becomes the trainee.

The starting version is fixed on the first run of the stage (a rerun trains from the same weights).

With ``update.processes = N > 1`` step 3 runs in N data-parallel processes (``accelerate launch``, see
:mod:`evertrain.models.data_parallel`; gloo on the CPU, NCCL on GPUs, one GPU each): the stage gathers the
groups, computes the proximal log-probs, advantages and minibatch order as with one process, writes them
to a spec, launches the processes, then loads the checkpoint they wrote and registers it as it would its
own. Each process takes whole groups of every minibatch and the gradients are summed, so the steps are
those of one process (up to float rounding: the sums are taken in another order). Everything the update
does is done the same there: the decoupled objective and its importance weights, per-completion
temperatures, DAPO's overlong filtering and penalty (they act on the gathered groups), Dr.GRPO's constant
length, the KL penalty, weight decay, restored AdamW moments, ``precision``, ``logprob_chunk``,
``gradient_checkpointing``, full fine-tuning and SFT results as the starting point. Refused, naming the
settings, because N processes could not take the steps one takes:

- ``update.lora.dropout > 0`` (config validation), and a model with any other dropout (stage start):
  each process would draw its own dropout masks;
- ``model.device`` naming one device (``cuda:1``) or a device other than the CPU or CUDA (stage start):
  the processes take one GPU each, cuda:0 to cuda:N-1 (select them with CUDA_VISIBLE_DEVICES);
- more processes than visible GPUs when the update runs on GPUs (stage start).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from evertrain.config import CampaignConfig, UpdateConfig
from evertrain.data.store import now
from evertrain.models.grpo import LossNorm, group_advantages, pack_microbatches, policy_loss, zero_variance
from evertrain.models.policy import (
    autocast,
    enable_gradient_checkpointing,
    grouped_logprobs,
    load_policy,
    resolve_device,
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


def _passes(groups: list[Group], cfg: UpdateConfig) -> list[list[Group]]:
    """Forward/backward passes: ``microbatch_size`` completions and ``microbatch_tokens`` padded tokens at most."""
    return pack_microbatches(groups, cfg.microbatch_size, cfg.microbatch_tokens, lambda g: g.members,
                             lambda m: len(m.ids), lambda g, part: replace(g, members=part))


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
        rewards = trained_rewards(rows["reward"].to_numpy(), cut, overlong)
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


def trained_rewards(rewards: Any, cut: Any, overlong: str) -> torch.Tensor:
    """One group's rewards as the update trains on them, a [1, G] tensor: with ``overlong = "penalty"`` the
    completions cut by the token limit (``cut``, booleans) get -1."""
    trained = torch.tensor(rewards, dtype=torch.float32)[None, :]
    if overlong == "penalty" and bool(cut.any()):
        # DAPO's overlong penalty, in its simplest form: a cut completion earns less than any finished one
        trained[0, torch.tensor(cut)] = -1.0
    return trained


def informative(rewards: Any, cut: Any, overlong: str) -> bool:
    """Whether a group's rewards (as trained on, :func:`trained_rewards`) disagree: it carries a signal."""
    return not bool(zero_variance(trained_rewards(rewards, cut, overlong))[0])


def _stored_temperature(row: Any, default: float) -> float:
    """The temperature a rollout was sampled with (rows written before it was stored: the config's)."""
    value = getattr(row, "temperature", None)
    return default if value is None or value != value else float(value)


def _temperatures(part: list[Member]) -> torch.Tensor:
    return torch.tensor([m.temperature for m in part], dtype=torch.float32)


@torch.no_grad()
def _fill_proximal(model: Any, passes: list[list[Group]], temperature: float, pad: int,
                   **options: Any) -> None:
    """Log-probs of every member under the trainee before any step: the decoupled objective's anchor."""
    was_training = model.training
    model.eval()
    for part in passes:
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


def check_data_parallel(config: CampaignConfig) -> torch.device:
    """The device of an ``update.processes > 1`` update; ValueError naming the settings N processes cannot honour."""
    cfg, setting = config.update, f"update.processes = {config.update.processes}"
    device = resolve_device(config.model.device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{setting} runs on the CPU (gloo) or on CUDA GPUs (NCCL), not on model.device = "
                         f"{config.model.device!r}: set update.processes = 1")
    if device.type == "cuda" and device.index is not None:
        raise ValueError(f"{setting} takes one GPU per process (cuda:0 to cuda:{cfg.processes - 1}), which "
                         f"model.device = {config.model.device!r} contradicts: set model.device = 'cuda' or 'auto' "
                         "(CUDA_VISIBLE_DEVICES chooses the GPUs), or update.processes = 1")
    if device.type == "cuda" and torch.cuda.device_count() < cfg.processes:
        raise ValueError(f"{setting} takes one GPU per process, but {torch.cuda.device_count()} are visible: "
                         f"set update.processes <= {torch.cuda.device_count()}, or model.device = 'cpu'")
    return device


def dropout_settings(model: Any) -> list[str]:
    """The dropout ``model`` applies when training: modules with p > 0 and the config's dropout rates."""
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            found.setdefault(f"p={module.p}", f"{name} (p={module.p})")
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    settings = getattr(getattr(inner, "config", None), "to_dict", dict)()
    for key, value in settings.items():
        if (("dropout" in key or "pdrop" in key) and not key.startswith(("classifier", "summary"))
                and isinstance(value, float) and value > 0):
            found[key] = f"model config {key} = {value}"
    return sorted(found.values())


def _reference_checkpoint(rt: Runtime) -> Path:
    """The KL penalty's reference: the champion or the base model (``update.kl_reference``)."""
    anchor_version = rt.champion_version() if rt.config.update.kl_reference == "champion" else int(rt.store.scalar(
        "SELECT min(version) FROM model_versions WHERE campaign = ? AND kind = 'base'", [rt.campaign]))
    return rt.checkpoint(anchor_version)


def _train_data_parallel(rt: Runtime, iteration: int, groups: list[Group], schedule: list[list[Group]], *,
                         source: Path, seed: int, longest: int, optimizer_file: Path | None,
                         device: torch.device) -> tuple[dict[str, Any], Path]:
    """The schedule's steps in ``update.processes`` processes; their report and the folder of their checkpoint."""
    from evertrain.models.data_parallel import launch, write_spec

    config, cfg = rt.config, rt.config.update
    scratch = rt.checkpoint_dir(iteration).with_name(f"iteration-{iteration}.data-parallel")
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    index = {id(g): i for i, g in enumerate(groups)}
    spec_groups = [{"prompt": [int(t) for t in g.prompt], "members": [  # plain JSON (the store gives numpy scalars)
        {"ids": [int(t) for t in m.ids], "logprobs": [float(x) for x in m.logprobs], "advantage": float(m.advantage),
         "loss_mask": [int(x) for x in m.loss_mask], "temperature": float(m.temperature),
         "proximal": None if m.proximal is None else [float(x) for x in m.proximal]} for m in g.members]}
        for g in groups]
    threads = max(1, (config.torch_threads or len(os.sched_getaffinity(0))) // cfg.processes)
    spec = write_spec(
        scratch / "spec.json", checkpoint=str(Path(source).resolve()), groups=spec_groups,
        minibatches=[[index[id(g)] for g in minibatch] for minibatch in schedule], out=str(scratch / "out"),
        learning_rate=cfg.learning_rate, microbatch_size=cfg.microbatch_size,
        microbatch_tokens=cfg.microbatch_tokens, temperature=config.generation.temperature, seed=seed,
        algorithm=cfg.algorithm, clip_low=cfg.clip_low,
        clip_high=cfg.clip_upper, is_cap=cfg.is_cap, finetune=cfg.finetune, lora=cfg.lora.model_dump(),
        max_grad_norm=cfg.max_grad_norm, weight_decay=cfg.weight_decay, max_completion_length=longest,
        kl_coef=cfg.kl_coef, reference=str(_reference_checkpoint(rt).resolve()) if cfg.kl_coef > 0 else None,
        precision=cfg.precision, gradient_checkpointing=cfg.gradient_checkpointing, logprob_chunk=cfg.logprob_chunk,
        optimizer_state=str(optimizer_file.resolve()) if optimizer_file else None, cpu=device.type == "cpu",
        threads=threads)
    logging.getLogger("evertrain").info("update i=%d: %d steps in %d data-parallel processes (%s)", iteration,
                                        len(schedule), cfg.processes, scratch)
    return launch(spec, cfg.processes, cpu=device.type == "cpu", threads=threads), scratch / "out"


def _train_here(model: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                schedule: list[list[Group]], reference: Any, *, iteration: int, longest: int,
                autocast_dtype: torch.dtype | None, pad: int, logprob_options: dict[str, Any],
                cfg: UpdateConfig) -> tuple[int, list[float], list[float], list[float], dict[str, float], float]:
    """The schedule's steps in this process: steps, losses, grad norms, importance weights, statistics, seconds."""
    steps, stats_sum, losses, grad_norms, is_weights = 0, {}, [], [], []
    model_seconds = 0.0
    with progress(len(schedule), f"update   i={iteration}", "step") as bar:
        for minibatch in schedule:
            members = [m for g in minibatch for m in g.members]
            norm = LossNorm(sequences=len(members), tokens=sum(sum(m.loss_mask) for m in members),
                            max_completion_length=longest)
            optimizer.zero_grad(set_to_none=True)
            began = time.perf_counter()
            total = 0.0
            for micro in _passes(minibatch, cfg):
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
    return steps, losses, grad_norms, is_weights, stats_sum, model_seconds


def update(rt: Runtime, iteration: int) -> dict[str, Any]:
    """The update stage for ``iteration`` (in ``update.processes`` processes); its metrics."""
    config, cfg = rt.config, rt.config.update
    device = check_data_parallel(config) if cfg.processes > 1 else None
    start_version = start_version_of(rt, iteration)
    groups, info = gather_groups(rt, iteration, start_version)
    from evertrain.tasks.sft import checkpoint_for

    if not groups and checkpoint_for(rt, iteration) is None:
        # nothing to learn from (and no SFT result to register): the weights would equal the trainee's, so
        # no challenger is registered and evaluate and promote record themselves as skipped instead of
        # judging a copy of the champion
        _drop_registration(rt, iteration, start_version)
        return {**info, "start_version": start_version, "steps": 0, "trained_sequences": 0, "trained_tokens": 0,
                "processes": 1, "skipped": "no informative group: every group's rewards agreed (or were too stale)"}

    # a fresh adapter's initialisation, dropout and (below) the minibatch order all come from the campaign
    # seed and the iteration, so a rerun of this stage trains from the same weights
    init_seed = seed_for(config.seed, iteration, "update", "init")
    torch.manual_seed(init_seed)
    # the optional sft stage's result, when it ran for this iteration: the challenger is then SFT, then RL
    source = checkpoint_for(rt, iteration) or rt.checkpoint(start_version)
    model, tokenizer = load_policy(source, trainable=True, lora=cfg.lora,
                                   finetune=cfg.finetune, device=config.model.device)
    if device is not None and (dropout := dropout_settings(model)):
        raise ValueError(f"update.processes = {cfg.processes}, but the model applies dropout ({', '.join(dropout)}): "
                         "each process would draw its own masks, so N processes cannot take the steps one takes; "
                         "set update.processes = 1 (or a model and update.lora.dropout without dropout)")
    autocast_dtype = update_precision(cfg.precision, next(model.parameters()).device)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    # chunked log-probs; gradient checkpointing recomputes layers, which must not write to a shared KV cache twice
    logprob_options = {"chunk": cfg.logprob_chunk, "shared_prefix": not cfg.gradient_checkpointing}
    reference = None
    if cfg.kl_coef > 0 and device is None:  # data-parallel processes load their own
        reference, _ = load_policy(_reference_checkpoint(rt), trainable=False, device=config.model.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    optimizer_state = restore_optimizer(rt, optimizer, start_version, iteration)
    before = _trainable_snapshot(model)
    temperature, pad = config.generation.temperature, tokenizer.pad_token_id
    began = time.perf_counter()
    with autocast(autocast_dtype, model):
        _fill_proximal(model, _passes(groups, cfg), temperature, pad, **logprob_options)
    model_seconds = time.perf_counter() - began
    mismatch = mismatch_stats(groups, cfg.is_cap)

    rng = random.Random(seed_for(config.seed, iteration, "update"))
    longest = normaliser_length(rt, groups)
    schedule = []
    for _epoch in range(cfg.epochs if groups else 0):
        order = groups[:]
        rng.shuffle(order)
        schedule += _batches(order, cfg.minibatch_size)
    processes = cfg.processes if device is not None and schedule else 1
    trained_elsewhere: Path | None = None
    if processes > 1:
        assert device is not None
        # the processes load their own copies: this one's leaves memory (on a GPU, the first process's)
        before = {name: value.cpu() for name, value in before.items()}
        del model, optimizer, params
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        optimizer_file = rt.checkpoint(start_version) / "optimizer.pt" if optimizer_state == "restored" else None
        with progress(len(schedule), f"update   i={iteration}", "step") as bar:
            report, trained_elsewhere = _train_data_parallel(
                rt, iteration, groups, schedule, source=Path(source), seed=init_seed, longest=longest,
                optimizer_file=optimizer_file, device=device)
            bar.update(len(schedule))
        if report["processes"] != processes:
            raise RuntimeError(f"the data-parallel update ran {report['processes']} processes, not {processes}")
        # the trained checkpoint, loaded as this process would have held it after its own loop
        model, _ = load_policy(trained_elsewhere, trainable=True, lora=cfg.lora, finetune=cfg.finetune,
                               device=config.model.device)
        steps, losses, grad_norms = len(report["losses"]), report["losses"], report["grad_norms"]
        is_weights, stats_sum = report["is_weights"], report["stats_sum"]
        model_seconds += report["model_s"]
    else:
        steps, losses, grad_norms, is_weights, stats_sum, seconds = _train_here(
            model, optimizer, params, schedule, reference, iteration=iteration, longest=longest,
            autocast_dtype=autocast_dtype, pad=pad, logprob_options=logprob_options, cfg=cfg)
        model_seconds += seconds

    delta = math.sqrt(sum(float((p.detach() - before[n].to(p.device)).pow(2).sum())
                          for n, p in model.named_parameters() if p.requires_grad))
    path = save_checkpoint(model, rt.checkpoint_dir(iteration), rt.base_model, parent_version=start_version,
                           iteration=iteration)
    if trained_elsewhere is not None:
        shutil.copyfile(trained_elsewhere / "optimizer.pt", path / "optimizer.pt")
        shutil.rmtree(trained_elsewhere.parent, ignore_errors=True)
    else:
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
        "processes": processes,
    }
    metrics.update({key: value / trained for key, value in stats_sum.items() if key != "tokens"})
    metrics.update(mismatch)
    return metrics


@task(name="update", cache_policy=NO_CACHE)
def update_task(config: CampaignConfig, iteration: int) -> dict[str, Any]:
    return run_stage(get_runtime(config), "update", iteration, update)
