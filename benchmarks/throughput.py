"""Throughput of every model phase of a campaign against this machine's own ceiling, measured in the same run.

One row per phase and dtype, at the shapes of the campaign config (``--config``, default configs/default.toml;
``--set dotted.key=value`` as the CLI's, for smaller shapes), on ``arithmetic`` prompts (its options from the config):

- ``rollout``: the rollout stage's sampling through the in-house sampler (the stages' ``Sampler`` interface,
  ``generation.backend = "hf"``, opened by ``open_sampler``): ``problems_per_iteration`` prompts, ``group_size``
  completions each, at most the environment's ``max_new_tokens``, the config's temperature, top-p and batch size,
  one seed per problem (as the stage samples). The weights are held in the row's dtype (``model.rollout_dtype``).
- ``greedy``: the evaluate stage's greedy answers to the environment's ``eval_size`` held-out problems.
- ``update_lora``, ``update_full``: the update stage's own optimizer step (``models/grpo.py`` ``train_step`` with the
  stage's ``StepSettings``, ``tasks.update.step_settings``, minibatches of ``update.minibatch_size`` completions
  packed as the stage packs them) over one epoch of synthetic groups of the rollout's shape (every completion
  ``max_new_tokens`` long, random tokens, made-up behaviour log-probs, the group's GRPO advantages): forward,
  backward and AdamW step. LoRA with the config's ``update.lora``, or all weights. Not timed: the stage's proximal
  log-probs (a no-grad forward before the steps), loading and saving. The dtype is the update's autocast
  (``update.precision``; weights, optimizer state and the loss stay float32).
- ``sft``: the sft stage's trainer, TRL's ``SFTTrainer`` with the stage's own arguments
  (``tasks.warm_start.trainer_arguments``: ``sft.batch_size``, ``sft.epochs``, ``sft.learning_rate``, the update's
  precision and finetune), on min(``sft.max_examples``, prompts x G) synthetic completions of ``max_new_tokens``
  after the prompt the stage trains them after (``sft.prompt = "bare"``: the chat without its worked examples);
  timed: ``trainer.train()`` (the trainer's dataset preparation is reported apart, as ``setup_s``).

A dtype the update or sft stage refuses on this machine (``update.precision = "bfloat16"`` without native bfloat16)
gives a row saying so instead of numbers.

Tokens: every prompt once (the sampler and the update read a group's prompt once for its G completions) plus every
completion token; sft: every example's prompt and completion, times ``sft.epochs``. The sampler's prefix cache
reads the prompts' common prefix once per batch, so it computes fewer prompt tokens than counted
(``prompt_tokens_computed`` in the JSON).

FLOPs, from the model's config (never hard-coded): a token's forward is 2 x the non-embedding parameters (all but
the input embedding table and the output projection) + 2 x d_model x vocabulary where its logits are computed (the
completion tokens; every token in sft) + attention, 4 x layers x d_attn x the positions it attends to (Kaplan et
al.'s 2 x n_layers x n_ctx x d_model: a causal token attends to n_ctx / 2 positions on average). Sampling and
greedy evaluation: the forward. Full fine-tuning: 3 x the forward (6 x params x tokens: forward 2N, backward 4N).
LoRA: 2 x the forward (4 x params x tokens: forward 2N plus the backward through the activations 2N; weight
gradients only for the adapters, whose FLOPs are left out). Effective GFLOP/s = those FLOPs / wall seconds.

Ceiling: ``torch.matmul`` of two 2048 x 2048 matrices on the same threads (on ``--device cuda``: on the GPU), in
float32 and bfloat16, 2 n^3 / seconds, the best of ``--repeats`` (at least 3) after a warm-up; measured at the start
and at the end of the run, the higher one counts. Each row's share is of the ceiling in its own dtype (on a GPU:
MFU against the measured ceiling, and against ``--peak-tflops`` when given). Wall and CPU seconds (``os.times`` of
this process) are the mean of ``--repeats`` runs after a warm-up.

    python benchmarks/throughput.py [--config configs/default.toml] [--dtypes float32,bfloat16] [--threads N]
        [--only rollout,greedy,update_lora,update_full,sft] [--device cpu|cuda] [--save NAME]
        [--peak-tflops T | --peak-tflops bfloat16=989,float32=67] [--repeats 2] [--set KEY=VALUE ...]
    python benchmarks/throughput.py --tiny --threads 1   # the tests' tiny model: a check of the plumbing

Writes ``benchmarks/results/throughput_<NAME>.json`` (default NAME: the device; ``tiny`` with ``--tiny``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evertrain.quiet import quiet_libraries  # noqa: E402

quiet_libraries()  # before transformers, datasets and TRL read their environment

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from benchmarks.common import print_table, save  # noqa: E402
from evertrain.config import CampaignConfig, load_config  # noqa: E402
from evertrain.envs import registry  # noqa: E402
from evertrain.inference.backends import open_sampler  # noqa: E402
from evertrain.models import ModelError  # noqa: E402
from evertrain.models.checkpoint import (  # noqa: E402
    encode_chat,
    load_policy,
    load_tokenizer,
    resolve_base,
    write_base_checkpoint,
)
from evertrain.models.grpo import Group, LogProbs, Member, group_advantages, train_step  # noqa: E402
from evertrain.models.precision import enable_gradient_checkpointing, set_threads, update_precision  # noqa: E402
from evertrain.models.tiny import build_tiny_model  # noqa: E402
from evertrain.runtime import seed_for  # noqa: E402
from evertrain.tasks.sft import bare_chat  # noqa: E402
from evertrain.tasks.update import _batches, step_settings  # noqa: E402  (the stage's own minibatch packing)
from evertrain.tasks.warm_start import quiet_trainer, trainer_arguments  # noqa: E402

ENV = "arithmetic"
PHASES = ("rollout", "greedy", "update_lora", "update_full", "sft")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CEILING_SIZE = 2048
FORMULAS = {
    "forward_flop": "2 x non-embedding params x tokens + 2 x d_model x vocab x logit tokens "
                    "+ 4 x layers x d_attn x positions attended (= 2 x layers x n_ctx x d_model per token)",
    "rollout, greedy": "1 x forward",
    "update_lora, sft (lora)": "2 x forward (4 x N x tokens: forward 2N + backward through activations 2N; "
                               "adapter weight gradients left out)",
    "update_full, sft (full)": "3 x forward (6 x N x tokens)",
    "ceiling": "2 x 2048^3 / seconds of one torch.matmul of 2048 x 2048 matrices, best of repeats after a warm-up",
    "tokens": "each prompt once + every completion token (sft: prompt + completion of every example, x epochs)",
}
T = TypeVar("T")


# --- the model's arithmetic -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """What a token's FLOPs depend on, read from the model's config."""

    layers: int
    d_model: int
    d_attn: int  # query heads x head width: the width of the attention scores' dot products
    vocab: int
    body_params: int  # every parameter but the input embedding table and the output projection
    head_params: int  # the output projection (d_model x vocabulary), tied or not: one matrix product per logit

    def forward_flops(self, tokens: int, logit_tokens: int, positions: int) -> float:
        """FLOPs of a forward over ``tokens`` tokens, ``logit_tokens`` of them through the output projection, that
        attend to ``positions`` positions in all (:func:`attended`)."""
        return 2.0 * self.body_params * tokens + 2.0 * self.head_params * logit_tokens \
            + 4.0 * self.layers * self.d_attn * positions


def model_shape(base: str) -> Shape:
    """The FLOP-relevant shape of the causal LM in ``base`` (built on the meta device: no weights read)."""
    config = AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters() if p is not embedding and p is not head)
    heads = config.num_attention_heads
    width = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Shape(layers=config.num_hidden_layers, d_model=config.hidden_size, d_attn=heads * width,
                 vocab=head.shape[0], body_params=body, head_params=head.numel())


def attended(prompt: int, completion: int = 0, *, prompt_computed: bool = True) -> int:
    """Positions attended by a causal sequence's tokens: the prompt's (when computed here) and ``completion``
    tokens after it."""
    own = prompt * (prompt + 1) // 2 if prompt_computed else 0
    return own + completion * prompt + completion * (completion + 1) // 2


# --- timing -----------------------------------------------------------------------------------------------------

def cpu_seconds() -> float:
    """User and system seconds of this process."""
    times = os.times()
    return times.user + times.system


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(work: Callable[[], T], device: torch.device) -> tuple[T, float, float]:
    """``work()``, its wall seconds and this process's CPU seconds."""
    synchronize(device)
    wall, cpu = time.perf_counter(), cpu_seconds()
    result = work()
    synchronize(device)
    return result, time.perf_counter() - wall, cpu_seconds() - cpu


