"""evertrain's campaign against TRL's GRPOTrainer: sealed held-out points gained per CPU-hour, all in, 3 seeds.

Both systems post-train the same base model (SmolLM2-135M-Instruct) with a LoRA adapter (r=16, alpha=32,
all linear layers) on the same environment (evertrain's ``arithmetic`` as the demo configures it: varied
phrasings, 0-2 worked examples, the strict ``#### <answer>`` reward), with the same G (8), temperature (0.8),
completion limit (24 tokens) and learning rate (``--learning-rate``, default 2e-4 for both):

- evertrain: the real campaign flow (``campaign_flow``) on configs/default.toml reduced to the arithmetic
  environment, for ``--iterations`` iterations (default 6, the demo's): its warm start (context distillation
  in the sft stage), GRPO updates and its promotion gate. Its CPU is counted **all in**: every stage of every
  iteration (curate, rollout, score, sft, update, evaluate, promote) plus the flow's orchestration. The
  campaign's own sealed measurement is off: this script measures both systems' sealed splits itself.
- TRL: ``GRPOTrainer`` on its own (32 completions a step, beta 0), on the environment's train problems in the
  same chat messages, with a reward function that calls the same verifier, until it has spent the CPU that
  evertrain spent for the same seed (the budget is matched seed by seed; ``--iterations 0`` gives both a
  fixed ``--cpu-minutes`` instead). Its CPU is the process CPU from the first step to the last, less the
  adapter snapshots this benchmark takes.
- TRL given the same warm start (``trl_warm``): the base model's own completions to evertrain's warm-start
  share of train problems (``sft.first_iterations`` x ``problems_per_iteration``, G each, asked with their
  worked examples), verified by the same grader; TRL's ``SFTTrainer`` on the passed ones after the question
  WITHOUT its worked examples (evertrain's context distillation, its sft learning rate, epochs and batch),
  then ``GRPOTrainer`` as above on that adapter. Sampling, grading and SFT are counted in its budget. With it,
  a lead over TRL is the loop's, not only the warm start's recipe: the bar is against the stronger baseline.

One-time set-up (loading the model, starting Prefect and MLflow) is outside both. Each system trains in its
own subprocess (a crash in one keeps the other's results). Afterwards the script evaluates, with the same
code for both, what each system delivers (evertrain: its champion, with the last challenger shown beside
it; TRL: its final adapter) on the environment's sealed test split and sealed transfer split (phrasings and
the operator ``*`` never trained on, no worked examples): greedy pass@1 on the same problems for every seed,
never seen by evertrain's curation or gate nor in TRL's training set. Per seed: the gain over the base model
with a 95% bootstrap interval over problems; per system: the mean gain over seeds with an interval from a
bootstrap over seeds and problems, and held-out points per CPU-hour (100 x mean gain / mean CPU-hours all
in). The bar: evertrain's points per CPU-hour at least 2x the stronger TRL baseline's.

Two schedules: ``--schedule short`` (the default) is the demo's first gated cycle, two iterations (both with
the warm start) and one gate at the end (``eval.every=2``), about 6.5 CPU-minutes a seed on a 2-core AMD
EPYC; ``--schedule demo`` is the demo's six iterations, gated at iterations 2 and 5. ``--budget CPU_MIN``
instead fixes every system's CPU budget before the runs (evertrain runs whole iterations until it is spent),
``--config`` gives evertrain another campaign config (its arithmetic environment), e.g. the long campaign's:

    .venv/bin/python benchmarks/vs_trl.py --budget 64 --config configs/long.toml --seeds 0,1,2 \
        --set eval.every=2 --results-name vs_trl_long  # 4x the demo's CPU, three systems, three seeds

(``--resume`` continues it; ``--set eval.every=2`` is what its first runs were made with, before a ``--budget`` run
kept its config's gate cadence, every 3rd update for the long campaign's: without it the runs are not comparable.)

    .venv/bin/python benchmarks/vs_trl.py                       # seeds 0,1,2, short schedule; about 35 min here
    .venv/bin/python benchmarks/vs_trl.py --schedule demo --results-name vs_trl_demo_schedule  # 6 iterations
    .venv/bin/python benchmarks/vs_trl.py --seeds 0 --curve     # one seed, every checkpoint evaluated
    .venv/bin/python benchmarks/vs_trl.py --quick --model tiny  # plumbing only: a tiny model, minutes
    .venv/bin/python benchmarks/vs_trl.py --set update.epochs=1 --results-name vs_trl_epochs1  # a variant, filed apart
    .venv/bin/python benchmarks/vs_trl.py --pool vs_trl_a,vs_trl_b --results-name vs_trl_ab  # pool other seeds' runs

Writes benchmarks/results/vs_trl.json and benchmarks/results/vs_trl.png (``--results-name``: another name).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine_cpu  # noqa: E402
from evertrain.stats import mean_interval  # noqa: E402  (the checkout's evertrain, found through ROOT)

SYSTEMS = ("evertrain", "trl", "trl_warm")
BASELINES = ("trl", "trl_warm")
TRAINING_STAGES = ("curate", "rollout", "score", "sft", "update")
EVAL_STAGES = ("evaluate", "promote")
RESULTS_NAME = "vs_trl"
BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 20261130
# DESIGN.md's TRL reference settings (the learning rate is shared by both systems: --learning-rate)
TRL_COMPLETIONS_PER_STEP = 32


def log(message: str) -> None:
    print(f"[vs_trl {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_seconds() -> float:
    """CPU seconds of this process (every thread) and of its finished children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def machine_busy_seconds() -> float:
    """CPU seconds every process on the machine has used since boot (/proc/stat: all but idle and iowait)."""
    cpu = machine_cpu()
    return cpu["busy"] + cpu["steal"]


def tree_cpu_seconds() -> float:
    """CPU seconds of this process, its finished children and its live descendants (Prefect's server)."""
    total = cpu_seconds()
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                t = child.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
    except ImportError:  # pragma: no cover
        pass
    return total


# --- the shared setup ---------------------------------------------------------------------------------

def campaign_config(args: argparse.Namespace, scratch: Path) -> Any:
    """configs/default.toml with only the arithmetic environment, the benchmark's eval set, paths in scratch."""
    from evertrain.config import load_config

    config = load_config(ROOT / (getattr(args, "config", None) or "configs/default.toml"), list(args.set or []))
    data = config.model_dump()
    data["name"] = "vs-trl"
    data["seed"] = args.seed
    data["update"]["learning_rate"] = args.learning_rate  # like with like: TRL trains at the same rate
    arithmetic = next(spec for spec in data["environments"] if spec["name"] == "arithmetic")
    # the sealed splits are measured by this script, for both systems alike, outside the budget: the
    # campaign's own sealed measurement (base and each new champion) would only repeat it
    data["environments"] = [{**arithmetic, "weight": 1.0, "sealed_problems": 0}]
    data["eval"]["sealed_problems"] = 0
    if args.curve:  # every iteration's challenger is evaluated afterwards: retention must not delete any
        data["retention"]["keep_challengers"] = None
    if args.model == "tiny":
        data["model"].update(path="embedded:tiny", rollout_dtype="float32", models_dir=str(scratch / "models"))
    else:  # the converted SmolLM2-135M-Instruct, where `make demo` keeps it (state/ is ignored by git)
        data["model"]["models_dir"] = str(ROOT / "state" / "models")
    data["paths"] = {"store": str(scratch / "evertrain" / "store.duckdb"),
                     "mlflow_uri": f"sqlite:///{scratch / 'evertrain' / 'mlflow.db'}",
                     "artifacts": str(scratch / "evertrain" / "artifacts"),
                     "checkpoints": str(scratch / "evertrain" / "checkpoints")}
    return type(config).model_validate(data)


def arithmetic_env(config: Any) -> Any:
    from evertrain.envs import registry

    spec = next(s for s in config.environments if s.name == "arithmetic")
    return registry.get("arithmetic", **spec.options)


