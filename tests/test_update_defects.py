"""Issue 24's learning-code defects: each test here failed on the code before its fix.

1. The update recomputes log-probs under the nucleus (top-p) each rollout was sampled with.
2. The KL reference's log-probs take the policy's chunked, autocast path (no full logits tensor).
5. AdamW moments are not restored onto an adapter another stage (sft) changed since they were saved.
"""

from __future__ import annotations

import math

import torch

from evertrain.config import UpdateConfig
from evertrain.models.checkpoint import load_policy, write_base_checkpoint
from evertrain.runtime import Runtime
from evertrain.tasks import STAGE_FUNCTIONS, run_stage
from evertrain.tasks.sft import sft as sft_stage
from evertrain.tasks.update import Group, Member, _train_here
from tests.conftest import smoke_config_in


def test_top_p_rollouts_are_recomputed_under_the_nucleus_they_were_sampled_from(tmp_path, models_dir):
    """float32 sampler and float32 trainer, top_p = 0.6: the trainer's log-probs before the step are the
    sampler's, so the mismatch is nil and no importance weight differs from 1."""
    config = smoke_config_in(tmp_path, models_dir, environments=[{"name": "digits", "weight": 1}],
                             generation={"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.6},
                             update={"minibatch_size": 8, "microbatch_size": 8, "skip_zero_variance": False})
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    assert set(rt.store.query("SELECT DISTINCT top_p FROM rollouts")["top_p"]) == {0.6}
    metrics = run_stage(rt, "update", 0, STAGE_FUNCTIONS["update"])
    assert metrics["mismatch_tokens"] > 0
    assert metrics["mismatch_kl"] < 1e-6, metrics["mismatch_kl"]
    assert metrics["is_weight_max"] < 1.001 and metrics["is_clipped_share"] == 0.0


def test_kl_reference_logprobs_are_chunked_like_the_policys(tmp_path, models_dir):
    """With ``logprob_chunk`` the reference's output head never sees more than a chunk of positions (the
    full [rows, T, vocabulary] logits are not materialised), in the policy's autocast dtype."""
    base = write_base_checkpoint(tmp_path / "base", str(models_dir / "tiny-llama"))
    torch.manual_seed(0)
    model, tokenizer = load_policy(base, trainable=True, device="cpu")
    reference, _ = load_policy(base, trainable=False, device="cpu")
    chunk = 3
    seen: dict[str, list[tuple[int, torch.dtype]]] = {"policy": [], "reference": []}
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, net in (("policy", inner), ("reference", reference)):
        net.get_output_embeddings().register_forward_hook(
            lambda _m, _i, out, name=name: seen[name].append((out.shape[1] if out.dim() == 3 else 1, out.dtype)))
    completions = [[20 + i + j for j in range(10 + i)] for i in range(4)]
    group = Group([5, 6, 7, 8, 9], [Member(c, [-1.0] * len(c), a, [1] * len(c))
                                    for c, a in zip(completions, (1.0, -1.0, 0.5, -0.5), strict=True)])
    cfg = UpdateConfig(kl_coef=0.1, logprob_chunk=chunk, minibatch_size=4, microbatch_size=4)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    steps, losses, *_rest, stats, _seconds = _train_here(
        model, optimizer, params, [[group]], reference, iteration=0, longest=16, autocast_dtype=None,
        pad=tokenizer.pad_token_id, logprob_options={"chunk": chunk, "shared_prefix": True}, cfg=cfg)
    assert steps == 1 and math.isfinite(losses[0]) and stats["kl_ref"] >= 0
    assert seen["reference"], "the reference was not run"
    widest = max(width for width, _ in seen["reference"])
    assert widest <= chunk, f"the reference's head ran on {widest} positions at once (chunk {chunk})"
    assert {d for _, d in seen["reference"]} == {d for _, d in seen["policy"]}


def test_optimizer_moments_are_not_restored_onto_an_adapter_sft_changed(tmp_path, models_dir):
    """Iteration 0 trains v2 and saves its AdamW moments; at iteration 1 the sft stage trains v2's adapter
    further, so the moments saved with v2 belong to other weights: the update must start AdamW afresh."""
    config = smoke_config_in(tmp_path, models_dir, environments=[{"name": "digits", "weight": 1}],
                             problems_per_iteration=4, group_size=4,
                             sft={"enabled": True, "max_examples": 4, "learning_rate": 5e-3, "batch_size": 2,
                                  "select": "SELECT iteration, problem_id, sample FROM rollouts WHERE "
                                            "campaign = $campaign AND iteration = $iteration"})
    rt = Runtime.open(config)
    for stage in ("curate", "rollout", "score", "update"):
        run_stage(rt, stage, 0, STAGE_FUNCTIONS[stage])
    trained = rt.trainee_version()
    assert (rt.checkpoint(trained) / "optimizer.pt").exists()
    for stage in ("curate", "rollout", "score"):
        run_stage(rt, stage, 1, STAGE_FUNCTIONS[stage])
    sft = run_stage(rt, "sft", 1, sft_stage)
    assert sft["steps"] >= 1 and sft["start_version"] == trained
    metrics = run_stage(rt, "update", 1, STAGE_FUNCTIONS["update"])
    assert metrics["optimizer_restored"] == 0.0
    tag = rt.tracker.client.get_run(rt.tracker.run_id(1)).data.tags["update.optimizer_state"]
    assert tag.startswith("fresh:") and "changed" in tag, tag