def matmul_ceiling(dtype: torch.dtype, device: torch.device, size: int = CEILING_SIZE, repeats: int = 3) -> float:
    """GFLOP/s of one ``size`` x ``size`` matrix product in ``dtype`` on ``device``: the best of ``repeats`` after a
    warm-up (on a GPU each timing covers enough products to outlast the launch overhead)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    inner = 20 if device.type == "cuda" else 1
    torch.matmul(a, b)
    synchronize(device)
    best = math.inf
    for _ in range(max(repeats, 3)):
        _, seconds, _ = timed(lambda: [torch.matmul(a, b) for _ in range(inner)], device)
        best = min(best, seconds / inner)
    return 2.0 * size**3 / best / 1e9


def release(device: torch.device) -> None:
    """Give back what the last phase held, before the next is measured."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- one phase's measurement ------------------------------------------------------------------------------------

@dataclass
class Run:
    """One timed run of a phase: what it computed and what it took."""

    tokens: int
    completion_tokens: int
    flops: float  # the phase's multiplier of the forward included
    wall_s: float
    cpu_s: float


@dataclass
class Measured:
    """A phase's timed runs and what describes them."""

    runs: list[Run] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def mean(self, name: str) -> float:
        return sum(getattr(run, name) for run in self.runs) / len(self.runs)


