"""The policy: where its weights come from, how it samples, and how its checkpoints look on disk.

A checkpoint is a folder with an ``evertrain_checkpoint.json`` manifest naming its kind:
``base`` (just a reference to the base model), ``lora`` (a peft adapter of a few MB on top of the base)
or ``full`` (all weights). Every MLflow model version is such a folder, so ``models:/<name>@champion``
always loads again.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from evertrain.config import LoraConfig, ModelConfig

MANIFEST = "evertrain_checkpoint.json"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
TINY_DIR = "tiny-llama"


class ModelError(RuntimeError):
    """A model or checkpoint that cannot be loaded; the message names the path."""


def resolve_base(model: ModelConfig) -> str:
    """A loadable base-model path for ``model.path``, converting or building embedded models once."""
    if model.path == "embedded:smollm2-135m-instruct":
        from evertrain.models.convert import convert_smollm2

        return str(convert_smollm2(Path(model.models_dir) / SMOLLM2_DIR).resolve())
    if model.path == "embedded:tiny":
        from evertrain.models.tiny import build_tiny_model

        return str(build_tiny_model(Path(model.models_dir) / TINY_DIR).resolve())
    path = Path(model.path).expanduser()
    return str(path.resolve()) if path.exists() else model.path


def read_manifest(checkpoint: str | Path) -> dict[str, Any]:
    path = Path(checkpoint) / MANIFEST
    if not path.exists():
        raise ModelError(f"{checkpoint} is not an evertrain checkpoint (no {MANIFEST})")
    return json.loads(path.read_text())


def write_base_checkpoint(dest: Path, base_model: str) -> Path:
    """A checkpoint that only points at the base model: version 1 of every campaign."""
    from evertrain.portable import portable

    dest.mkdir(parents=True, exist_ok=True)
    # relative to the working directory when inside it (as the config's paths are): the state folder can move
    (dest / MANIFEST).write_text(json.dumps({"kind": "base", "base_model": portable(base_model)}, indent=2))
    return dest


# file digests by (path, size, mtime, ctime, inode): opening a version (the endpoint's swap, a worker's load)
# then hashes only what changed, not every byte of every weight file each time
_DIGESTS: dict[str, tuple[tuple[int, int, int, int], bytes]] = {}
_DIGESTS_LOCK = threading.Lock()
_DIGESTS_MAX = 4096
# a file changed within this many seconds may change again without its times moving (coarse clocks), so it
# is hashed but not remembered (git's "racily clean" rule)
_RACY_SECONDS = 2.0


def _file_digest(path: Path, started: float) -> bytes:
    import hashlib

    info = path.stat()
    key = (info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino)
    name = str(path.resolve())
    with _DIGESTS_LOCK:
        known = _DIGESTS.get(name)
    if known is not None and known[0] == key:
        return known[1]
    with path.open("rb") as file:
        value = hashlib.file_digest(file, "sha256").digest()
    if max(info.st_mtime_ns, info.st_ctime_ns) / 1e9 < started - _RACY_SECONDS:
        with _DIGESTS_LOCK:
            if len(_DIGESTS) >= _DIGESTS_MAX:
                _DIGESTS.pop(next(iter(_DIGESTS)))
            _DIGESTS[name] = (key, value)
    return value


def checkpoint_digest(checkpoint: str | Path) -> str:
    """A checkpoint's identity: sha256 over every file's path (within the folder) and bytes.

    Neither the folder's path nor modification times enter it: an update rerun in place (the same folder,
    new weights) is a new identity, and a copy of the same weights elsewhere is the same one. The base
    model a ``base`` or ``lora`` checkpoint names is referenced by its path and taken as immutable.
    The vLLM engine computes the same digest in its own interpreter (``vllm_engine.folder_digest``).
    Each file's own digest is remembered by its size, times and inode, so a folder read again costs a
    ``stat`` per file, not a read of every byte.
    """
    import hashlib

    root = Path(checkpoint)
    if not root.is_dir():
        raise ModelError(f"checkpoint folder {root} does not exist")
    started = time.time()
    digest = hashlib.sha256()
    files = {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file()}
    for name in sorted(files):  # by name as written (not by path parts): the engine's copy sorts the same way
        digest.update(name.encode() + b"\0")
        digest.update(_file_digest(files[name], started))
    return digest.hexdigest()


def load_tokenizer(base_model: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(base_model)
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot load a tokenizer from {base_model!r}: {error}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_base(base_model: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype)
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot load model weights from {base_model!r}: {error}") from None


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' is the first GPU when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# transformers builds a model under process-wide state (parameters are first created on the meta device):
# two threads loading at once (async mode: the update's load beside the next rollout's) get meta tensors
# ("Cannot copy out of meta tensor"), so every load, peft wrapping included, holds this lock
_LOAD_LOCK = threading.Lock()


def load_policy(checkpoint: str | Path, *, trainable: bool = False, dtype: torch.dtype = torch.float32,
                lora: LoraConfig | None = None, finetune: str = "lora", device: str = "auto") -> tuple[Any, Any]:
    """Load the policy in ``checkpoint`` and its tokenizer (thread-safe: loads are serialized).

    For sampling (``trainable=False``) LoRA adapters are merged into the weights, which makes decoding
    as fast as the base model. For training a ``base`` checkpoint gets fresh adapters (``finetune='lora'``)
    or trains all weights (``'full'``).
    """
    with _LOAD_LOCK:
        return _load_policy(checkpoint, trainable, dtype, lora, finetune, device)


def _load_policy(checkpoint: str | Path, trainable: bool, dtype: torch.dtype, lora: LoraConfig | None,
                 finetune: str, device: str) -> tuple[Any, Any]:
    manifest = read_manifest(checkpoint)
    kind, base_model = manifest["kind"], manifest["base_model"]
    tokenizer = load_tokenizer(base_model)
    model = _load_base(str(checkpoint), dtype) if kind == "full" else _load_base(base_model, dtype)
    if kind == "lora":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(checkpoint), is_trainable=trainable)
        if not trainable:
            model = model.merge_and_unload()
    elif kind == "base" and trainable and finetune == "lora":
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        lora = lora or LoraConfig()
        model = get_peft_model(model, PeftLoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=lora.target_modules, task_type="CAUSAL_LM",
        ))
    elif kind not in ("base", "full", "lora"):
        raise ModelError(f"{checkpoint}: unknown checkpoint kind {kind!r}")
    model.config.use_cache = not trainable
    model.train(trainable)
    return model.to(resolve_device(device)), tokenizer


def save_checkpoint(model: Any, dest: Path, base_model: str, **manifest: Any) -> Path:
    """Save ``model`` (peft adapter or full weights) as a checkpoint folder at ``dest``."""
    from peft import PeftModel

    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    from evertrain.portable import portable

    kind = "lora" if isinstance(model, PeftModel) else "full"
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / MANIFEST).write_text(json.dumps({"kind": kind, "base_model": portable(base_model), **manifest},
                                           indent=2))
    if dest.exists():
        import shutil

        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


# --- sampling ---------------------------------------------------------------------------------------

@dataclass
class Sample:
    """One sampled completion with what the update needs to compute an importance ratio."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end-of-turn token) or "length"
    text: str = ""


