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
   sampler/trainer mismatch is logged per iteration (``mismatch_kl``, ``is_clipped_share``). Every
   log-prob is recomputed under the temperature and nucleus (top-p) its rollout was sampled with, the
   KL reference's too (chunked and under autocast like the policy's): the distribution the behaviour
   log-probs are of. One optimizer step is :func:`evertrain.models.grpo.train_step`, here and in the
   data-parallel processes.
4. Save the checkpoint, log it to MLflow, register it with alias ``challenger``; it becomes the trainee.
   AdamW's moments are saved with it, keyed by the content hash of its weights: the next update restores
   them only when it starts from those weights (not when the sft stage has changed them since).

The starting version is fixed on the first run of the stage (a rerun trains from the same weights).

With ``update.processes = N > 1`` step 3 runs in N data-parallel processes (``accelerate launch``, see
:mod:`evertrain.models.data_parallel`; gloo on the CPU, NCCL on GPUs, one GPU each): the stage gathers the
groups, computes the proximal log-probs, advantages and minibatch order as with one process, writes them
to a spec, launches the processes, then loads the checkpoint they wrote and registers it as it would its
own. Each process takes whole groups of every minibatch and the gradients are summed (DDP's bucketed
all-reduce), so the steps are those of one process (up to float rounding: the sums are taken in another
order). Everything the update does is done the same there: the decoupled objective and its importance
weights, per-completion temperatures and top-p, DAPO's overlong filtering and penalty (they act on the
gathered groups), Dr.GRPO's constant length, the KL penalty, weight decay, restored AdamW moments,
``precision``, ``logprob_chunk``, ``gradient_checkpointing``, full fine-tuning and SFT results as the
starting point. Refused, naming the
settings, because N processes could not take the steps one takes:

- ``update.lora.dropout > 0`` (config validation), and a model with any other dropout (stage start):
  each process would draw its own dropout masks;
- ``model.device`` naming one device (``cuda:1``) or a device other than the CPU or CUDA (stage start):
  the processes take one GPU each, cuda:0 to cuda:N-1 (select them with CUDA_VISIBLE_DEVICES);
- more processes than visible GPUs when the update runs on GPUs (stage start).
"""

from __future__ import annotations

import gc
import hashlib
import json
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
from evertrain.models.checkpoint import load_policy, save_checkpoint
from evertrain.models.data_parallel import launch, write_spec
from evertrain.models.grpo import (
    Group,
    LogProbs,
    Member,
    StepSettings,
    floored,
    group_advantages,
    micro_passes,
    sampling_settings,
    train_step,
    zero_variance,
)
from evertrain.models.logprobs import grouped_logprobs
from evertrain.models.precision import autocast, enable_gradient_checkpointing, resolve_device, update_precision
from evertrain.progress import progress
from evertrain.runtime import Runtime, seed_for
from evertrain.tasks.base import run_stage
from evertrain.tasks.warm_start import checkpoint_for, start_version_of

_WARNED_FRESH: set[str] = set()  # campaigns whose fresh optimizer state this process has warned about


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


def step_settings(cfg: UpdateConfig, autocast_dtype: torch.dtype | None, pad: int) -> StepSettings:
    """The update's settings as one optimizer step (:func:`evertrain.models.grpo.train_step`) takes them."""
    return StepSettings(algorithm=cfg.algorithm, clip_low=cfg.clip_low, clip_high=cfg.clip_upper, is_cap=cfg.is_cap,
                        kl_coef=cfg.kl_coef, max_grad_norm=cfg.max_grad_norm, microbatch_size=cfg.microbatch_size,
                        microbatch_tokens=cfg.microbatch_tokens, autocast_dtype=autocast_dtype, pad_id=pad,
                        chunk=cfg.logprob_chunk, shared_prefix=not cfg.gradient_checkpointing)


def _passes(groups: list[Group], cfg: UpdateConfig) -> list[list[Group]]:
    """Forward/backward passes: ``microbatch_size`` completions and ``microbatch_tokens`` padded tokens at most."""
    return micro_passes(groups, step_settings(cfg, None, 0))


def _trainable_snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def lags_from(rt: Runtime, start: int, depth: int) -> dict[int, int]:
    """Policy versions reachable from ``start`` through at most ``depth`` parent links, with their distance."""
    return rt.store.ancestors(rt.campaign, start, depth)


