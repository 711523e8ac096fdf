"""Data-parallel update with accelerate: one process and two CPU processes (gloo) take the same steps.

Tolerance: losses within 1e-5 and every updated weight within 1e-5 (absolute): the two runs sum the
same gradients in a different order, which is all that differs.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import torch
from safetensors.torch import load_file

from evertrain.envs import registry
from evertrain.inference.local import sample
from evertrain.models.checkpoint import encode_chat, load_policy, write_base_checkpoint
from evertrain.models.data_parallel import write_spec
from tests.conftest import ROOT

TOLERANCE = 1e-5


def test_two_cpu_processes_train_like_one(tmp_path, models_dir):
    checkpoint = write_base_checkpoint(tmp_path / "base", str(models_dir / "tiny-llama"))
    model, tokenizer = load_policy(checkpoint)
    env = registry.get("arithmetic")
    prompts = [encode_chat(tokenizer, env.messages(p)) for p in env.problems("train", 4, 0)]
    sampled, _ = sample(model, tokenizer, prompts, 4, max_new_tokens=8, temperature=1.0, seed=0)
    rng = random.Random(0)
    groups = [{"prompt": prompt, "members": [
        {"ids": s.completion_ids, "logprobs": s.logprobs, "advantage": rng.uniform(-1, 1),
         "loss_mask": [1] * len(s.completion_ids)} for s in group]}
        for prompt, group in zip(prompts, sampled, strict=True)]
    results = {}
    for processes in (1, 2):
        out = tmp_path / f"out{processes}"
        spec = write_spec(tmp_path / f"spec{processes}.json", checkpoint=str(checkpoint), groups=groups,
                          minibatches=[[0, 1, 2, 3], [1, 3]], out=str(out), learning_rate=1e-2, microbatch_size=4)
        launcher = [sys.executable, "-m"] if processes == 1 else [
            # accelerate's --cpu runs a single process unless MPI is configured; --multi_gpu starts the processes
            # (torch's elastic launcher) and the Accelerator, made with cpu=True, joins them over gloo
            str(ROOT / ".venv" / "bin" / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
        done = subprocess.run([*launcher, "evertrain.models.data_parallel", str(spec)], cwd=ROOT, capture_output=True,
                              text=True, timeout=900, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads((out / "losses.json").read_text())
        assert report["processes"] == processes
        results[processes] = (report["losses"], load_file(out / "adapter_model.safetensors"))
    (losses1, weights1), (losses2, weights2) = results[1], results[2]
    assert len(losses1) == 2 and all(abs(a - b) < TOLERANCE for a, b in zip(losses1, losses2, strict=True))
    assert weights1.keys() == weights2.keys()
    assert any(float(w.abs().max()) > 0 for k, w in weights1.items() if "lora_B" in k)  # the steps moved the weights
    worst = max(float((weights1[k] - weights2[k]).abs().max()) for k in weights1)
    assert worst < TOLERANCE, worst
    assert torch.isfinite(torch.tensor(losses1)).all()