@dataclass
class SamplingStats:
    prompt_tokens: int = 0  # prompt tokens computed (once per prompt: the group shares its prefix)
    cached_prompt_tokens: int = 0  # prompt tokens served from the shared prefix cache
    completion_tokens: int = 0
    forward_seconds: float = 0.0

    def merge(self, other: SamplingStats) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.cached_prompt_tokens += other.cached_prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.forward_seconds += other.forward_seconds


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _cache_keyword(model: Any) -> str:
    # transformers 5 renames forward's `past_key_values` to `cache`; some architectures keep the old name
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the model
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def common_prefix_length(rows: list[list[int]]) -> int:
    """Length of the longest prefix that every row shares."""
    first = rows[0]
    length = min(len(row) for row in rows)
    for row in rows[1:]:
        i = 0
        while i < length and row[i] == first[i]:
            i += 1
        length = i
    return length


@dataclass
class Prefill:
    """The KV cache after reading a batch of prompts, and what decoding from it needs."""

    cache: Any
    last_logits: torch.Tensor  # [batch, vocab]: the distribution of each prompt's next token
    mask: torch.Tensor  # [batch, cached length]: 1 where a real token sits, 0 for padding
    next_position: torch.Tensor  # [batch]: position id of each row's next token
    computed_tokens: int  # prompt tokens actually run through the model

    def select(self, index: torch.Tensor) -> None:
        """Keep (or repeat) rows by ``index``; gradients flow back to the shared rows."""
        self.cache.batch_select_indices(index)
        self.last_logits = self.last_logits[index]
        self.mask = self.mask[index]
        self.next_position = self.next_position[index]