def shared_settings(config: Any) -> dict[str, Any]:
    return {
        "environment": "arithmetic", "group_size": config.group_size,
        "temperature": config.generation.temperature, "top_p": config.generation.top_p,
        "max_new_tokens": config.max_new_tokens("arithmetic"),
        "eval_max_new_tokens": config.max_new_tokens("arithmetic", evaluation=True),
        "lora": {"rank": config.update.lora.rank, "alpha": config.update.lora.alpha,
                 "dropout": config.update.lora.dropout, "target_modules": config.update.lora.target_modules},
        "seed": config.seed,
    }


# --- evertrain: the real campaign flow, one iteration at a time -----------------------------------------

def train_evertrain(args: argparse.Namespace, scratch: Path, out: Path) -> None:
    from evertrain.quiet import quiet_libraries

    quiet_libraries()
    config = campaign_config(args, scratch)
    from prefect import flow

    from evertrain.flows.campaign import campaign_flow
    from evertrain.runtime import Runtime

    with Runtime.open(config) as rt:  # closed before each flow run opens its own
        _ = rt.base_model
        rt.ensure_started()  # one-time set-up (MLflow experiment, base model as version 1) outside the budget
        base_checkpoint = str(rt.checkpoint(1))

    @flow(name="vs-trl-warmup")
    def warmup() -> int:
        return 0

    warmup()  # Prefect's (ephemeral) API server starts here, outside the budget
    import peft  # noqa: F401  imports that the first stage would otherwise pay for
    import transformers  # noqa: F401

    budget = args.cpu_minutes * 60
    result: dict[str, Any] = {
        "system": "evertrain", "status": "running", "budget_cpu_s": budget, "config": config.model_dump(mode="json"),
        "iterations": [], "checkpoints": [],
        "base_checkpoint": base_checkpoint,
    }
    spent = train_spent = completions = 0.0
    wall0 = time.perf_counter()
    while True:
        c0, w0 = tree_cpu_seconds(), time.perf_counter()
        [iteration] = campaign_flow(config, 1)
        flow_cpu, flow_wall = tree_cpu_seconds() - c0, time.perf_counter() - w0
        with Runtime.open(config) as rt:
            row = iteration_record(rt, iteration)
        if row["champion_version_after"] is None:
            its = result["iterations"]
            row["champion_version_after"] = its[-1]["champion_version_after"] if its else 1  # 1: the base model
        row["flow_cpu_s"], row["flow_wall_s"] = flow_cpu, flow_wall
        row["orchestration_cpu_s"] = flow_cpu - sum(row["stage_cpu_s"].values())
        # all in: training stages (sft included), the gate (evaluate, promote) and the flow's orchestration
        row["all_in_cpu_s"] = row["train_cpu_s"] + row["eval_cpu_s"] + max(row["orchestration_cpu_s"], 0.0)
        spent += row["all_in_cpu_s"]
        train_spent += row["train_cpu_s"]
        completions += row["completions"]
        row["cum_all_in_cpu_s"], row["cum_train_cpu_s"], row["cum_completions"] = spent, train_spent, completions
        result["iterations"].append(row)
        result["checkpoints"].append({"label": f"iteration {iteration}", "iteration": iteration,
                                      "version": row["challenger_version"], "path": row["challenger_path"],
                                      "train_cpu_s": train_spent, "all_in_cpu_s": spent, "completions": completions})
        log(f"evertrain iteration {iteration}: train {row['train_cpu_s']:.0f} CPU-s, eval+promote "
            f"{row['eval_cpu_s']:.0f} CPU-s, orchestration {row['orchestration_cpu_s']:.0f} CPU-s (all in "
            f"{spent / 60:.1f} CPU-min{'' if args.iterations else f' of {budget / 60:.1f}'}), "
            f"{row['completions']} completions, {row['skipped_zero_variance_groups']}/{row['groups']} groups "
            f"without signal, in-loop pass@1 {row['pass1_challenger_in_loop']:.3f}, promoted={row['promoted']}")
        out.write_text(json.dumps(result, indent=2, default=str))
        if args.iterations:
            if len(result["iterations"]) >= args.iterations:
                break
        elif spent + 0.5 * row["all_in_cpu_s"] >= budget or (
                args.max_completions and completions >= args.max_completions):
            break
    champion = result["iterations"][-1]["champion_version_after"]
    with Runtime.open(config) as rt:
        champion_checkpoint = str(rt.checkpoint(champion))
    result.update(status="ok", train_cpu_s=train_spent, all_in_cpu_s=spent, completions=completions,
                  wall_s=time.perf_counter() - wall0,
                  final_checkpoint=result["checkpoints"][-1]["path"], champion_version=champion,
                  champion_checkpoint=champion_checkpoint)
    out.write_text(json.dumps(result, indent=2, default=str))


def iteration_record(rt: Any, iteration: int) -> dict[str, Any]:
    """What the store says about one finished iteration: stage CPU, rollouts, update, evaluation, decision."""
    stages = rt.store.query("SELECT stage, wall_s, cpu_s, metrics FROM stage_runs WHERE campaign = ? AND "
                            "iteration = ? AND status = 'completed'", [rt.campaign, iteration])
    cpu = {row.stage: float(row.cpu_s) for row in stages.itertuples(index=False)}
    wall = {row.stage: float(row.wall_s) for row in stages.itertuples(index=False)}
    metrics = {row.stage: json.loads(row.metrics) for row in stages.itertuples(index=False)}
    # an update without an informative group registers no challenger: the trainee stays what it was
    version = int(metrics["update"].get("challenger_version") or metrics["update"]["start_version"])
    evals = rt.store.query("SELECT avg(reward) AS pass1 FROM evals WHERE campaign = ? AND iteration = ? AND "
                           "model_version = ? AND sample = 0", [rt.campaign, iteration, version])
    decisions = rt.store.query("SELECT promoted, champion_version, reason FROM promotions WHERE campaign = ? AND "
                               "iteration = ?", [rt.campaign, iteration])
    # no gate this iteration (eval.every): no decision row, the champion stays (the caller fills it in)
    decision = decisions.iloc[0] if len(decisions) else {"promoted": False, "champion_version": None,
                                                         "reason": "not gated this iteration (eval.every)"}
    rewards = rt.store.query(
        """SELECT avg(reward) AS reward, avg(completion_tokens) AS tokens,
                  count(DISTINCT problem_id) AS problems FROM rollouts WHERE campaign = ? AND iteration = ?""",
        [rt.campaign, iteration]).iloc[0]
    promoted = bool(decision["promoted"])
    update, curate = metrics["update"], metrics["curate"]
    return {
        "iteration": iteration, "stage_cpu_s": cpu, "stage_wall_s": wall,
        "train_cpu_s": sum(cpu.get(s, 0.0) for s in TRAINING_STAGES),
        "eval_cpu_s": sum(cpu.get(s, 0.0) for s in EVAL_STAGES),
        "completions": int(metrics["rollout"]["completions"]), "problems": int(rewards["problems"]),
        "mean_reward": float(rewards["reward"]), "mean_completion_tokens": float(rewards["tokens"]),
        "groups": int(update.get("groups", 0)),
        "skipped_zero_variance_groups": int(update.get("skipped_zero_variance_groups", 0)),
        "update_steps": int(update.get("steps", 0)), "trained_sequences": int(update.get("trained_sequences", 0)),
        "curate_dropped": {k: v for k, v in curate.items() if k.startswith("dropped_")},
        "rollout_model_s": float(metrics["rollout"].get("model_s", 0.0)),
        "update_model_s": float(update.get("model_s", 0.0)),
        "challenger_version": version, "challenger_path": str(rt.checkpoint(version)),
        "pass1_challenger_in_loop": float("nan") if evals["pass1"].isna().all() else float(evals["pass1"].iloc[0]),
        "promoted": promoted, "champion_version_after": version if promoted else (
            None if decision["champion_version"] is None else int(decision["champion_version"])),
        "promotion_reason": str(decision["reason"]),
    }


# --- TRL: GRPOTrainer on its own ------------------------------------------------------------------------