@dataclass
class Bench:
    """The run's shared inputs: config, model, device and the prompts every phase uses."""

    config: CampaignConfig
    base: str
    checkpoint: Path
    device: torch.device
    shape: Shape
    repeats: int
    tokenizer: Any
    train_prompts: list[list[int]]
    eval_prompts: list[list[int]]
    sft_prompts: list[list[int]]
    seeds: list[int]

    @property
    def max_new_tokens(self) -> int:
        return self.config.max_new_tokens(ENV)

    @functools.cached_property
    def ordinary_ids(self) -> list[int]:
        special = set(self.tokenizer.all_special_ids)
        return [i for i in range(len(self.tokenizer)) if i not in special]

    def synthetic_completion(self, rng: random.Random) -> list[int]:
        """``max_new_tokens`` random ordinary (non-special) tokens: a completion that never stops early."""
        return [rng.choice(self.ordinary_ids) for _ in range(self.max_new_tokens)]


def sampling(bench: Bench, dtype: str, phases: list[str]) -> dict[str, Measured]:
    """The rollout and the greedy evaluation through the in-house sampler, weights in ``dtype``."""
    config, gen = bench.config, bench.config.generation
    config = config.model_copy(update={
        "model": config.model.model_copy(update={"path": bench.base, "rollout_dtype": dtype,
                                                 "device": str(bench.device)}),
        "generation": gen.model_copy(update={"backend": "hf"})})
    sampler, load_s = open_sampler(config, bench.checkpoint)
    sampler.sample(bench.train_prompts[:2], 2, max_new_tokens=4, temperature=gen.temperature)  # warm-up
    out = {}
    for phase in ("rollout", "greedy"):
        if phase not in phases:
            continue
        greedy = phase == "greedy"
        prompts = bench.eval_prompts if greedy else bench.train_prompts
        n = 1 if greedy else config.group_size
        limit = config.max_new_tokens(ENV, evaluation=greedy)
        measured = Measured(extra={"prompts": len(prompts), "n": n, "max_new_tokens": limit, "load_s": load_s,
                                   "multiplier": 1, "prompt_tokens_computed": []})
        for repeat in range(bench.repeats):
            options: dict[str, Any] = {"greedy": True} if greedy else {
                "temperature": gen.temperature, "top_p": gen.top_p, "seeds": [s + repeat for s in bench.seeds]}

            def draw(prompts: list[list[int]] = prompts, n: int = n, limit: int = limit,
                     options: dict[str, Any] = options) -> Any:
                return sampler.sample(prompts, n, max_new_tokens=limit, batch_size=gen.batch_size, **options)

            (groups, stats), wall, cpu = timed(draw, bench.device)
            lengths = [[len(s.completion_ids) for s in group] for group in groups]
            completion = sum(map(sum, lengths))
            tokens = sum(map(len, prompts)) + completion
            positions = sum(attended(len(p)) + sum(attended(len(p), c, prompt_computed=False) for c in group)
                            for p, group in zip(prompts, lengths, strict=True))
            measured.runs.append(Run(tokens, completion, bench.shape.forward_flops(tokens, completion, positions),
                                     wall, cpu))
            measured.extra["prompt_tokens_computed"].append(stats.prompt_tokens)
        out[phase] = measured
    return out  # the sampler's weights go with this frame: the caller releases them