def gather_groups(rt: Runtime, iteration: int, start: int) -> tuple[list[Group], dict[str, Any]]:
    """Trainable groups with advantages, within the staleness bound, and what was left out and why."""
    cfg = rt.config.update
    first = iteration - cfg.max_staleness if cfg.replay else iteration
    frame = rt.store.rollouts_for_update(rt.campaign, max(first, 0), iteration)
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
                          lag=int(lag), temperature=_stored(r, "temperature", rt.config.generation.temperature),
                          top_p=_stored(r, "top_p", rt.config.generation.top_p))
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


def _stored(row: Any, setting: str, default: float) -> float:
    """The temperature or top-p a rollout was sampled with (rows written before it was stored: the config's)."""
    value = getattr(row, setting, None)
    return default if value is None or value != value else float(value)


@torch.no_grad()
def _fill_proximal(model: Any, passes: list[list[Group]], pad: int, **options: Any) -> None:
    """Log-probs of every member under the trainee before any step: the decoupled objective's anchor. Each
    under the temperature and nucleus it was sampled with, as its behaviour log-probs were."""
    was_training = model.training
    model.eval()
    for part in passes:
        temperature, top_p = sampling_settings([m for g in part for m in g.members])
        logps, _ = grouped_logprobs(model, [g.prompt for g in part], [[m.ids for m in g.members] for g in part],
                                    temperature=temperature, top_p=top_p, pad_id=pad, **options)
        logps = floored(logps)
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
    protected = set(rt.store.champion_history(rt.campaign))  # the champion and the one before it, as the store says
    dropped = [v for v in rt.tracker.versions_of(iteration) if v not in protected]
    for old_version in dropped:
        rt.tracker.delete_version(old_version)
    rt.store.drop_iteration_versions(rt.campaign, iteration)
    if rt.trainee_version() in dropped:
        rt.store.set_campaign_state(rt.campaign, trainee_version=start_version)


OPTIMIZER_KEY = "optimizer.json"  # beside optimizer.pt: the content hash of the weights its moments belong to


def weights_hash(checkpoint: Path) -> str:
    """SHA-256 of a checkpoint's weight files (adapter or full weights), names and bytes."""
    digest = hashlib.sha256()
    for path in sorted(Path(checkpoint).glob("*.safetensors")):
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def save_optimizer(optimizer_state: dict[str, Any] | Path, checkpoint: Path) -> None:
    """Write AdamW's state (a state dict, or an ``optimizer.pt`` to copy) into ``checkpoint``, keyed by the
    content hash of the checkpoint's weights: the moments are restored only onto those weights."""
    if isinstance(optimizer_state, Path):
        shutil.copyfile(optimizer_state, checkpoint / "optimizer.pt")
    else:
        torch.save(optimizer_state, checkpoint / "optimizer.pt")
    (checkpoint / OPTIMIZER_KEY).write_text(json.dumps({"weights_sha256": weights_hash(checkpoint)}))


def _optimizer_refusal(rt: Runtime, start_version: int, source: Path) -> str | None:
    """Why the moments saved with ``start_version`` must not be restored onto ``source``'s weights (or None)."""
    saved = rt.checkpoint(start_version)
    if not (saved / "optimizer.pt").exists():
        return f"v{start_version} has no optimizer.pt"
    key = saved / OPTIMIZER_KEY
    if key.exists():
        if json.loads(key.read_text()).get("weights_sha256") != weights_hash(source):
            return (f"the weights were changed since v{start_version}'s optimizer state was saved"
                    + (f" (by the stage that wrote {source.name})" if source.resolve() != saved.resolve() else ""))
    elif source.resolve() != saved.resolve():  # saved before the key existed: only v's own weights are known
        return f"the update starts from {source.name}, not v{start_version}, whose weights were changed"
    return None