def prefill(model: Any, prompts: list[list[int]], pad_id: int, min_shared: int = 16) -> Prefill:
    """Read ``prompts`` into a KV cache, computing their common prefix only once.

    Prompts of one environment share a long prefix (system prompt, worked examples): it is run once
    for the whole batch and its cache copied to every row, then each row's remainder is read with
    padding between prefix and remainder (masked out; position ids stay contiguous).
    Differentiable: under autograd, gradients of every row flow back into the shared prefix.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache_kw = _cache_keyword(model)
    cache = DynamicCache()
    shared = common_prefix_length(prompts) if len(prompts) > 1 else 0
    shared = min(shared, min(len(p) for p in prompts) - 1)  # every row keeps >= 1 token to read
    computed = 0
    if shared >= min_shared:
        head = torch.tensor([prompts[0][:shared]], dtype=torch.long, device=device)
        model(input_ids=head, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        cache.batch_repeat_interleave(len(prompts))
        computed += shared
    else:
        shared = 0
    ids, rest_mask = _left_pad([p[shared:] for p in prompts], pad_id)
    ids, rest_mask = ids.to(device), rest_mask.to(device)
    mask = torch.cat([torch.ones((len(prompts), shared), dtype=torch.long, device=device), rest_mask], dim=-1)
    positions = shared + (rest_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                **{cache_kw: cache})
    computed += int(rest_mask.sum())
    return Prefill(cache=cache, last_logits=out.logits[:, -1, :], mask=mask,
                   next_position=mask.sum(-1), computed_tokens=computed)


_closers: dict[tuple[int, tuple[str, ...]], frozenset[int]] = {}


def _closing_tokens(tokenizer: Any, stop_strings: tuple[str, ...]) -> frozenset[int]:
    """Token ids whose text contains a stop string's last character: only they trigger the decoding check."""
    if not stop_strings:
        return frozenset()
    key = (id(tokenizer), stop_strings)
    if key not in _closers:
        last = {s[-1] for s in stop_strings}
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        _closers[key] = frozenset(i for i, piece in enumerate(pieces)
                                  if piece and any(c in tokenizer.convert_tokens_to_string([piece]) for c in last))
    return _closers[key]