def synthetic_groups(bench: Bench) -> list[Group]:
    """The rollout's shape as the update trains it: G completions of ``max_new_tokens`` per prompt, half of them
    rewarded (the group's GRPO advantages), behaviour log-probs made up, every token the policy's own."""
    config, rng = bench.config, random.Random(bench.config.seed)
    size = config.group_size
    rewards = torch.tensor([[float(i % 2) for i in range(size)]])
    advantages = group_advantages(rewards, config.update.algorithm)[0].tolist()
    groups = []
    for prompt in bench.train_prompts:
        members = []
        for advantage in advantages:
            ids = bench.synthetic_completion(rng)
            members.append(Member(ids=ids, logprobs=[-1.0] * len(ids), advantage=advantage, loss_mask=[1] * len(ids),
                                  temperature=config.generation.temperature, top_p=config.generation.top_p))
        groups.append(Group(prompt, members, ENV))
    return groups


def update(bench: Bench, finetune: str, dtype: str) -> Measured | str:
    """One epoch of the update stage's optimizer steps on synthetic groups (or why the stage refuses ``dtype``)."""
    cfg = bench.config.update.model_copy(update={"finetune": finetune, "precision": dtype})
    try:
        autocast_dtype = update_precision(dtype, bench.device)
    except ModelError as error:
        return f"the update refuses it here: {error}"
    torch.manual_seed(seed_for(bench.config.seed, 0, "update", "init"))
    model, tokenizer = load_policy(bench.checkpoint, trainable=True, lora=cfg.lora, finetune=finetune,
                                   device=str(bench.device))
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    settings = step_settings(cfg, autocast_dtype, tokenizer.pad_token_id)
    scorer = LogProbs(model)
    groups = synthetic_groups(bench)
    schedule = _batches(groups, cfg.minibatch_size)
    longest = bench.max_new_tokens

    def epoch() -> None:
        for minibatch in schedule:
            train_step(scorer, optimizer, params, minibatch, settings, max_completion_length=longest)

    train_step(scorer, optimizer, params, schedule[0], settings, max_completion_length=longest)  # warm-up
    completion = sum(len(m.ids) for g in groups for m in g.members)
    tokens = sum(len(g.prompt) for g in groups) + completion
    positions = sum(attended(len(g.prompt)) + sum(attended(len(g.prompt), len(m.ids), prompt_computed=False)
                                                  for m in g.members) for g in groups)
    multiplier = 3 if finetune == "full" else 2
    flops = multiplier * bench.shape.forward_flops(tokens, completion, positions)
    measured = Measured(extra={"steps": len(schedule), "groups": len(groups), "multiplier": multiplier,
                               "trainable_params": sum(p.numel() for p in params),
                               "minibatch_size": cfg.minibatch_size, "microbatch_size": cfg.microbatch_size,
                               "gradient_checkpointing": cfg.gradient_checkpointing})
    for _ in range(bench.repeats):
        _, wall, cpu = timed(epoch, bench.device)
        measured.runs.append(Run(tokens, completion, flops, wall, cpu))
    return measured  # the model and optimizer go with this frame: the caller releases them


