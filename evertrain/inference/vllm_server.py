"""The champion on vLLM's own OpenAI-compatible server (``generation.backend = "vllm"``).

vLLM cannot live in the project's interpreter (it pins other fastapi and torch versions), so the endpoint
starts ``python -m vllm.entrypoints.openai.api_server`` under ``generation.vllm_python`` on a free local
port, and stays the public face: the client talks to the evertrain endpoint, which validates, turns
messages into the project's chat format, and sends the prompt's token ids to vLLM's ``/v1/completions``;
the traces, redaction, tool-call parsing, version naming and hot swap are the endpoint's, unchanged.
Token ids rather than vLLM's own ``/v1/chat/completions``: the prompt is then exactly the one the model
was trained on (vLLM's chat template and tool parsers are not the project's format).

Versions
    One server runs the base model with runtime LoRA updating on (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a
    LoRA version is loaded with ``POST /v1/load_lora_adapter`` under the name ``<campaign>@v<N>``, so vLLM's
    own reply names the version, and requests name it as their ``model``; a ``base`` version is the base
    model itself (served as ``<campaign>@base``). A ``full`` version (fully fine-tuned weights) gets a
    server of its own, started from its folder before the swap and stopped once it is no longer kept
    loaded. An evicted LoRA version is unloaded after a grace period, so requests that started on it end on it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from evertrain import processes
from evertrain.config import CampaignConfig
from evertrain.inference.base import VLLM_CAPABILITIES, Sample, SamplingStats
from evertrain.inference.vllm_sampler import engine_options, vllm_python
from evertrain.models.checkpoint import load_tokenizer, read_manifest
from evertrain.processes import free_port

log = logging.getLogger("evertrain.serving")

UNLOAD_GRACE_SECONDS = 120.0  # an evicted version stays loaded this long: requests that began on it finish on it


class VLLMServerError(RuntimeError):
    """vLLM's server could not start, or refused a request; the message says which and why."""