def warm_start(config: Any, env: Any, train: list[Any], model: Any, tokenizer: Any, lora: Any,
               scratch: Path) -> tuple[Any, dict[str, Any]]:
    """TRL given evertrain's warm start: the base model's own completions to train problems asked with their
    worked examples, verified by the environment's grader, then TRL's ``SFTTrainer`` on the passed ones after
    the same question WITHOUT the worked examples (context distillation, as evertrain's ``sft.prompt =
    "bare"``), a LoRA adapter that GRPO then trains on. As much data as evertrain's warm start sees: its
    ``sft.first_iterations`` rounds of ``problems_per_iteration`` problems x G samples, at most
    ``sft.max_examples`` passed completions a round (one per group first); its learning rate, epochs and batch.
    Every CPU-second of it (sampling, grading, SFT) is counted in the budget by the caller."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from evertrain.inference.local import sample
    from evertrain.models.checkpoint import encode_chat
    from evertrain.tasks.sft import bare_chat

    cfg, G = config.sft, config.group_size
    rounds, per_round = max(cfg.first_iterations, 1), config.problems_per_iteration
    rows, stats = [], {"rounds": rounds, "problems": 0, "completions": 0, "passed": 0}
    for r in range(rounds):
        problems = train[r * per_round:(r + 1) * per_round]
        prompts = [encode_chat(tokenizer, env.messages(p)) for p in problems]
        groups, _ = sample(model, tokenizer, prompts, G, max_new_tokens=config.max_new_tokens("arithmetic"),
                           temperature=config.generation.temperature, top_p=config.generation.top_p,
                           batch_size=config.generation.batch_size, seed=config.seed * 1000 + r)
        passed = [[s for s in group if env.verify(p, s.text).reward >= 1.0] for p, group in
                  zip(problems, groups, strict=True)]
        stats["problems"] += len(problems)
        stats["completions"] += sum(len(g) for g in groups)
        stats["passed"] += sum(len(g) for g in passed)
        # one per group first, as evertrain's sft selection, at most max_examples a round
        chosen = [(p, g[k]) for k in range(G) for p, g in zip(problems, passed, strict=True) if k < len(g)]
        for problem, completion in chosen[:cfg.max_examples]:
            prompt = encode_chat(tokenizer, bare_chat(env.messages(problem)))
            ids = list(completion.completion_ids)
            rows.append({"input_ids": prompt + ids, "labels": [-100] * len(prompt) + ids})
    stats["sft_examples"] = len(rows)
    peft_config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=lora.target_modules, task_type="CAUSAL_LM")
    if not rows:  # nothing passed: GRPO starts from a fresh adapter on the base model
        from peft import get_peft_model

        stats["sft_steps"] = 0
        return get_peft_model(model, peft_config), stats
    sft_args = SFTConfig(
        output_dir=str(scratch / "trl_warm" / "sft"), per_device_train_batch_size=cfg.batch_size,
        num_train_epochs=cfg.epochs, learning_rate=cfg.learning_rate, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", report_to=[], seed=config.seed, max_length=None, disable_tqdm=True,
        use_cpu=True, bf16=False, dataloader_num_workers=0, gradient_checkpointing=False)
    trainer = SFTTrainer(model=model, args=sft_args, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer, peft_config=peft_config)
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    stats.update(sft_steps=int(result.global_step), sft_loss_first=losses[0] if losses else None,
                 sft_loss_last=losses[-1] if losses else None)
    return trainer.model, stats


def train_trl(args: argparse.Namespace, scratch: Path, out: Path, base_model: str, warm: bool = False) -> None:
    """TRL's GRPOTrainer until the CPU budget is spent; ``warm``: after :func:`warm_start`, counted in it."""
    from evertrain.quiet import quiet_libraries

    quiet_libraries()
    config = campaign_config(args, scratch)
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from evertrain.models.checkpoint import MANIFEST, load_tokenizer
    from evertrain.models.precision import set_threads

    set_threads(config.torch_threads)
    env = arithmetic_env(config)
    train = env.problems("train", env.count("train"), config.seed)  # the whole train pool, shuffled
    by_question = {p.prompt: p for p in train}
    budget = args.cpu_minutes * 60
    G = config.group_size
    every = args.trl_save_every
    name = "trl_warm" if warm else "trl"
    snapshots = scratch / name / "snapshots"
    result: dict[str, Any] = {"system": name, "status": "running", "budget_cpu_s": budget,
                              "checkpoints": [], "steps": [], "train_problems": len(train)}
    acc = {"generate_cpu_s": 0.0, "reward_cpu_s": 0.0, "snapshot_cpu_s": 0.0, "warm_cpu_s": 0.0}
    groups = {"groups": 0, "zero_variance": 0, "rewards": 0.0, "completions": 0}

    def arithmetic_reward(prompts: list[Any], completions: list[Any], question: list[str], **_: Any) -> list[float]:
        began = cpu_seconds()
        rewards = []
        for q, completion in zip(question, completions, strict=True):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            rewards.append(env.verify(by_question[q], text).reward)
        per_group: dict[str, list[float]] = {}
        for q, r in zip(question, rewards, strict=True):
            per_group.setdefault(q, []).append(r)
        groups["groups"] += len(per_group)
        groups["zero_variance"] += sum(max(v) == min(v) for v in per_group.values())
        groups["rewards"] += sum(rewards)
        groups["completions"] += len(rewards)
        acc["reward_cpu_s"] += cpu_seconds() - began
        return rewards

    def snapshot(model: Any, step: int, spent: float) -> None:
        began = cpu_seconds()
        dest = snapshots / f"step-{step:05d}"
        model.save_pretrained(str(dest), safe_serialization=True)
        (dest / MANIFEST).write_text(json.dumps({"kind": "lora", "base_model": base_model, "step": step}))
        acc["snapshot_cpu_s"] += cpu_seconds() - began
        result["checkpoints"].append({"label": f"step {step}", "step": step, "path": str(dest), "train_cpu_s": spent,
                                      "all_in_cpu_s": spent, "completions": step * TRL_COMPLETIONS_PER_STEP})
        out.write_text(json.dumps(result, indent=2, default=str))

    class Budget(TrainerCallback):
        """Stops training when the CPU budget is spent; snapshots the adapter every ``every`` steps."""

        def on_train_begin(self, args_: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start, self.last = cpu_seconds(), acc["warm_cpu_s"]  # a step's cost leaves the warm start out
            self.wall = time.perf_counter()

        def spent(self) -> float:  # the warm start (before the first step) is part of what was spent
            return cpu_seconds() - self.start - acc["snapshot_cpu_s"] + acc["warm_cpu_s"]

        def on_step_end(self, args_: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            spent = self.spent()
            cost, self.last = spent - self.last, spent
            step = state.global_step
            done = step * TRL_COMPLETIONS_PER_STEP
            result["steps"].append({"step": step, "train_cpu_s": spent, "step_cpu_s": cost,
                                    "wall_s": time.perf_counter() - self.wall,
                                    "mean_reward": groups["rewards"] / max(groups["completions"], 1)})
            stop = spent + 0.5 * cost >= budget or bool(args.max_completions and done >= args.max_completions)
            if stop or step % every == 0:
                snapshot(model, step, spent)
            if step % 5 == 0 or stop:
                log(f"trl step {step}: {spent / 60:.1f} of {budget / 60:.1f} CPU-min, {cost:.0f} CPU-s this step, "
                    f"zero-variance groups so far {groups['zero_variance']}/{groups['groups']}")
            if stop:
                control.should_training_stop = True

    grpo = GRPOConfig(
        output_dir=str(scratch / name / "output"), use_cpu=True, bf16=False, fp16=False,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        learning_rate=args.learning_rate, lr_scheduler_type="constant", max_steps=100_000,
        per_device_train_batch_size=TRL_COMPLETIONS_PER_STEP, gradient_accumulation_steps=1,
        num_generations=G, max_completion_length=config.max_new_tokens("arithmetic"),
        temperature=config.generation.temperature, top_p=config.generation.top_p, beta=0.0,
        gradient_checkpointing=args.trl_gradient_checkpointing, seed=config.seed, dataloader_num_workers=0,
    )
    lora = config.update.lora
    setup0 = cpu_seconds()
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    tokenizer = load_tokenizer(base_model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    peft_config: Any = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                  target_modules=lora.target_modules, task_type="CAUSAL_LM")
    if warm:
        began = cpu_seconds()
        torch.manual_seed(config.seed)
        model, result["warm_start"] = warm_start(config, env, train, model, tokenizer, lora, scratch)
        peft_config = None  # GRPO trains the warm start's adapter on
        acc["warm_cpu_s"] = cpu_seconds() - began
        result["warm_start"]["cpu_s"] = acc["warm_cpu_s"]
        log(f"trl_warm: warm start {result['warm_start']} in {acc['warm_cpu_s']:.0f} CPU-s")
    dataset = Dataset.from_list([{"prompt": env.messages(p), "question": p.prompt} for p in train])
    callback = Budget()
    trainer = GRPOTrainer(
        model=model, reward_funcs=[arithmetic_reward], args=grpo, train_dataset=dataset, processing_class=tokenizer,
        peft_config=peft_config, callbacks=[callback],
    )
    generate = trainer._generate

    def timed_generate(*a: Any, **k: Any) -> Any:
        began = cpu_seconds()
        try:
            return generate(*a, **k)
        finally:
            acc["generate_cpu_s"] += cpu_seconds() - began

    trainer._generate = timed_generate
    result["setup_cpu_s"] = cpu_seconds() - setup0
    result["grpo_config"] = {k: v for k, v in grpo.to_dict().items() if isinstance(v, str | int | float | bool)}
    wall0 = time.perf_counter()
    trainer.train()
    spent = callback.spent()
    steps = trainer.state.global_step
    if not result["checkpoints"] or result["checkpoints"][-1]["step"] != steps:
        snapshot(trainer.model, steps, spent)
    completions = steps * TRL_COMPLETIONS_PER_STEP + result.get("warm_start", {}).get("completions", 0)
    result.update(
        status="ok", train_cpu_s=spent, completions=completions, wall_s=time.perf_counter() - wall0,
        update_steps=steps, final_checkpoint=result["checkpoints"][-1]["path"],
        generate_cpu_s=acc["generate_cpu_s"], reward_cpu_s=acc["reward_cpu_s"], warm_cpu_s=acc["warm_cpu_s"],
        update_cpu_s=spent - acc["generate_cpu_s"] - acc["warm_cpu_s"], snapshot_cpu_s=acc["snapshot_cpu_s"],
        groups=groups["groups"], zero_variance_groups=groups["zero_variance"],
        mean_reward=groups["rewards"] / max(groups["completions"], 1),
    )
    out.write_text(json.dumps(result, indent=2, default=str))


# --- evaluation: the same code for every checkpoint ---------------------------------------------------

class Evaluator:
    """Greedy pass@1 of checkpoints on the held-out problems, cached per checkpoint path, CPU-timed."""

    def __init__(self, config: Any, n: int, dtype: str, split: str = "test") -> None:
        import torch

        from evertrain.models.precision import set_threads

        set_threads(config.torch_threads)
        self.config, self.dtype = config, getattr(torch, dtype)
        self.env = arithmetic_env(config)
        # the sealed splits: neither evertrain's curation nor its gate ever sees them
        self.problems = self.env.sealed_problems(split, n, config.seed, gate=config.held_out_size("arithmetic"))
        if not self.problems:
            raise RuntimeError(f"arithmetic has no sealed {split!r} split with these options")
        self.cache: dict[str, dict[str, Any]] = {}

    @staticmethod
    def key(checkpoint: str) -> str:
        """What identifies a checkpoint's answers: the base model's path, or the checkpoint's own."""
        from evertrain.models.checkpoint import read_manifest

        manifest = read_manifest(checkpoint)
        return f"base:{manifest['base_model']}" if manifest["kind"] == "base" else str(Path(checkpoint).resolve())

    def __call__(self, checkpoint: str) -> dict[str, Any]:

        key = self.key(checkpoint)
        if key in self.cache:
            return self.cache[key]
        import numpy as np

        from evertrain.inference.local import sample
        from evertrain.models.checkpoint import encode_chat, load_policy

        began, wall = cpu_seconds(), time.perf_counter()
        model, tokenizer = load_policy(checkpoint, dtype=self.dtype, device="cpu")
        prompts = [encode_chat(tokenizer, self.env.messages(p)) for p in self.problems]
        groups, _ = sample(model, tokenizer, prompts, 1, greedy=True,
                           max_new_tokens=self.config.max_new_tokens("arithmetic", evaluation=True),
                           batch_size=self.config.generation.batch_size)
        passed = np.array([self.env.verify(p, g[0].text).reward for p, g in zip(self.problems, groups, strict=True)])
        del model
        low, high = mean_interval(passed, samples=BOOTSTRAP_SAMPLES, seed=BOOTSTRAP_SEED)
        record = {"pass1": float(passed.mean()), "ci": [low, high], "passed": "".join(str(int(x)) for x in passed),
                  "eval_cpu_s": cpu_seconds() - began, "eval_wall_s": time.perf_counter() - wall}
        self.cache[key] = record
        log(f"evaluated {checkpoint}: pass@1 {record['pass1']:.3f} [{low:.3f}, {high:.3f}] "
            f"({record['eval_cpu_s']:.0f} CPU-s)")
        return record


def as_array(record: dict[str, Any]) -> Any:
    import numpy as np

    return np.array([int(c) for c in record["passed"]], dtype=float)


def summarize(before: dict[str, Any], after: dict[str, Any], cpu_s: float) -> dict[str, Any]:
    """One checkpoint against the base model on the same problems: gain, its interval, points per CPU-hour."""
    diff = as_array(after) - as_array(before)
    gain = float(diff.mean())
    low, high = mean_interval(diff, samples=BOOTSTRAP_SAMPLES, seed=BOOTSTRAP_SEED)
    hours = cpu_s / 3600
    return {"pass1_before": before["pass1"], "pass1_after": after["pass1"], "pass1_after_ci": after["ci"],
            "gain": gain, "gain_ci": [low, high], "cpu_min": cpu_s / 60,
            "points_per_cpu_hour": 100 * gain / hours if hours else 0.0}


def curve(evaluate: Evaluator, base: dict[str, Any], checkpoints: list[dict[str, Any]]) -> list[dict[str, Any]]:
    points = [{"label": "base", "cpu_min": 0.0, "completions": 0, "pass1": base["pass1"], "ci": base["ci"]}]
    for c in checkpoints:
        r = evaluate(c["path"])
        points.append({"label": c["label"], "cpu_min": c["all_in_cpu_s"] / 60, "completions": c["completions"],
                       "pass1": r["pass1"], "ci": r["ci"], "eval_cpu_s": r["eval_cpu_s"]})
    return points


# --- the parent: run both, evaluate, report -----------------------------------------------------------

def run_worker(system: str, args: argparse.Namespace, scratch: Path, base_model: str, seed: int,
               cpu_minutes: float) -> dict[str, Any]:
    out = scratch / f"{system}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--scratch", str(scratch),
               "--cpu-minutes", str(cpu_minutes), "--eval-problems", str(args.eval_problems),
               "--max-completions", str(args.max_completions), "--model", args.model,
               "--trl-save-every", str(args.trl_save_every), "--base-model", base_model,
               "--learning-rate", str(args.learning_rate), "--seed", str(seed),
               "--iterations", str(args.iterations if system == "evertrain" else 0)]
    if args.trl_gradient_checkpointing:
        command.append("--trl-gradient-checkpointing")
    if args.config:
        command += ["--config", args.config]
    for setting in args.set or []:
        command += ["--set", setting]
    if args.curve:
        command.append("--curve")
    env = {**os.environ, "EVERTRAIN_PROGRESS": "0"}
    if "PREFECT_API_URL" not in env:  # an ephemeral Prefect of our own: nothing written to the user's Prefect DB
        env["PREFECT_HOME"] = str(scratch / "prefect")
    log(f"training {system}, seed {seed}: {' '.join(command[1:])}")
    began = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=str(ROOT), stdout=sys.stderr)  # stdout is the table's
    result = json.loads(out.read_text()) if out.exists() else {"system": system, "checkpoints": []}
    result["worker_wall_s"] = time.perf_counter() - began
    if proc.returncode != 0:
        result["status"] = "failed"
        result["error"] = f"worker exited with status {proc.returncode} (its traceback is on stderr above)"
        log(f"{system} failed: {result['error']}")
    return result