def sft(bench: Bench, dtype: str) -> Measured | str:
    """The sft stage's trainer (TRL's SFTTrainer, the stage's arguments) on synthetic examples of the campaign's
    shape (or why the stage refuses ``dtype``)."""
    config = bench.config.model_copy(update={
        "update": bench.config.update.model_copy(update={"precision": dtype})})
    try:
        update_precision(dtype, bench.device)
    except ModelError as error:
        return f"the sft stage refuses it here: {error}"
    cfg, rng = config.sft, random.Random(config.seed)
    count = min(cfg.max_examples, len(bench.sft_prompts) * config.group_size)
    rows = []
    for index in range(count):
        prompt, completion = bench.sft_prompts[index % len(bench.sft_prompts)], bench.synthetic_completion(rng)
        rows.append({"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion})
    rt = SimpleNamespace(config=config)  # trainer_arguments reads only the campaign config

    def trainer(examples: list[dict[str, Any]], scratch: str, **overrides: Any) -> Any:
        torch.manual_seed(seed_for(config.seed, 0, "sft", "init"))
        model, tokenizer = load_policy(bench.checkpoint, trainable=True, lora=config.update.lora,
                                       finetune=config.update.finetune, device=str(bench.device))
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        args = SFTConfig(output_dir=scratch, **{**trainer_arguments(rt, 0, model, "sft"), **overrides})
        return quiet_trainer(SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                                        processing_class=tokenizer))

    lengths = [len(r["input_ids"]) for r in rows]
    tokens, completion = sum(lengths) * cfg.epochs, count * bench.max_new_tokens * cfg.epochs
    multiplier = 3 if config.update.finetune == "full" else 2
    # TRL's forward computes the logits of every position: every token goes through the output projection
    flops = multiplier * cfg.epochs * bench.shape.forward_flops(sum(lengths), sum(lengths),
                                                                sum(attended(n) for n in lengths))
    measured = Measured(extra={"examples": count, "epochs": cfg.epochs, "batch_size": cfg.batch_size,
                               "prompt": cfg.prompt, "finetune": config.update.finetune, "multiplier": multiplier,
                               "setup_s": []})
    with tempfile.TemporaryDirectory(prefix="evertrain-throughput-sft-") as scratch:
        trainer(rows[:cfg.batch_size], scratch, max_steps=1).train()  # warm-up
        release(bench.device)
        for _ in range(bench.repeats):
            began = time.perf_counter()
            run = trainer(rows, scratch)
            measured.extra["setup_s"].append(time.perf_counter() - began)
            result, wall, cpu = timed(run.train, bench.device)
            measured.extra["steps"] = int(result.global_step)
            measured.runs.append(Run(tokens, completion, flops, wall, cpu))
            del run
            release(bench.device)
    return measured


# --- the table --------------------------------------------------------------------------------------------------

def peaks(text: str | None, dtypes: list[str]) -> dict[str, float]:
    """``--peak-tflops``: one number for every dtype, or ``dtype=T`` pairs (``bfloat16=989,float32=67``)."""
    if not text:
        return {}
    if "=" not in text:
        return dict.fromkeys(dtypes, float(text))
    pairs = dict(item.split("=", 1) for item in text.split(","))
    unknown = set(pairs) - set(DTYPES)
    if unknown:
        raise SystemExit(f"--peak-tflops: unknown dtype {', '.join(sorted(unknown))}")
    return {dtype: float(value) for dtype, value in pairs.items()}


def row(phase: str, dtype: str, measured: Measured | str, ceiling: float, peak_tflops: float | None) -> dict[str, Any]:
    """One table row: throughput, effective GFLOP/s and its share of the ceiling (and of the peak) in ``dtype``."""
    if isinstance(measured, str):
        return {"phase": phase, "dtype": dtype, "refused": measured}
    wall, cpu, tokens = measured.mean("wall_s"), measured.mean("cpu_s"), measured.mean("tokens")
    completion, gflops = measured.mean("completion_tokens"), measured.mean("flops") / wall / 1e9
    out = {"phase": phase, "dtype": dtype, "tokens": round(tokens), "completion_tokens": round(completion),
           "wall_s": wall, "cpu_s": cpu, "tokens_per_s": tokens / wall, "completion_tokens_per_s": completion / wall,
           "tokens_per_cpu_s": tokens / cpu if cpu > 0 else None, "gflop": measured.mean("flops") / 1e9,
           "effective_gflops": gflops, "ceiling_gflops": ceiling, "ceiling_share": gflops / ceiling,
           "runs": [vars(run) for run in measured.runs], **measured.extra}
    if peak_tflops:
        out["peak_share"] = gflops / (peak_tflops * 1e3)
    return out


def prepare(args: argparse.Namespace, scratch: Path) -> Bench:
    """The config, base model, checkpoint, shapes and prompts of this run."""
    config = load_config(args.config, args.set)
    if args.tiny:
        base = str(build_tiny_model(scratch / "tiny"))
    else:
        base = resolve_base(config.model.model_copy(update={"path": args.model}))
    checkpoint = write_base_checkpoint(scratch / "base", base)
    spec = next((s for s in config.environments if s.name == ENV), None)
    env = registry.get(ENV, **(spec.options if spec else {}))
    tokenizer = load_tokenizer(base)
    train = env.problems("train", config.problems_per_iteration, config.seed)
    held_out = env.problems("eval", config.eval_size(ENV), 0)
    prompts = [encode_chat(tokenizer, env.messages(p)) for p in train]
    sft_prompts = [encode_chat(tokenizer, bare_chat(env.messages(p))) for p in train] \
        if config.sft.prompt == "bare" else prompts
    return Bench(config=config, base=base, checkpoint=checkpoint, device=torch.device(args.device),
                 shape=model_shape(base), repeats=args.repeats, tokenizer=tokenizer, train_prompts=prompts,
                 eval_prompts=[encode_chat(tokenizer, env.messages(p)) for p in held_out], sft_prompts=sft_prompts,
                 seeds=[seed_for(config.seed, 0, "rollout", p.id) for p in train])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct",
                        help="a local HF folder or an embedded model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.toml"),
                        help="the campaign config whose shapes are measured")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, as `evertrain run --set` (e.g. environments.0.eval_problems=8)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--only", default=",".join(PHASES), help=f"phases, of {','.join(PHASES)}")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core allowed)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--peak-tflops", default=None, metavar="T|DTYPE=T,...",
                        help="the device's peak in TFLOP/s, one for every dtype or one per dtype "
                             "(bfloat16=989,float32=67): rows also give their share of it (MFU against the peak)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each phase after a warm-up")
    parser.add_argument("--ceiling-size", type=int, default=CEILING_SIZE,
                        help="the ceiling's matrices are N x N (default 2048; smaller only for a quick check)")
    parser.add_argument("--save", default=None, metavar="NAME",
                        help="write benchmarks/results/throughput_NAME.json (default: the device; tiny with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model, built in a temporary folder")
    args = parser.parse_args()
    phases = [p for p in args.only.split(",") if p]
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [p for p in phases if p not in PHASES] + [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"unknown phase or dtype: {', '.join(unknown)} (phases: {', '.join(PHASES)}; "
                         f"dtypes: {', '.join(DTYPES)})")
    peak = peaks(args.peak_tflops, dtypes)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    set_threads(args.threads)
    device = torch.device(args.device)
    ceilings: dict[str, dict[str, float]] = {d: {"start": matmul_ceiling(DTYPES[d], device, args.ceiling_size,
                                                                         args.repeats)} for d in dtypes}
    print("ceiling at the start, GFLOP/s: " + ", ".join(f"{d} {c['start']:.1f}" for d, c in ceilings.items()),
          flush=True)
    measured: list[tuple[str, str, Measured | str]] = []

    def done(phase: str, dtype: str, result: Measured | str) -> None:
        release(device)
        if isinstance(result, Measured):
            result.extra["load_average"] = os.getloadavg()[0]  # of the machine, as the phase ended
        measured.append((phase, dtype, result))
        print(f"{phase} {dtype}: " + (result if isinstance(result, str) else
                                      f"{result.mean('tokens'):.0f} tokens in {result.mean('wall_s'):.2f} s"),
              flush=True)

    with tempfile.TemporaryDirectory(prefix="evertrain-throughput-") as scratch:
        bench = prepare(args, Path(scratch))
        print(f"model {bench.base}: {bench.shape}", flush=True)
        for dtype in dtypes:
            if {"rollout", "greedy"} & set(phases):
                for phase, result in sampling(bench, dtype, phases).items():
                    done(phase, dtype, result)
            for finetune in ("lora", "full"):
                if f"update_{finetune}" in phases:
                    done(f"update_{finetune}", dtype, update(bench, finetune, dtype))
            if "sft" in phases:
                done("sft", dtype, sft(bench, dtype))
    for d in dtypes:
        ceilings[d]["end"] = matmul_ceiling(DTYPES[d], device, args.ceiling_size, args.repeats)
        ceilings[d]["gflops"] = max(ceilings[d]["start"], ceilings[d]["end"])
    rows = [row(phase, dtype, m, ceilings[dtype]["gflops"], peak.get(dtype)) for phase, dtype, m in measured]
    share = "mfu" if device.type == "cuda" else "of_ceiling"  # on a GPU: MFU against the measured ceiling
    columns = ["phase", "dtype", "tokens", "wall_s", "cpu_s", "tokens_per_s", "completion_tokens_per_s",
               "tokens_per_cpu_s", "effective_gflops", share] + (["peak_share"] if peak else []) \
        + (["refused"] if any("refused" in r for r in rows) else [])
    print()
    print_table([{**r, share: r.get("ceiling_share", "")} for r in rows], columns)
    where = "the GPU" if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"ceiling ({args.ceiling_size}^2 matrix product on {where}), GFLOP/s: "
          + ", ".join(f"{d} {c['gflops']:.1f}" for d, c in ceilings.items()))
    config = bench.config
    path = save(f"throughput_{args.save or ('tiny' if args.tiny else args.device)}", {
        "settings": vars(args), "model": "tiny" if args.tiny else args.model,
        "shape": vars(bench.shape) | {"flop_per_token_2n": 2 * bench.shape.body_params},
        "shapes": {"prompts": config.problems_per_iteration, "group_size": config.group_size,
                   "max_new_tokens": config.max_new_tokens(ENV), "eval_problems": config.eval_size(ENV),
                   "eval_max_new_tokens": config.max_new_tokens(ENV, evaluation=True),
                   "generation_batch_size": config.generation.batch_size,
                   "mean_prompt_tokens": sum(map(len, bench.train_prompts)) / len(bench.train_prompts),
                   "mean_sft_prompt_tokens": sum(map(len, bench.sft_prompts)) / len(bench.sft_prompts)},
        "ceilings": ceilings, "peak_tflops": peak, "ceiling_size": args.ceiling_size, "formulas": FORMULAS,
        "rows": rows,
        "note": "wall_s, cpu_s, tokens: the mean of the timed runs (runs: each). ceiling_share: of the "
                "matrix-product ceiling in the row's dtype measured in this run (on a GPU: MFU against that "
                "ceiling); peak_share: of --peak-tflops. update and sft: synthetic completions of max_new_tokens "
                "(the rollout's longest), their tokens random. load_average: of the machine as the phase "
                "ended (1 minute)."})
    print(f"\nsaved {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