@torch.no_grad()
def sample(model: Any, tokenizer: Any, prompts: list[list[int]], n: int, *, max_new_tokens: int,
           temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False, batch_size: int = 64,
           seed: int = 0, progress: Any = None, stop_strings: tuple[str, ...] = (),
           seeds: list[int] | None = None) -> tuple[list[list[Sample]], SamplingStats]:
    """Sample ``n`` completions for every prompt (token ids), with each token's log-probability.

    Prompts are read once (their common prefix once for the whole batch, each prompt once for its
    group of ``n``) and the KV cache is copied; finished sequences leave the batch so the rest decode
    faster. Log-probs are taken in float32 from ``logits / temperature`` after the top-p cut: the
    distribution each token was actually drawn from, which importance weights are computed against. A
    row also stops when its text ends with one of ``stop_strings`` (the closing tag of a tool call: the
    tool must answer, not the policy); such rows finish with reason ``"stop_string"`` and keep the stop
    string in their text.

    With ``seeds`` (one per prompt) each prompt's ``n`` samples draw from a generator of their own, so
    a group's completions do not depend on which other groups share its batch or in what order: what
    lets rollouts be split over workers and still equal those of one process. Otherwise one generator
    seeded by ``seed`` serves the whole call.
    """
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"sample: {len(seeds)} seeds for {len(prompts)} prompts (one per prompt)")
    closers = _closing_tokens(tokenizer, stop_strings)
    configured = getattr(model.generation_config, "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    eos = torch.tensor(sorted({tokenizer.eos_token_id, *configured} - {None}))
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    stats = SamplingStats()
    results: list[list[Sample]] = [[] for _ in prompts]
    per_chunk = max(1, batch_size // n)
    cache_kw = _cache_keyword(model)
    for start in range(0, len(prompts), per_chunk):
        chunk = prompts[start:start + per_chunk]
        generators = None if seeds is None else [
            torch.Generator(device=device).manual_seed(s) for s in seeds[start:start + per_chunk]]
        began = time.perf_counter()
        state = prefill(model, chunk, tokenizer.pad_token_id)
        stats.prompt_tokens += state.computed_tokens
        stats.cached_prompt_tokens += sum(len(p) for p in chunk) * n - state.computed_tokens
        if n > 1:
            state.select(torch.arange(len(chunk), device=device).repeat_interleave(n))
        cache, mask, positions = state.cache, state.mask, state.next_position
        logits = state.last_logits.float()
        batch = logits.shape[0]
        active = torch.arange(batch)  # which original rows are still decoding
        tokens: list[list[int]] = [[] for _ in range(batch)]
        logps: list[list[float]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        for _step in range(max_new_tokens):
            scaled = logits if greedy else logits / temperature
            # log-probs of the distribution actually sampled from (after top-p): what importance weights need
            filtered = _top_p_filter(scaled, top_p) if top_p < 1.0 and not greedy else scaled
            logp_all = torch.log_softmax(filtered, dim=-1)
            if greedy:
                chosen = scaled.argmax(-1)
            else:
                probs = torch.softmax(filtered, -1)
                if generators is None:
                    chosen = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                else:
                    chosen = _draw_per_group(probs, active // n, generators)
            chosen_logp = logp_all.gather(-1, chosen[:, None]).squeeze(-1)
            done = torch.isin(chosen.cpu(), eos)
            for row, (token, lp, stop) in enumerate(zip(chosen.tolist(), chosen_logp.tolist(), done.tolist(),
                                                        strict=True)):
                original = int(active[row])
                tokens[original].append(token)
                logps[original].append(lp)
                if stop:
                    finish[original] = "stop"
                elif token in closers:
                    tail = tokenizer.decode(tokens[original][-16:], skip_special_tokens=True).rstrip()
                    if tail.endswith(stop_strings):
                        finish[original] = "stop_string"
                        done[row] = True
            keep = ~done
            if not bool(keep.any()):
                break
            if not bool(keep.all()):
                index = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(index.to(device))
                active, chosen, mask, positions = active[index], chosen[index], mask[index], positions[index]
            mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype, device=device)], dim=-1)
            out = model(input_ids=chosen[:, None].to(device), attention_mask=mask,
                        position_ids=positions[:, None].to(device), use_cache=True, **{cache_kw: cache})
            positions = positions + 1
            logits = out.logits[:, -1, :].float()
        stats.forward_seconds += time.perf_counter() - began
        for row in range(batch):
            completion = tokens[row]
            stats.completion_tokens += len(completion)
            text_ids = completion[:-1] if finish[row] == "stop" else completion
            results[start + row // n].append(Sample(
                completion_ids=completion, logprobs=logps[row], finish_reason=finish[row],
                text=tokenizer.decode(text_ids, skip_special_tokens=True),
            ))
        if progress is not None:
            progress.update(len(chunk) * n)
    return results, stats