class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` process serving ``model`` (a base model or full weights)."""

    def __init__(self, config: CampaignConfig, model: str, served_name: str, *, lora: bool,
                 tokenizer: str | None = None, start_timeout: float = 900.0) -> None:
        python = vllm_python(config)
        if not Path(python).exists():
            raise VLLMServerError(
                f"generation.vllm_python = {config.generation.vllm_python!r} does not exist: build it with `make vllm` "
                "or point the setting at any Python that has vllm installed")
        options = engine_options(config, model)
        self.model, self.served_name = model, served_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", options["dtype"], "--max-model-len", str(options["max_model_len"]),
                "--seed", str(options["seed"]), "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        if tokenizer is not None:  # a full checkpoint holds weights only: the tokenizer is the base model's
            args += ["--tokenizer", tokenizer]
        if options.get("enforce_eager"):
            args.append("--enforce-eager")
        if lora and options.get("enable_lora"):
            args += ["--enable-lora", "--max-lora-rank", str(options["max_lora_rank"]), "--max-loras", "2"]
        if options.get("block_size"):
            args += ["--block-size", str(options["block_size"])]
        if options.get("kv_cache_memory_bytes"):
            args += ["--kv-cache-memory-bytes", str(options["kv_cache_memory_bytes"])]
        if options.get("gpu_memory_utilization"):
            args += ["--gpu-memory-utilization", str(options["gpu_memory_utilization"])]
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        self._workdir = tempfile.mkdtemp(prefix="evertrain-vllm-server-")
        self.log_path = os.path.join(self._workdir, "server.log")
        began = time.perf_counter()
        with open(self.log_path, "wb") as out:  # vLLM logs a lot: to a file, named in any error
            self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(600.0, connect=10.0))
        while True:
            if self.process.poll() is not None:
                raise VLLMServerError(f"vLLM's server exited (status {self.process.returncode}) while starting: see "
                                      f"{self.log_path}:\n{self.log_tail()}")
            if time.perf_counter() - began > start_timeout:
                self.close()
                raise VLLMServerError(f"vLLM's server did not answer within {start_timeout:.0f} s: see "
                                      f"{self.log_path}:\n{self.log_tail()}")
            try:
                if self.http.get("/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - began
        log.info("endpoint: vLLM's server for %s answers at %s (started in %.0f s)", model, self.url, self.startup_s)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        if self.process.poll() is not None:
            raise VLLMServerError(f"vLLM's server has exited (status {self.process.returncode}): see {self.log_path}")
        return self.http.post(path, json=body)

    def load_lora(self, name: str, path: str) -> float:
        """Load the adapter in ``path`` under ``name`` (vLLM's runtime LoRA API); the seconds it took."""
        began = time.perf_counter()
        reply = self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if reply.status_code != 200:
            raise VLLMServerError(f"vLLM refused the LoRA adapter {path} as {name!r}: {reply.status_code} {reply.text}")
        return time.perf_counter() - began

    def unload_lora(self, name: str) -> None:
        try:
            self.post("/v1/unload_lora_adapter", {"lora_name": name})
        except (httpx.HTTPError, VLLMServerError) as error:
            log.warning("endpoint: unloading %s from vLLM failed: %s", name, error)

    def models(self) -> list[str]:
        return [m["id"] for m in self.http.get("/v1/models").json()["data"]]

    def close(self) -> None:
        self.http.close()
        processes.stop([self.process], timeout=30)  # the server and its engine core, one session


class VLLMServerSampler:
    """A :class:`~evertrain.inference.base.Sampler` over one model name of a :class:`VLLMServer`: vLLM's
    ``/v1/completions`` with token-id prompts, so the endpoint's generation code is the same for both paths."""

    backend = "vllm-server"

    def __init__(self, server: VLLMServer, model: str, tokenizer: Any, stop_token_ids: list[int]) -> None:
        self.server, self.model, self.tokenizer, self.stop_token_ids = server, model, tokenizer, stop_token_ids
        self.capabilities = VLLM_CAPABILITIES
        self.last_reply_model: str | None = None

    def sample(self, prompts: list[list[int]], n: int, *, max_new_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0, greedy: bool = False, batch_size: int = 64, seed: int = 0,
               seeds: list[int] | None = None, stop_strings: tuple[str, ...] = (),
               progress: Any = None) -> tuple[list[list[Any]], Any]:
        # no seed: per-request seeds fail on vLLM's CPU build ("CPU Generator does not use offset")
        stats = SamplingStats()
        groups: list[list[Sample]] = []
        for prompt in prompts:
            began = time.perf_counter()
            reply = self.server.post("/v1/completions", {
                "model": self.model, "prompt": prompt, "n": n, "max_tokens": max_new_tokens,
                "temperature": 0.0 if greedy else temperature, "top_p": 1.0 if greedy else top_p,
                "stop": list(stop_strings), "stop_token_ids": self.stop_token_ids, "include_stop_str_in_output": True,
                "skip_special_tokens": True, "return_token_ids": True})
            stats.forward_seconds += time.perf_counter() - began
            if reply.status_code != 200:
                raise VLLMServerError(f"vLLM's server answered {reply.status_code}: {reply.text[:2000]}")
            body = reply.json()
            self.last_reply_model = body.get("model")
            stats.served_by = body.get("model")  # vLLM's own name for what answered: the version's
            usage = body.get("usage") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            stats.cached_prompt_tokens += cached
            stats.prompt_tokens += int(usage.get("prompt_tokens") or len(prompt)) - cached
            group = []
            for choice in sorted(body["choices"], key=lambda c: c["index"]):
                ids = list(choice.get("token_ids") or [])
                if choice.get("finish_reason") == "length":
                    reason = "length"
                elif isinstance(choice.get("stop_reason"), str):
                    reason = "stop_string"
                else:
                    reason = "stop"
                text_ids = ids[:-1] if reason == "stop" and ids and ids[-1] in self.stop_token_ids else ids
                text = self.tokenizer.decode(text_ids, skip_special_tokens=True) if ids else choice.get("text", "")
                group.append(Sample(completion_ids=ids, logprobs=[], finish_reason=reason, text=text))
                stats.completion_tokens += len(ids)
            groups.append(group)
        return groups, stats


class VLLMServers:
    """The champion's vLLM servers: one for the base model and its LoRA versions, one per full version."""

    def __init__(self, config: CampaignConfig, base_model: str) -> None:
        self.config, self.base_model = config, base_model
        self.base: VLLMServer | None = None
        self.full: dict[int, VLLMServer] = {}
        self.loras: dict[int, str] = {}
        self.kept: set[int] = set()  # versions the champion keeps loaded (a release spares one kept again)
        self._lock = threading.Lock()
        self._tokenizers: dict[str, Any] = {base_model: load_tokenizer(base_model)}
        # the servers run in sessions of their own (so their engine processes stop with them): an interpreter
        # that exits without stopping the endpoint (an uncaught error) still stops them
        atexit.register(self.close)

    def _stop_ids(self, model: str, tokenizer: Any) -> list[int]:
        generation = Path(model) / "generation_config.json"
        configured = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
        configured = configured if isinstance(configured, list) else [configured]
        return sorted({tokenizer.eos_token_id, *configured} - {None})

    def _base(self) -> VLLMServer:
        if self.base is None:
            self.base = VLLMServer(self.config, self.base_model, f"{self.config.name}@base",
                                   lora=self.config.update.finetune == "lora")
        return self.base

    def open(self, version: int, checkpoint: str | Path) -> tuple[VLLMServerSampler, float]:
        """A sampler serving ``version`` (its weights loaded into vLLM now) and the seconds it took."""
        folder = str(Path(checkpoint).resolve())
        kind = read_manifest(folder)["kind"]
        began = time.perf_counter()
        with self._lock:
            self.kept.add(version)
            if kind == "full":
                if version not in self.full:
                    self.full[version] = VLLMServer(self.config, folder, f"{self.config.name}@v{version}", lora=False,
                                                    tokenizer=self.base_model)
                server, name = self.full[version], f"{self.config.name}@v{version}"
                tokenizer, model = self._tokenizers[self.base_model], folder
            else:
                server, tokenizer, model = self._base(), self._tokenizers[self.base_model], self.base_model
                if kind == "lora":
                    name = f"{self.config.name}@v{version}"
                    if version not in self.loras:
                        server.load_lora(name, folder)
                        self.loras[version] = name
                else:
                    name = server.served_name
        return VLLMServerSampler(server, name, tokenizer, self._stop_ids(model, tokenizer)), \
            time.perf_counter() - began

    def release(self, version: int) -> None:
        """``version`` is no longer kept loaded: its adapter or server goes after a grace period."""
        with self._lock:
            self.kept.discard(version)

        def later() -> None:
            with self._lock:
                if version in self.kept:  # loaded again meanwhile (a rollback): it stays
                    return
                name = self.loras.pop(version, None)
                server = self.full.pop(version, None)
            if name is not None and self.base is not None:
                self.base.unload_lora(name)
            if server is not None:
                server.close()

        timer = threading.Timer(UNLOAD_GRACE_SECONDS, later)
        timer.daemon = True
        timer.start()

    def close(self) -> None:
        with self._lock:
            servers = [s for s in (self.base, *self.full.values()) if s is not None]
            self.base, self.full, self.loras = None, {}, {}
        for server in servers:
            server.close()