def plot(path: Path, runs: list[dict[str, Any]], base: dict[str, Any], eval_problems: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    # a line: every checkpoint of a seed run with --curve (evertrain's: each iteration's trainee, gated or not);
    # a hollow marker: what each seed's run delivered (evertrain's champion, TRL's final adapter)
    styles = {"evertrain": ("tab:blue", "o", "evertrain, each iteration's trainee", "evertrain's champion"),
              "trl": ("tab:orange", "s", "TRL GRPOTrainer", "TRL GRPOTrainer, final"),
              "trl_warm": ("tab:green", "^", "TRL SFTTrainer warm start, then GRPOTrainer", "TRL warm, final")}
    for system, (color, marker, curve_label, end_label) in styles.items():
        mine = [r for r in runs if r["system"] == system]
        curves = [r for r in mine if r.get("curve")]
        for i, run in enumerate(curves):
            points = run["curve"]
            ax.plot([q["cpu_min"] for q in points], [q["pass1"] for q in points], color=color, marker=marker,
                    linewidth=1.2, markersize=4, alpha=0.8, label=curve_label if i == 0 else None)
        if mine:
            ax.plot([r["cpu_min"] for r in mine], [r["pass1_after"] for r in mine], color=color, marker=marker,
                    linestyle="none", markersize=9, markerfacecolor="none", markeredgewidth=1.5,
                    label=f"{end_label} ({len(mine)} seed{'s' if len(mine) > 1 else ''})")
    ax.axhline(base["pass1"], color="gray", linestyle=":", linewidth=1, label="base model")
    ax.set_xlabel("CPU-minutes, all in (evertrain: curation, sampling, grading, sft, update, gate)")
    ax.set_ylabel(f"sealed test pass@1 (greedy, {eval_problems} problems)")
    ax.set_title("SmolLM2-135M-Instruct on arithmetic: evertrain vs TRL\n"
                 "lines: every checkpoint (runs with --curve); hollow: what each run delivered")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt_ci(value: float, ci: list[float]) -> str:
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def fmt_gain(value: float, ci: list[float]) -> str:
    return f"{value:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"


def evaluate_seed(system: str, seed: int, result: dict[str, Any], evaluate: Evaluator, transfer: Evaluator,
                  base: dict[str, Any], base_transfer: dict[str, Any], with_curve: bool) -> dict[str, Any]:
    """What one system's run of one seed gained on the sealed splits, for the CPU it spent all in."""
    if result.get("status") != "ok" or not result.get("checkpoints"):
        raise RuntimeError(f"{system} (seed {seed}) produced no result: {result.get('error', 'no error recorded')}")
    if system == "evertrain":  # what evertrain ships is its champion; the last challenger is shown beside it
        output, label = result["champion_checkpoint"], f"champion v{result['champion_version']}"
    else:
        output, label = result["final_checkpoint"], f"step {result['update_steps']}"
    cpu_s = float(result["all_in_cpu_s"] if system == "evertrain" else result["train_cpu_s"])
    after = evaluate(output)
    run = {"system": system, "seed": seed, "output": label, **summarize(base, after, cpu_s),
           "passed": after["passed"], "train_cpu_min": float(result["train_cpu_s"]) / 60,
           "completions": int(result["completions"]), "wall_min": float(result.get("worker_wall_s", 0.0)) / 60}
    moved_to = transfer(output)
    moved = as_array(moved_to) - as_array(base_transfer)
    run["transfer_gain"] = float(moved.mean())
    run["transfer_gain_ci"] = list(mean_interval(moved, samples=BOOTSTRAP_SAMPLES, seed=BOOTSTRAP_SEED))
    run["transfer_passed"] = moved_to["passed"]
    if system == "evertrain":
        its = result["iterations"]
        last = summarize(base, evaluate(result["final_checkpoint"]), cpu_s)
        run["last_challenger"] = {"version": its[-1]["challenger_version"], "gain": last["gain"],
                                  "gain_ci": last["gain_ci"]}
        run.update(iterations=len(its), promotions=sum(bool(i["promoted"]) for i in its),
                   gate_cpu_min=sum(i["eval_cpu_s"] for i in its) / 60,
                   orchestration_cpu_min=sum(max(i["orchestration_cpu_s"], 0.0) for i in its) / 60,
                   stage_cpu_min={st: sum(i["stage_cpu_s"].get(st, 0.0) for i in its) / 60
                                  for st in (*TRAINING_STAGES, *EVAL_STAGES)},
                   groups=sum(i["groups"] for i in its),
                   zero_variance_groups=sum(i["skipped_zero_variance_groups"] for i in its))
    else:
        run.update(update_steps=result.get("update_steps"), groups=result.get("groups"),
                   zero_variance_groups=result.get("zero_variance_groups"),
                   generate_cpu_min=result.get("generate_cpu_s", 0.0) / 60,
                   update_cpu_min=result.get("update_cpu_s", 0.0) / 60)
        if "warm_start" in result:  # trl_warm: what its warm start sampled, kept and cost (inside cpu_min)
            run.update(warm_start=result["warm_start"], warm_cpu_min=result.get("warm_cpu_s", 0.0) / 60)
    if with_curve:
        run["curve"] = curve(evaluate, base, result["checkpoints"])
    log(f"{system} seed {seed}: {label} gain {fmt_gain(run['gain'], run['gain_ci'])} on the sealed test split, "
        f"transfer {fmt_gain(run['transfer_gain'], run['transfer_gain_ci'])}, {run['cpu_min']:.1f} CPU-min all in")
    return run


def aggregate(runs: list[dict[str, Any]], base: dict[str, Any], base_transfer: dict[str, Any]) -> dict[str, Any]:
    """Per system: the mean gain over seeds with a seeds-and-problems bootstrap interval, points per CPU-hour."""
    import numpy as np

    from evertrain.stats import nested_bootstrap_means, percentile_interval

    out: dict[str, Any] = {}
    draws: dict[str, Any] = {}
    for system in SYSTEMS:
        mine = [r for r in runs if r["system"] == system]
        if not mine:
            continue
        diffs = [as_array({"passed": r["passed"]}) - as_array(base) for r in mine]
        moved = [as_array({"passed": r["transfer_passed"]}) - as_array(base_transfer) for r in mine]
        gain, transfer_gain = float(np.mean([d.mean() for d in diffs])), float(np.mean([m.mean() for m in moved]))
        # resample the seeds, then the problems within each seed
        boot = nested_bootstrap_means(diffs, BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED)
        boot_t = nested_bootstrap_means(moved, BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED)
        hours = float(np.mean([r["cpu_min"] for r in mine])) / 60
        draws[system] = 100 * boot / hours
        out[system] = {
            "seeds": [r["seed"] for r in mine], "gains": [r["gain"] for r in mine],
            "gain": gain, "gain_ci": list(percentile_interval(boot)),
            "transfer_gains": [r["transfer_gain"] for r in mine], "transfer_gain": transfer_gain,
            "transfer_gain_ci": list(percentile_interval(boot_t)),
            "cpu_min_mean": hours * 60, "points_per_cpu_hour": 100 * gain / hours,
            # for information (the bar is the test split's): the whole sealed set, test and transfer pooled
            "sealed_set_gain": (gain + transfer_gain) / 2,
            "sealed_set_points_per_cpu_hour": 100 * (gain + transfer_gain) / 2 / hours,
            "points_per_cpu_hour_ci": list(percentile_interval(draws[system])),
        }
    baselines = [b for b in BASELINES if b in out]
    if "evertrain" in out and baselines:
        # the bar is against the stronger baseline (more points per CPU-hour): the lead must be the loop's,
        # not only the warm start's recipe
        strongest = max(baselines, key=lambda b: out[b]["points_per_cpu_hour"])
        ours, theirs = out["evertrain"]["points_per_cpu_hour"], out[strongest]["points_per_cpu_hour"]
        # P(evertrain's rate >= 2x the baseline's) over independent bootstrap draws of the systems
        p_two = float(np.mean((draws["evertrain"] > 0) & (draws["evertrain"] >= 2 * draws[strongest])))
        out["bar"] = {"required": "evertrain points per CPU-hour all in >= 2x the stronger TRL baseline's",
                      "baseline": strongest, "evertrain_points_per_cpu_hour": ours,
                      "trl_points_per_cpu_hour": theirs, "ratio": ours / theirs if theirs > 0 else None,
                      "p_evertrain_at_least_2x": p_two, "met": ours > 0 and ours >= 2 * theirs}
        pooled = out["evertrain"]["sealed_set_points_per_cpu_hour"], out[strongest]["sealed_set_points_per_cpu_hour"]
        out["bar"]["sealed_set_ratio"] = pooled[0] / pooled[1] if pooled[1] > 0 else None
        out["bar"]["per_baseline"] = {b: {
            "points_per_cpu_hour": out[b]["points_per_cpu_hour"],
            "ratio": ours / out[b]["points_per_cpu_hour"] if out[b]["points_per_cpu_hour"] > 0 else None,
            "p_evertrain_at_least_2x": float(np.mean((draws["evertrain"] > 0) & (draws["evertrain"] >= 2 * draws[b])))}
            for b in baselines}
    return out


SAME_SETTINGS = ("iterations", "eval_problems", "eval_dtype", "learning_rate_both", "model", "matched_budget",
                 "group_size", "max_new_tokens", "temperature", "cpu_minutes", "evertrain_config")


def schedule_sets(schedule: str, budget: float | None, sets: list[str]) -> list[str]:
    """The ``--set`` items evertrain runs with. The short schedule is the demo's first gated cycle: two
    iterations (both warm-started), one gate at the end (``eval.every=2``). A ``--budget`` run keeps its
    config's own gate cadence (``configs/long.toml``: every 3rd update): forcing ``eval.every=2`` there gated
    half as often again as the campaign it measures (stop 34). An explicit ``--set eval.every=N`` wins."""
    if schedule != "short" or budget is not None or any(item.split("=", 1)[0].strip() == "eval.every"
                                                         for item in sets):
        return list(sets)
    return ["eval.every=2", *sets]


def settings_differ(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The settings that make two results files' runs incomparable (empty: they may be pooled or resumed)."""
    differ = [k for k in SAME_SETTINGS if old.get(k) != new.get(k)]
    if old["evertrain"].get("settings_changed", []) != new["evertrain"].get("settings_changed", []):
        differ.append("--set")
    return differ


def pool(names: list[str]) -> dict[str, Any]:
    """The runs of several results files made with the same settings (other seeds: a replication), pooled,
    with the summary and the bar recomputed over every seed."""
    from benchmarks.common import RESULTS

    files = [json.loads((RESULTS / f"{name}.json").read_text()) for name in names]
    first = files[0]
    runs: list[dict[str, Any]] = []
    for name, data in zip(names, files, strict=True):
        differ = settings_differ(first["settings"], data["settings"])
        if differ:
            raise SystemExit(f"--pool: {name} was made with other settings than {names[0]} ({', '.join(differ)})")
        if data["base"]["passed"] != first["base"]["passed"] or \
                data["base_transfer"]["passed"] != first["base_transfer"]["passed"]:
            raise SystemExit(f"--pool: {name}'s base model answered the sealed problems differently than in "
                             f"{names[0]}: another model or other problems")
        for run in data["runs"]:
            if any((r["system"], r["seed"]) == (run["system"], run["seed"]) for r in runs):
                raise SystemExit(f"--pool: {run['system']} seed {run['seed']} is in more than one file")
            runs.append({**run, "from": name})
    seeds = sorted({r["seed"] for r in runs})
    payload = {"pooled_from": {name: {"command": d["command"], "date": d["date"], "machine": d["machine"],
                                      "contention": d.get("contention")} for name, d in zip(names, files, strict=True)},
               "settings": {**first["settings"], "seeds": seeds}, "runs": runs,
               "failures": [f for d in files for f in d.get("failures", [])],
               "base": first["base"], "base_transfer": first["base_transfer"]}
    payload["summary"] = aggregate(runs, first["base"], first["base_transfer"])
    return payload


def reevaluate(names: list[str], n: int, dtype: str) -> dict[str, Any]:
    """The runs of these results files, their delivered checkpoints evaluated again on ``n`` problems of each
    sealed split (a larger, tighter test than the runs were first measured on), the bar recomputed.

    Every run's scratch directory (``scratch`` in its file) must still hold its worker's result and
    checkpoints; a run whose checkpoints are gone is listed in ``failures``, not dropped silently.
    """
    from benchmarks.common import RESULTS

    files = [json.loads((RESULTS / f"{name}.json").read_text()) for name in names]
    first = files[0]
    for name, data in zip(names, files, strict=True):
        differ = [k for k in settings_differ(first["settings"], data["settings"]) if k != "eval_problems"]
        if differ:
            raise SystemExit(f"--reevaluate: {name} was made with other settings than {names[0]} ({', '.join(differ)})")
    settings = {**first["settings"], "eval_problems": n, "eval_dtype": dtype}
    args = argparse.Namespace(config=settings["evertrain_config"], set=settings["evertrain"]["settings_changed"],
                              seed=0, learning_rate=settings["learning_rate_both"], curve=False,
                              model=settings["model"])
    config = campaign_config(args, Path(first["scratch"]))  # --model tiny: the model the runs were made with
    evaluate = Evaluator(config, n, dtype, split="test")
    transfer = Evaluator(config, n, dtype, split="transfer")
    base_checkpoint = str(Path(first["scratch"]) / "base")
    if not Path(base_checkpoint).exists():
        raise SystemExit(f"--reevaluate: {names[0]}'s base checkpoint {base_checkpoint} is gone")
    base, base_transfer = evaluate(base_checkpoint), transfer(base_checkpoint)
    runs: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    for name, data in zip(names, files, strict=True):
        for old in data["runs"]:
            system, seed = old["system"], old["seed"]
            worker = Path(data["scratch"]) / f"seed-{seed}" / f"{system}.json"
            try:
                if not worker.exists():
                    raise FileNotFoundError(f"its worker's result {worker} is gone")
                result = json.loads(worker.read_text())
                checkpoint = result.get("champion_checkpoint" if system == "evertrain" else "final_checkpoint")
                if not checkpoint or not Path(checkpoint).exists():
                    raise FileNotFoundError(f"its delivered checkpoint {checkpoint} is gone")
                run = evaluate_seed(system, seed, result, evaluate, transfer, base, base_transfer, False)
            except (FileNotFoundError, RuntimeError) as error:
                failures.append({"system": system, "seed": seed, "from": name, "error": str(error)})
                log(f"--reevaluate: {system} seed {seed} of {name} not re-evaluated: {error}")
                continue
            run.update({"cpu": old.get("cpu"), "from": name,
                        f"gain_on_{first['settings']['eval_problems']}": old["gain"]})
            runs.append(run)
    payload = {"reevaluated_from": {name: {"command": d["command"], "date": d["date"], "machine": d["machine"]}
                                    for name, d in zip(names, files, strict=True)},
               "settings": settings, "runs": runs, "failures": failures,
               "base": {k: base[k] for k in ("pass1", "ci", "eval_cpu_s", "passed")},
               "base_transfer": {k: base_transfer[k] for k in ("pass1", "ci", "eval_cpu_s", "passed")}}
    # what was measured: a pool smaller than asked gives fewer problems, and only the runs re-evaluated count
    settings.update(eval_problems=len(evaluate.problems), transfer_problems=len(transfer.problems),
                    seeds=sorted({r["seed"] for r in runs}))
    payload["summary"] = aggregate(runs, base, base_transfer)
    return payload


def print_summary(payload: dict[str, Any]) -> None:
    """The per-seed table, the means and the bar, as the benchmark prints them."""
    from benchmarks.common import print_table

    rows = [{"system": r["system"], "seed": r["seed"], "output": r["output"], "CPU-min all in": r["cpu_min"],
             "sealed test pass@1": f"{r['pass1_before']:.3f} -> {r['pass1_after']:.3f}",
             "gain [95% CI]": fmt_gain(r["gain"], r["gain_ci"]),
             "transfer gain [95% CI]": fmt_gain(r["transfer_gain"], r["transfer_gain_ci"]),
             "points/CPU-hour": r["points_per_cpu_hour"]} for r in payload["runs"]]
    for system, agg in payload["summary"].items():
        if system == "bar":
            continue
        rows.append({"system": system, "seed": "mean", "output": f"{len(agg['seeds'])} seeds",
                     "CPU-min all in": agg["cpu_min_mean"], "sealed test pass@1": "",
                     "gain [95% CI]": fmt_gain(agg["gain"], agg["gain_ci"]),
                     "transfer gain [95% CI]": fmt_gain(agg["transfer_gain"], agg["transfer_gain_ci"]),
                     "points/CPU-hour": agg["points_per_cpu_hour"]})
    if rows:
        print_table(rows, list(rows[0]))
    if "bar" in payload["summary"]:
        b = payload["summary"]["bar"]
        ratio = "n/a (TRL gained nothing)" if b["ratio"] is None else f"{b['ratio']:.2f}x"
        against = b.get("baseline", "trl")
        print(f"bar (evertrain points/CPU-hour all in >= 2x the stronger TRL baseline's, {against}): "
              f"{b['evertrain_points_per_cpu_hour']:.1f} vs {b['trl_points_per_cpu_hour']:.1f} ({ratio}, "
              f"P(>= 2x) = {b['p_evertrain_at_least_2x']:.2f}): {'met' if b['met'] else 'NOT met'}")
        pooled = b.get("sealed_set_ratio")
        print("for information, the whole sealed set (test and transfer pooled): evertrain "
              f"{payload['summary']['evertrain']['sealed_set_points_per_cpu_hour']:.1f} vs TRL "
              f"{payload['summary'][against]['sealed_set_points_per_cpu_hour']:.1f} points/CPU-hour "
              f"({'n/a' if pooled is None else f'{pooled:.2f}x'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default=None, help="comma-separated seeds, one run of each system per seed "
                        "(default 0,1,2; --quick: 0)")
    parser.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)  # a worker's one seed
    parser.add_argument("--schedule", choices=("short", "demo"), default="short",
                        help="evertrain's schedule: short (default), the demo's first gated cycle, 2 iterations "
                        "gated once at the end (eval.every=2); demo, the demo's 6 iterations gated every 3rd")
    parser.add_argument("--iterations", type=int, default=None,
                        help="evertrain runs this many campaign iterations and TRL then gets the CPU evertrain "
                        "spent all in, seed by seed (default: the schedule's, 2 or 6; 0: both stop at "
                        "--cpu-minutes)")
    parser.add_argument("--budget", type=float, default=None, metavar="CPU_MIN",
                        help="a CPU budget fixed before the runs: every system of every seed trains until it has "
                        "spent this many CPU-minutes all in (evertrain: whole iterations, stopping within half an "
                        "iteration of it); the same as --iterations 0 --cpu-minutes CPU_MIN")
    parser.add_argument("--config", default=None,
                        help="evertrain's campaign config, reduced to its arithmetic environment (default "
                        "configs/default.toml, the demo's); e.g. configs/long.toml")
    parser.add_argument("--cpu-minutes", type=float, default=None,
                        help="with --iterations 0: the CPU budget of each system, all in (default 12; --quick: 1)")
    parser.add_argument("--eval-problems", type=int, default=None,
                        help="problems of each sealed split (default 100; --quick: 40)")
    parser.add_argument("--max-completions", type=int, default=0,
                        help="also stop a system after this many sampled completions (0: the CPU budget alone)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: one seed, 2 evertrain iterations, 40 problems")
    parser.add_argument("--curve", action="store_true", help="also evaluate every checkpoint (a learning curve)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated subset of evertrain,trl,trl_warm (trl_warm: TRL's SFTTrainer on the "
                        "base model's own verified completions without worked examples, then GRPOTrainer)")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                        help="tiny: a few-hundred-thousand-parameter model, for checking the plumbing only")
    parser.add_argument("--eval-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="precision of the benchmark's own sealed evaluations (both systems)")
    parser.add_argument("--trl-save-every", type=int, default=5, help="TRL adapter snapshot every N steps")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="turn TRL's activation (gradient) checkpointing on; off by default: at this model size "
                        "memory is no constraint and recomputation only costs CPU")
    parser.add_argument("--learning-rate", type=float, default=2e-4,
                        help="AdamW learning rate of both systems (default 2e-4, the demo's)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="change evertrain's campaign config as `evertrain run --set` does (repeatable), e.g. "
                        "--set eval.every=6; the learning rate is --learning-rate's, shared with TRL")
    parser.add_argument("--results-name", default=RESULTS_NAME,
                        help="write benchmarks/results/<name>.json and .png (default vs_trl)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs (and base evaluations) already in the --results-name file, made "
                        "with the same settings, and run only the missing (system, seed) pairs")
    parser.add_argument("--pool", metavar="NAME,NAME,...",
                        help="run nothing: pool the runs of these results files (benchmarks/results/<name>.json, "
                        "made with the same settings on other seeds, e.g. a replication) into --results-name, the "
                        "means and the bar recomputed over every seed")
    parser.add_argument("--reevaluate", metavar="NAME,NAME,...",
                        help="train nothing: evaluate the delivered checkpoints of these results files' runs (their "
                        "scratch directories must still exist) again on --eval-problems problems of each sealed "
                        "split, into --results-name")
    parser.add_argument("--scratch", help="scratch directory (default: a new temporary one)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--base-model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pool:
        from benchmarks.common import RESULTS, save

        if args.results_name in args.pool.split(","):
            parser.error("--pool: --results-name must name a new file, not one of the pooled ones")
        payload = pool(args.pool.split(","))
        print_summary(payload)
        png = RESULTS / f"{args.results_name}.png"
        plot(png, payload["runs"], payload["base"], payload["settings"]["eval_problems"])
        payload["plot"] = str(png.relative_to(ROOT))
        save(args.results_name, payload)
        log(f"saved benchmarks/results/{args.results_name}.json ({len(payload['runs'])} runs pooled)")
        return
    if args.reevaluate:
        from benchmarks.common import RESULTS, save

        if args.results_name in args.reevaluate.split(","):
            parser.error("--reevaluate: --results-name must name a new file, not one of the re-evaluated ones")
        if not args.eval_problems:
            parser.error("--reevaluate needs --eval-problems (e.g. 420: the test split and the held-out problems "
                         "between it and the gate's)")
        payload = reevaluate(args.reevaluate.split(","), args.eval_problems, args.eval_dtype)
        print_summary(payload)
        png = RESULTS / f"{args.results_name}.png"
        plot(png, payload["runs"], payload["base"], args.eval_problems)
        payload["plot"] = str(png.relative_to(ROOT))
        save(args.results_name, payload)
        log(f"saved benchmarks/results/{args.results_name}.json ({len(payload['runs'])} runs re-evaluated)")
        return
    if not args.worker:  # a worker gets its --set items from the parent, already complete
        args.set = schedule_sets(args.schedule, args.budget, args.set or [])
    if args.budget is not None:
        if args.budget <= 0 or (args.iterations or args.cpu_minutes is not None):
            parser.error("--budget takes a positive number of CPU-minutes and replaces --iterations and "
                         "--cpu-minutes")
        args.iterations, args.cpu_minutes = 0, args.budget
    if args.iterations is None:
        args.iterations = 2 if args.quick or args.schedule == "short" else 6
    if args.cpu_minutes is None:
        args.cpu_minutes = 1.0 if args.quick else 12.0
    if args.eval_problems is None:
        args.eval_problems = 40 if args.quick else 100
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="vs-trl-")).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if args.worker:
        args.seed = args.seed or 0
        out = scratch / f"{args.worker}.json"
        if args.worker == "evertrain":
            train_evertrain(args, scratch, out)
        else:
            train_trl(args, scratch, out, args.base_model, warm=args.worker == "trl_warm")
        return

    wall0 = time.perf_counter()
    try:
        seeds = [int(x) for x in (args.seeds or ("0" if args.quick else "0,1,2")).split(",") if x.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, not {args.seeds!r}")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems or not seeds:
        parser.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}" if unknown else "nothing to run")
    systems = [s for s in SYSTEMS if s in systems]  # evertrain first: TRL's budget is what it spent
    from evertrain.quiet import quiet_libraries

    quiet_libraries()
    from benchmarks.common import machine, save
    from evertrain.models.checkpoint import resolve_base, write_base_checkpoint
    from evertrain.models.precision import sampling_dtype

    args.seed = seeds[0]
    config = campaign_config(args, scratch)
    base_model = resolve_base(config.model)  # converted or built once, before anything is timed
    base_checkpoint = str(write_base_checkpoint(scratch / "base", base_model))
    matched = bool(args.iterations) and "evertrain" in systems
    log(f"scratch {scratch}; base model {base_model}; seeds {seeds}; "
        + (f"evertrain {args.iterations} iterations, TRL the same all-in CPU" if matched
           else f"budget {args.cpu_minutes:g} CPU-min per system") + f"; {args.eval_problems} sealed problems")
    settings = {
        **shared_settings(config), "seeds": seeds, "schedule": args.schedule,
        "iterations": args.iterations, "matched_budget": matched,
        "cpu_minutes": None if matched else args.cpu_minutes, "max_completions": args.max_completions,
        "budget_fixed_before_runs": args.budget, "evertrain_config": args.config,
        "eval_problems": args.eval_problems, "eval_dtype": args.eval_dtype, "eval_decoding": "greedy",
        "eval_splits": "the arithmetic environment's sealed test and transfer splits (the same problems for every "
        "seed: never seen by evertrain's curation or gate, nor by TRL's training set)",
        "bootstrap_samples": BOOTSTRAP_SAMPLES, "bootstrap_seed": BOOTSTRAP_SEED, "model": args.model,
        "base_model": base_model, "learning_rate_both": args.learning_rate,
        "cpu_accounting": "evertrain: every stage of every iteration (curate, rollout, score, sft, update, evaluate, "
        "promote) and the flow's orchestration, from the first iteration to the last; the campaign's own sealed "
        "measurement is switched off (this script measures both systems). TRL: process CPU from the first step to "
        "the last (generation, reward, update), less its adapter snapshots. One-time set-up (model load, Prefect "
        "and MLflow start) is outside both.",
        "evertrain": {"config": f"{args.config or 'configs/default.toml'}, arithmetic only (weight 1), in-loop "
                      "sealed measurement off",
                      "settings_changed": list(args.set or []),
                      "problems_per_iteration": config.problems_per_iteration,
                      "completions_per_iteration": config.problems_per_iteration * config.group_size,
                      "sft": config.sft.model_dump(mode="json"), "eval": config.eval.model_dump(mode="json"),
                      "update": config.update.model_dump(mode="json"), "rollout_dtype": config.model.rollout_dtype,
                      "rollout_dtype_resolved": sampling_dtype(config.model.rollout_dtype, config.model.device),
                      "curation": config.curation.model_dump(mode="json"),
                      "promotion": config.promotion.model_dump(mode="json")},
        "trl": {"learning_rate": args.learning_rate, "lr_scheduler_type": "constant",
                "per_device_train_batch_size": TRL_COMPLETIONS_PER_STEP, "num_generations": config.group_size,
                "beta": 0.0, "loss_type": "default (dapo in TRL 1.16)", "bf16": False,
                "gradient_checkpointing": args.trl_gradient_checkpointing, "save_every_steps": args.trl_save_every,
                "prompts": "the arithmetic environment's train problems, in the same chat messages evertrain samples"},
        "trl_warm": {"warm_start": "the base model's own completions (G per problem, evertrain's temperature) to "
                     "sft.first_iterations x problems_per_iteration train problems asked with their worked examples, "
                     "verified by the environment's grader; TRL SFTTrainer (LoRA, sft.learning_rate, sft.epochs, "
                     "sft.batch_size) on at most sft.max_examples passed ones a round, after the question without "
                     "its worked examples; then GRPOTrainer as 'trl' on the same adapter. All of it inside the budget.",
                     "sft": config.sft.model_dump(mode="json")},
    }
    payload: dict[str, Any] = {"settings": settings, "scratch": str(scratch), "runs": [], "failures": []}
    busy0 = machine_busy_seconds()

    def checkpoint_save() -> None:
        payload["wall_s"] = time.perf_counter() - wall0
        own, busy = tree_cpu_seconds(), machine_busy_seconds() - busy0
        # how much CPU the rest of the machine used meanwhile: the timings are clean only when this is small
        payload["contention"] = {"machine_busy_cpu_s": busy, "benchmark_cpu_s": own,
                                 "other_processes_cpu_s": busy - own, "loadavg_now": Path("/proc/loadavg").read_text()}
        save(args.results_name, payload)

    evaluate = Evaluator(config, args.eval_problems, args.eval_dtype, split="test")
    transfer = Evaluator(config, args.eval_problems, args.eval_dtype, split="transfer")
    if args.resume:
        from benchmarks.common import RESULTS

        old = json.loads((RESULTS / f"{args.results_name}.json").read_text())
        differ = settings_differ(old["settings"], settings)
        if differ:
            parser.error(f"--resume: the saved results were made with other settings ({', '.join(differ)})")
        payload["runs"] = [r for r in old["runs"] if r["seed"] in seeds]
        payload["resumed_from"] = {"command": old["command"], "date": old["date"],
                                   "runs_kept": [(r["system"], r["seed"]) for r in payload["runs"]],
                                   "failures_then": old.get("failures", [])}
        # greedy answers of the same base model on the same problems: kept, not recomputed
        evaluate.cache[Evaluator.key(base_checkpoint)] = old["base"]
        transfer.cache[Evaluator.key(base_checkpoint)] = old["base_transfer"]
    base, base_transfer = evaluate(base_checkpoint), transfer(base_checkpoint)
    payload["base"] = {k: base[k] for k in ("pass1", "ci", "eval_cpu_s", "passed")}
    payload["base_transfer"] = {k: base_transfer[k] for k in ("pass1", "ci", "eval_cpu_s", "passed")}
    for seed in seeds:
        seed_dir = scratch / f"seed-{seed}"
        seed_dir.mkdir(exist_ok=True)
        budget = args.cpu_minutes
        for system in systems:
            kept = [r for r in payload["runs"] if (r["system"], r["seed"]) == (system, seed)]
            if kept:
                if system == "evertrain" and matched:
                    budget = kept[0]["cpu_min"]
                log(f"{system} seed {seed}: kept from the saved results")
                continue
            try:
                result = run_worker(system, args, seed_dir, base_model, seed, budget)
                run = evaluate_seed(system, seed, result, evaluate, transfer, base, base_transfer, args.curve)
                run["cpu"] = machine()["cpu"]  # CPU-time budgets buy different work on different CPUs: kept per run
                payload["runs"].append(run)
                if system == "evertrain" and matched:
                    budget = run["cpu_min"]  # TRL gets what evertrain spent, all in
            except Exception as error:  # the other runs' results still count
                message = "".join(traceback.format_exception_only(error)).strip()
                payload["failures"].append({"system": system, "seed": seed, "error": message})
                log(f"{system} seed {seed} failed: {message}")
                if system == "evertrain" and matched:
                    break  # no budget to match
            checkpoint_save()
    payload["summary"] = aggregate(payload["runs"], base, base_transfer)
    checkpoint_save()

    print_summary(payload)
    for failure in payload["failures"]:
        print(f"FAILED: {failure['system']} seed {failure['seed']}: {failure['error']}")
    if payload["runs"]:
        from benchmarks.common import RESULTS

        RESULTS.mkdir(parents=True, exist_ok=True)
        png = RESULTS / f"{args.results_name}.png"
        plot(png, payload["runs"], base, args.eval_problems)
        payload["plot"] = str(png.relative_to(ROOT))
    checkpoint_save()
    log(f"saved benchmarks/results/{args.results_name}.json ({payload['wall_s'] / 60:.1f} min of wall time)")
    if payload["failures"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