def _draw_per_group(probs: torch.Tensor, owners: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, each row drawn from the generator of the group that owns it (``owners[row]``)."""
    chosen = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for group in torch.unique(owners).tolist():
        rows = (owners == group).nonzero().squeeze(-1).to(probs.device)
        chosen[rows] = torch.multinomial(probs[rows], 1, generator=generators[group]).squeeze(-1)
    return chosen


def grouped_logprobs(model: Any, prompts: list[list[int]], completions: list[list[list[int]]], *,
                     temperature: float | torch.Tensor = 1.0, pad_id: int = 0, top_p: float | torch.Tensor = 1.0,
                     chunk: int | None = None, shared_prefix: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of every completion of every group: a [completions, T] tensor and its mask.

    ``prompts[g]`` is group g's prompt and ``completions[g]`` its completions. Each prompt is run once
    (their common prefix once for all), its cache repeated for the group's completions, so the
    update costs about what the completions cost, not G copies of the prompt. Rows are the
    completions in order, right-padded to T.

    ``temperature`` is one number or one per completion (rollouts replayed with the settings they were
    sampled with); so is ``top_p``: below 1 it gives log-probs of the truncated distribution (tokens outside
    it: -inf).
    With ``chunk``, log-probs are computed from the decoder's hidden states ``chunk`` positions at a
    time (recomputed in the backward pass), so no [rows, T, vocabulary] float32 tensor exists for the
    whole batch: what keeps a 150k-token vocabulary with long completions in memory. ``shared_prefix =
    False`` runs every completion with its whole prompt and no KV cache (what gradient checkpointing
    needs: a recomputed layer would write to a shared cache twice).
    """
    device = next(model.parameters()).device
    flat = [c for group in completions for c in group]
    ids, completion_mask = _right_pad(flat, pad_id)
    ids, completion_mask = ids.to(device), completion_mask.to(device)
    counts = [len(c) for c in completions]
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(device=device, dtype=torch.float32)
    if isinstance(top_p, torch.Tensor):
        top_p = top_p.to(device=device, dtype=torch.float32)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(inner, "config", None)
    # logit soft-capping or scaling (Gemma, Cohere) lives in the causal-LM head's forward: keep the full path
    chunkable = chunk is not None and not any(getattr(config, k, None) for k in ("final_logit_softcapping",
                                                                                   "logit_scale"))
    if not shared_prefix:
        return _unshared_logprobs(model, inner, prompts, counts, ids, completion_mask, temperature, top_p,
                                  chunk if chunkable else None, pad_id)
    state = prefill(model, prompts, pad_id)
    state.select(torch.arange(len(prompts), device=device).repeat_interleave(torch.tensor(counts, device=device)))
    width = ids.shape[1]
    mask = torch.cat([state.mask, completion_mask], dim=-1)
    positions = state.next_position[:, None] + torch.arange(width, device=device)[None, :]
    first = _logprobs_of(state.last_logits[:, None, :], ids[:, :1], temperature, top_p)
    if chunkable:
        body = inner.get_decoder()
        hidden = body(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                      use_cache=True, **{_cache_keyword(body): state.cache}).last_hidden_state
        rest = _chunked_logprobs(inner.get_output_embeddings(), hidden, ids[:, 1:], temperature, top_p, chunk)
        return torch.cat([first, rest], dim=1), completion_mask.bool()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{_cache_keyword(model): state.cache})
    rest = _logprobs_of(out.logits[:, :-1, :], ids[:, 1:], temperature, top_p)
    return torch.cat([first, rest], dim=1), completion_mask.bool()


