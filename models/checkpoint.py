"""Checkpoints: where a policy's weights come from, how a checkpoint folder looks on disk, and its tokenizer.

A checkpoint is a folder with an ``evertrain_checkpoint.json`` manifest naming its kind:
``base`` (just a reference to the base model), ``lora`` (a peft adapter of a few MB on top of the base)
or ``full`` (all weights). Every MLflow model version is such a folder, so ``models:/<name>@champion``
always loads again. The learner writes checkpoints and inference reads them: both import this module (and
:mod:`evertrain.models.precision`), neither imports the other.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from evertrain.config import LoraConfig, ModelConfig
from evertrain.models import ModelError
from evertrain.models.convert import convert_smollm2
from evertrain.models.forward import use_grouped_decoding
from evertrain.models.precision import resolve_device
from evertrain.models.tiny import build_tiny_model
from evertrain.portable import portable

MANIFEST = "evertrain_checkpoint.json"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
TINY_DIR = "tiny-llama"


def resolve_base(model: ModelConfig) -> str:
    """A loadable base-model path for ``model.path``, converting or building embedded models once."""
    if model.path == "embedded:smollm2-135m-instruct":
        return str(convert_smollm2(Path(model.models_dir) / SMOLLM2_DIR).resolve())
    if model.path == "embedded:tiny":
        return str(build_tiny_model(Path(model.models_dir) / TINY_DIR).resolve())
    path = Path(model.path).expanduser()
    return str(path.resolve()) if path.exists() else model.path


# the Hugging Face Hub id of each embedded base model (a model card's `base_model` must be one)
EMBEDDED_HUB_IDS = {"embedded:smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def hub_id(path: str) -> str | None:
    """The Hub id of the base model that ``model.path`` names, or None (a built model, a local folder that
    does not say which Hub model it holds)."""
    if path in EMBEDDED_HUB_IDS or path.startswith("embedded:"):
        return EMBEDDED_HUB_IDS.get(path)
    folder = Path(path).expanduser()
    if folder.exists():
        try:
            named = json.loads((folder / "config.json").read_text()).get("_name_or_path", "")
        except (OSError, ValueError, AttributeError):
            return None
        return named if isinstance(named, str) and _looks_like_hub_id(named) and not Path(named).exists() else None
    return path if _looks_like_hub_id(path) else None


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") and all(c.isalnum() or c in "-_." for c in p)
                                   for p in parts)


def read_manifest(checkpoint: str | Path) -> dict[str, Any]:
    path = Path(checkpoint) / MANIFEST
    if not path.exists():
        raise ModelError(f"{checkpoint} is not an evertrain checkpoint (no {MANIFEST})")
    return json.loads(path.read_text())


def write_base_checkpoint(dest: Path, base_model: str) -> Path:
    """A checkpoint that only points at the base model: version 1 of every campaign."""
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
    try:
        tokenizer = AutoTokenizer.from_pretrained(base_model)
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot load a tokenizer from {base_model!r}: {error}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_base(base_model: str, dtype: torch.dtype) -> Any:
    try:
        return AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype)
    except (OSError, ValueError) as error:
        raise ModelError(f"cannot load model weights from {base_model!r}: {error}") from None


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
        model = PeftModel.from_pretrained(model, str(checkpoint), is_trainable=trainable)
        if not trainable:
            model = model.merge_and_unload()
    elif kind == "base" and trainable and finetune == "lora":
        lora = lora or LoraConfig()
        model = get_peft_model(model, PeftLoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=lora.target_modules, task_type="CAUSAL_LM",
        ))
    elif kind not in ("base", "full", "lora"):
        raise ModelError(f"{checkpoint}: unknown checkpoint kind {kind!r}")
    model.config.use_cache = not trainable
    model.train(trainable)
    use_grouped_decoding(model)  # decoding steps attend grouped key/value heads in place: the same numbers, faster
    return model.to(resolve_device(device)), tokenizer


def save_checkpoint(model: Any, dest: Path, base_model: str, **manifest: Any) -> Path:
    """Save ``model`` (peft adapter or full weights) as a checkpoint folder at ``dest``."""
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    kind = "lora" if isinstance(model, PeftModel) else "full"
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / MANIFEST).write_text(json.dumps({"kind": kind, "base_model": portable(base_model), **manifest},
                                           indent=2))
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template, ending with the assistant's turn: opened for the
    model, or, when the last message is the assistant's (a partial answer written for it: the frontier's guidance),
    continuing that message."""
    if messages and messages[-1].get("role") == "assistant":
        text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