def restore_optimizer(rt: Runtime, optimizer: torch.optim.Optimizer, start_version: int, iteration: int,
                      source: Path | None = None) -> str:
    """Load the AdamW moments saved with ``start_version`` when the update starts from the weights they were
    saved with (``source``, default v's own checkpoint: not when the sft stage changed them); say so (log
    and MLflow tag) when they are not restored.

    Returns "restored", "fresh: <why>" or "fresh: base model" (a base version has none to restore).
    """
    kind = rt.store.model_version(rt.campaign, start_version)["kind"]
    optimizer_file = rt.checkpoint(start_version) / "optimizer.pt"
    refusal = None if kind == "base" else _optimizer_refusal(rt, start_version,
                                                             Path(source or rt.checkpoint(start_version)))
    if kind == "base":
        outcome = "fresh: base model"
    elif refusal:
        outcome = f"fresh: {refusal}"
    else:
        try:
            optimizer.load_state_dict(torch.load(optimizer_file, weights_only=True))
            outcome = "restored"
        except (ValueError, RuntimeError, KeyError) as error:  # e.g. a different parameter layout
            outcome = f"fresh: v{start_version}'s optimizer state does not fit ({str(error)[:200]})"
    if outcome.startswith("fresh") and kind != "base":
        # said once per campaign and process as a warning (then at INFO): the same cause recurs every iteration
        # it applies to, and the MLflow tag below records each one
        level = logging.INFO if rt.campaign in _WARNED_FRESH else logging.WARNING
        _WARNED_FRESH.add(rt.campaign)
        logging.getLogger("evertrain").log(level, "update i=%d: optimizer state not restored, AdamW starts "
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
    anchor_version = rt.champion_version() if rt.config.update.kl_reference == "champion" else \
        rt.base_version()
    return rt.checkpoint(anchor_version)


def _train_data_parallel(rt: Runtime, iteration: int, groups: list[Group], schedule: list[list[Group]], *,
                         source: Path, seed: int, longest: int, optimizer_file: Path | None,
                         device: torch.device) -> tuple[dict[str, Any], Path]:
    """The schedule's steps in ``update.processes`` processes; their report and the folder of their checkpoint."""
    config, cfg = rt.config, rt.config.update
    scratch = rt.checkpoint_dir(iteration).with_name(f"iteration-{iteration}.data-parallel")
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    index = {id(g): i for i, g in enumerate(groups)}
    spec_groups = [{"prompt": [int(t) for t in g.prompt], "members": [  # plain JSON (the store gives numpy scalars)
        {"ids": [int(t) for t in m.ids], "logprobs": [float(x) for x in m.logprobs], "advantage": float(m.advantage),
         "loss_mask": [int(x) for x in m.loss_mask], "temperature": float(m.temperature), "top_p": float(m.top_p),
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


@dataclass
class Trained:
    """What the update's steps did, here or in data-parallel processes."""

    steps: int
    losses: list[float]
    grad_norms: list[float]
    is_weights: list[float]
    stats_sum: dict[str, float]
    model_s: float
    processes: int = 1


def _train_here(model: Any, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                schedule: list[list[Group]], reference: Any, *, iteration: int, longest: int,
                autocast_dtype: torch.dtype | None, pad: int, logprob_options: dict[str, Any],
                cfg: UpdateConfig) -> tuple[int, list[float], list[float], list[float], dict[str, float], float]:
    """The schedule's steps in this process: steps, losses, grad norms, importance weights, statistics, seconds."""
    settings = step_settings(cfg, autocast_dtype, pad)
    settings = replace(settings, chunk=logprob_options.get("chunk", settings.chunk),
                       shared_prefix=logprob_options.get("shared_prefix", settings.shared_prefix))
    scorer = LogProbs(model)
    losses, grad_norms, is_weights, stats_sum = [], [], [], {}
    began = time.perf_counter()
    with progress(len(schedule), f"update   i={iteration}", "step") as bar:
        for minibatch in schedule:
            step = train_step(scorer, optimizer, params, minibatch, settings, reference=reference,
                              max_completion_length=longest)
            losses.append(step.loss)
            grad_norms.append(step.grad_norm)
            is_weights += step.is_weights
            for key, value in step.stats_sum.items():
                stats_sum[key] = stats_sum.get(key, 0.0) + value
            bar.update(1)
    return len(schedule), losses, grad_norms, is_weights, stats_sum, time.perf_counter() - began


def _schedule(rt: Runtime, iteration: int, groups: list[Group]) -> list[list[Group]]:
    """The minibatches of every epoch, in an order seeded by the campaign seed and the iteration."""
    rng = random.Random(seed_for(rt.config.seed, iteration, "update"))
    schedule = []
    for _epoch in range(rt.config.update.epochs if groups else 0):
        order = groups[:]
        rng.shuffle(order)
        schedule += _batches(order, rt.config.update.minibatch_size)
    return schedule


def _load_trainee(rt: Runtime, iteration: int, source: Path, data_parallel: bool) -> tuple[Any, Any, Any]:
    """The trainee (fresh adapters seeded by the campaign seed and iteration), its tokenizer and KL reference."""
    config, cfg = rt.config, rt.config.update
    torch.manual_seed(seed_for(config.seed, iteration, "update", "init"))
    model, tokenizer = load_policy(source, trainable=True, lora=cfg.lora, finetune=cfg.finetune,
                                   device=config.model.device)
    if data_parallel and (dropout := dropout_settings(model)):
        raise ValueError(f"update.processes = {cfg.processes}, but the model applies dropout ({', '.join(dropout)}): "
                         "each process would draw its own masks, so N processes cannot take the steps one takes; "
                         "set update.processes = 1 (or a model and update.lora.dropout without dropout)")
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    reference = None
    if cfg.kl_coef > 0 and not data_parallel:  # data-parallel processes load their own
        reference, _ = load_policy(_reference_checkpoint(rt), trainable=False, device=config.model.device)
    return model, tokenizer, reference


def _train_elsewhere(rt: Runtime, iteration: int, groups: list[Group], schedule: list[list[Group]], *,
                     source: Path, longest: int, restored: bool, start_version: int,
                     device: torch.device) -> tuple[Any, Trained, Path]:
    """The schedule in ``update.processes`` processes: the trained model, loaded here, what they did, their folder."""
    config, cfg = rt.config, rt.config.update
    optimizer_file = rt.checkpoint(start_version) / "optimizer.pt" if restored else None
    with progress(len(schedule), f"update   i={iteration}", "step") as bar:
        report, folder = _train_data_parallel(
            rt, iteration, groups, schedule, source=source, seed=seed_for(config.seed, iteration, "update", "init"),
            longest=longest, optimizer_file=optimizer_file, device=device)
        bar.update(len(schedule))
    if report["processes"] != cfg.processes:
        raise RuntimeError(f"the data-parallel update ran {report['processes']} processes, not {cfg.processes}")
    # the trained checkpoint, loaded as this process would have held it after its own loop
    model, _ = load_policy(folder, trainable=True, lora=cfg.lora, finetune=cfg.finetune, device=config.model.device)
    trained = Trained(len(report["losses"]), report["losses"], report["grad_norms"], report["is_weights"],
                      report["stats_sum"], report["model_s"], cfg.processes)
    return model, trained, folder


def _register(rt: Runtime, iteration: int, path: Path, start_version: int) -> int:
    """Register ``path`` as this iteration's challenger and trainee, replacing what an earlier (or killed) run
    of the stage registered, unless it is the champion or the one before it (as the store's lineage says)."""
    protected = set(rt.store.champion_history(rt.campaign))
    for old_version in rt.tracker.versions_of(iteration):
        if old_version not in protected:
            rt.tracker.delete_version(old_version)
    version = rt.tracker.register(path, rt.tracker.run_id(iteration), iteration)
    # one store transaction: the version (replacing an earlier run's) and the trainee; MLflow's challenger alias is
    # its projection, like the champion's
    rt.store.record_version(rt.campaign, version, iteration, rt.config.update.finetune, rt.stored_path(path),
                            start_version)
    rt.tracker.project_lineage(rt.store, rt.campaign)
    return version


def _metrics(cfg: UpdateConfig, groups: list[Group], trained: Trained) -> dict[str, Any]:
    """The stage's metrics about its steps (means over steps and passes, statistics per trained sequence)."""
    losses, grad_norms, is_weights = trained.losses, trained.grad_norms, trained.is_weights
    trained_sequences = sum(len(g.members) for g in groups)
    metrics: dict[str, Any] = {
        "steps": trained.steps, "trained_sequences": trained_sequences,
        "trained_tokens": sum(sum(m.loss_mask) for g in groups for m in g.members) * cfg.epochs,
        "loss": sum(losses) / len(losses) if losses else 0.0,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "is_weight_mean": sum(is_weights) / len(is_weights) if is_weights else 1.0,
        "model_s": trained.model_s, "clip_high": cfg.clip_upper, "processes": trained.processes,
    }
    per = max(trained_sequences * cfg.epochs, 1)
    metrics.update({key: value / per for key, value in trained.stats_sum.items() if key != "tokens"})
    return metrics


def update(rt: Runtime, iteration: int) -> dict[str, Any]:
    """The update stage for ``iteration`` (in ``update.processes`` processes); its metrics."""
    config, cfg = rt.config, rt.config.update
    device = check_data_parallel(config) if cfg.processes > 1 else None
    start_version = start_version_of(rt, iteration)
    groups, info = gather_groups(rt, iteration, start_version)
    if not groups and checkpoint_for(rt, iteration) is None:
        # nothing to learn from (and no SFT result to register): the weights would equal the trainee's, so
        # no challenger is registered and evaluate and promote record themselves as skipped instead of
        # judging a copy of the champion
        _drop_registration(rt, iteration, start_version)
        return {**info, "start_version": start_version, "steps": 0, "trained_sequences": 0, "trained_tokens": 0,
                "processes": 1, "skipped": "no informative group: every group's rewards agreed (or were too stale)"}
    # the optional sft stage's result, when it ran for this iteration: the challenger is then SFT, then RL
    source = Path(checkpoint_for(rt, iteration) or rt.checkpoint(start_version))
    model, tokenizer, reference = _load_trainee(rt, iteration, source, device is not None)
    autocast_dtype = update_precision(cfg.precision, next(model.parameters()).device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    optimizer_state = restore_optimizer(rt, optimizer, start_version, iteration, source)
    before = _trainable_snapshot(model)
    pad = tokenizer.pad_token_id
    # chunked log-probs; gradient checkpointing recomputes layers, which must not write to a shared KV cache twice
    logprob_options = {"chunk": cfg.logprob_chunk, "shared_prefix": not cfg.gradient_checkpointing}
    began = time.perf_counter()
    with autocast(autocast_dtype, model):
        _fill_proximal(model, _passes(groups, cfg), pad, **logprob_options)
    proximal_seconds = time.perf_counter() - began
    mismatch = mismatch_stats(groups, cfg.is_cap)
    longest = normaliser_length(rt, groups)
    schedule = _schedule(rt, iteration, groups)
    trained_elsewhere: Path | None = None
    if device is not None and schedule:
        # the processes load their own copies: this one's leaves memory (on a GPU, the first process's)
        before = {name: value.cpu() for name, value in before.items()}
        del model, optimizer, params
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        model, trained, trained_elsewhere = _train_elsewhere(
            rt, iteration, groups, schedule, source=source, longest=longest, start_version=start_version,
            restored=optimizer_state == "restored", device=device)
    else:
        trained = Trained(*_train_here(model, optimizer, params, schedule, reference, iteration=iteration,
                                       longest=longest, autocast_dtype=autocast_dtype, pad=pad,
                                       logprob_options=logprob_options, cfg=cfg))
    delta = math.sqrt(sum(float((p.detach() - before[n].to(p.device)).pow(2).sum())
                          for n, p in model.named_parameters() if p.requires_grad))
    path = save_checkpoint(model, rt.checkpoint_dir(iteration), rt.base_model, parent_version=start_version,
                           iteration=iteration)
    if trained_elsewhere is not None:
        save_optimizer(trained_elsewhere / "optimizer.pt", path)
        shutil.rmtree(trained_elsewhere.parent, ignore_errors=True)
    else:
        save_optimizer(optimizer.state_dict(), path)
    version = _register(rt, iteration, path, start_version)
    return {**info, "challenger_version": version, "start_version": start_version, **_metrics(cfg, groups, trained),
            "model_s": proximal_seconds + trained.model_s, "weight_delta_norm": delta, "normaliser_length": longest,
            "optimizer_restored": float(optimizer_state == "restored"), **mismatch}


@task(name="update", cache_policy=NO_CACHE)
def update_task(rt: Runtime, iteration: int) -> dict[str, Any]:
    return run_stage(rt, "update", iteration, update)