def _logprobs_of(logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor,
                 top_p: float | torch.Tensor) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), top-p truncated; float32 whatever the model's dtype."""
    if isinstance(temperature, torch.Tensor):  # one per row
        temperature = temperature.view(-1, *([1] * (logits.dim() - 1)))
    scaled = logits.float() / temperature
    if isinstance(top_p, torch.Tensor):  # one per row (rollouts replayed with the nucleus they were sampled with)
        if bool((top_p < 1.0).any()):
            # a row with top_p = 1 keeps every token, float rounding of the cumulative sum included
            cut = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, math.inf))
            scaled = _top_p_filter(scaled, cut.view(-1, *([1] * (logits.dim() - 1))))
    elif top_p < 1.0:
        scaled = _top_p_filter(scaled, top_p)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def _chunked_logprobs(head: Any, hidden: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor,
                      top_p: float | torch.Tensor, chunk: int) -> torch.Tensor:
    """``_logprobs_of(head(hidden))`` ``chunk`` positions at a time; under autograd each chunk's logits are
    recomputed in the backward pass instead of kept (activation checkpointing of the head and softmax)."""
    from torch.utils.checkpoint import checkpoint

    def piece(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return _logprobs_of(head(h), t, temperature, top_p)

    parts = []
    for start in range(0, hidden.shape[1], chunk):
        h, t = hidden[:, start:start + chunk], targets[:, start:start + chunk]
        parts.append(checkpoint(piece, h, t, use_reentrant=False) if torch.is_grad_enabled() else piece(h, t))
    if not parts:
        return hidden.new_zeros((hidden.shape[0], 0), dtype=torch.float32)
    return torch.cat(parts, dim=1)


def _unshared_logprobs(model: Any, inner: Any, prompts: list[list[int]], counts: list[int], ids: torch.Tensor,
                       completion_mask: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor,
                       chunk: int | None, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_logprobs without a shared KV cache: each row is its prompt and completion, right-padded."""
    device = ids.device
    owners = [g for g, count in enumerate(counts) for _ in range(count)]
    rows = [prompts[g] + [int(x) for x in ids[r, :int(completion_mask[r].sum())]] for r, g in enumerate(owners)]
    full, full_mask = _right_pad(rows, pad_id)
    full, full_mask = full.to(device), full_mask.to(device)
    # hidden state at position L-1+t predicts completion token t (L: the row's prompt length)
    starts = torch.tensor([len(prompts[g]) - 1 for g in owners], device=device)
    index = (starts[:, None] + torch.arange(ids.shape[1], device=device)[None, :]).clamp(max=full.shape[1] - 1)
    if chunk is not None:
        hidden = inner.get_decoder()(input_ids=full, attention_mask=full_mask, use_cache=False).last_hidden_state
        picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
        return _chunked_logprobs(inner.get_output_embeddings(), picked, ids, temperature, top_p, chunk), \
            completion_mask.bool()
    logits = model(input_ids=full, attention_mask=full_mask, use_cache=False).logits
    picked = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1]))
    return _logprobs_of(picked, ids, temperature, top_p), completion_mask.bool()


def _right_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids, mask


@functools.lru_cache(maxsize=1)
def cpu_supports_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX): only then is bf16 autocast faster."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def sampling_dtype(setting: str, device: str = "auto") -> str:
    """``model.rollout_dtype`` made concrete: 'auto' is bfloat16 where the hardware computes it natively (a CUDA
    device with bf16, a CPU with AVX-512 BF16 or AMX), else float32. Measured here: bfloat16 sampled 1.6x
    (rollout) to 1.9x (greedy) faster than float32 on an Intel Xeon with AMX, and 2.3x to 3x slower on an AMD
    EPYC without either (bfloat16 emulated)."""
    if setting != "auto":
        return setting
    where = resolve_device(device)
    native = torch.cuda.is_bf16_supported() if where.type == "cuda" else cpu_supports_bf16()
    return "bfloat16" if native else "float32"


def update_precision(setting: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the update's forward and backward (None: plain float32) for ``update.precision``."""
    if setting == "float32":
        return None
    supported = torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_supports_bf16()
    if setting == "bfloat16":
        if not supported:
            raise ModelError(f"update.precision = 'bfloat16', but {device} has no native bfloat16 "
                             "(a CUDA device with bf16, or a CPU with AVX-512 BF16 or AMX): use 'float32'")
        return torch.bfloat16
    # auto: bfloat16 on GPUs that have it; on CPUs float32, what the demo's learning rate was tuned under
    return torch.bfloat16 if device.type == "cuda" and supported else None


def autocast(dtype: torch.dtype | None, model: Any) -> Any:
    """An autocast context for ``model``'s device in ``dtype`` (a no-op for None). Weights, optimizer state,
    log-softmax and the loss stay float32; matrix products run in ``dtype``."""
    import contextlib

    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=next(model.parameters()).device.type, dtype=dtype)


def enable_gradient_checkpointing(model: Any) -> None:
    """Recompute each layer's activations in the backward pass (peft adapters need grad-enabled inputs)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    inner.config.use_cache = False


def set_threads(threads: int | None) -> None:
    """Use ``threads`` intra-op threads (default: every core this process may run on)."""
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template, ending with the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
