"""evertrain's campaign against TRL's GRPOTrainer: held-out points gained per CPU-hour, same setup.

Both systems post-train the same base model (SmolLM2-135M-Instruct) with a LoRA adapter (r=16, alpha=32,
all linear layers) on the same environment (evertrain's ``arithmetic``: the same chat prompt with its
worked examples, the same strict ``#### <answer>`` reward), with the same G (8), temperature (0.8) and
completion limit (24 tokens), until the same CPU-time budget of training work is spent (or a cap on
sampled completions is reached, whichever comes first):

- evertrain: the real campaign flow (``campaign_flow``), one iteration at a time, on configs/default.toml
  reduced to the arithmetic environment. Training CPU is the ``stage_runs.cpu_s`` of curate, rollout,
  score and update; its own evaluate and promote stages (the promotion gate) are reported apart.
- TRL: ``GRPOTrainer`` on its own (DESIGN.md's reference settings: 32 completions a step, beta 0), with a
  reward function that calls the same verifier. Both systems train at the same learning rate
  (``--learning-rate``, default 1e-4, DESIGN.md's TRL reference). Training CPU is the process CPU time
  from the first step to the last, less the adapter snapshots this benchmark takes for the curve.

Each system trains in its own subprocess (a crash in one keeps the other's results; CPU time is the
process's own). Afterwards every checkpoint is evaluated by this script with the same code: the model
loaded from its checkpoint (the base model, or base + LoRA adapter merged), greedy decoding, the same
problems of the environment's sealed test split (never seen by evertrain's curation or gate), pass@1 with
a 95% bootstrap CI; the final checkpoints also on the sealed transfer split (phrasings and operators never
trained on, no worked examples). Those evaluations are outside the training budget and are timed
separately. One seed per invocation (``--seed``): several seeds are several runs (still to be automated).

    .venv/bin/python benchmarks/vs_trl.py [--cpu-minutes 15] [--eval-problems 200] [--systems evertrain,trl]
    .venv/bin/python benchmarks/vs_trl.py --quick              # 1 CPU-minute per system, 40 eval problems
    .venv/bin/python benchmarks/vs_trl.py --quick --model tiny  # plumbing only: a tiny model, seconds

Writes benchmarks/results/vs_trl.json and benchmarks/results/vs_trl.png.
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

SYSTEMS = ("evertrain", "trl")
TRAINING_STAGES = ("curate", "rollout", "score", "update")
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
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


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

    config = load_config(ROOT / "configs" / "default.toml")
    data = config.model_dump()
    data["name"] = "vs-trl"
    data["seed"] = args.seed
    data["update"]["learning_rate"] = args.learning_rate  # like with like: TRL trains at the same rate
    arithmetic = next(spec for spec in data["environments"] if spec["name"] == "arithmetic")
    data["environments"] = [{**arithmetic, "weight": 1.0, "eval_problems": None}]
    data["eval"]["problems_per_env"] = args.eval_problems
    if args.model == "tiny":
        data["model"].update(path="embedded:tiny", rollout_dtype="float32", models_dir=str(scratch / "models"))
    else:
        data["model"]["models_dir"] = str(ROOT / "models")  # the converted SmolLM2-135M-Instruct
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
    from evertrain.runtime import quiet_libraries

    quiet_libraries()
    config = campaign_config(args, scratch)
    from prefect import flow

    from evertrain.flows.campaign import campaign_flow
    from evertrain.runtime import get_runtime

    rt = get_runtime(config)
    _ = rt.base_model
    rt.ensure_started()  # one-time set-up (MLflow experiment, base model as version 1) outside the budget

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
        "base_checkpoint": str(rt.checkpoint(1)),
    }
    spent = completions = 0.0
    wall0 = time.perf_counter()
    while True:
        c0, w0 = tree_cpu_seconds(), time.perf_counter()
        [iteration] = campaign_flow(config, 1)
        flow_cpu, flow_wall = tree_cpu_seconds() - c0, time.perf_counter() - w0
        row = iteration_record(rt, iteration)
        row["flow_cpu_s"], row["flow_wall_s"] = flow_cpu, flow_wall
        row["orchestration_cpu_s"] = flow_cpu - sum(row["stage_cpu_s"].values())
        spent += row["train_cpu_s"]
        completions += row["completions"]
        row["cum_train_cpu_s"], row["cum_completions"] = spent, completions
        result["iterations"].append(row)
        result["checkpoints"].append({"label": f"iteration {iteration}", "iteration": iteration,
                                      "version": row["challenger_version"], "path": row["challenger_path"],
                                      "train_cpu_s": spent, "completions": completions})
        log(f"evertrain iteration {iteration}: train {row['train_cpu_s']:.0f} CPU-s (total {spent / 60:.1f} of "
            f"{budget / 60:.1f} CPU-min), eval+promote {row['eval_cpu_s']:.0f} CPU-s, orchestration "
            f"{row['orchestration_cpu_s']:.0f} CPU-s, {row['completions']} completions, "
            f"{row['skipped_zero_variance_groups']}/{row['groups']} groups without signal, "
            f"in-loop pass@1 {row['pass1_challenger_in_loop']:.3f}, promoted={row['promoted']}")
        out.write_text(json.dumps(result, indent=2, default=str))
        if spent + 0.5 * row["train_cpu_s"] >= budget or (args.max_completions and completions >= args.max_completions):
            break
    champion = result["iterations"][-1]["champion_version_after"]
    result.update(status="ok", train_cpu_s=spent, completions=completions, wall_s=time.perf_counter() - wall0,
                  final_checkpoint=result["checkpoints"][-1]["path"], champion_version=champion,
                  champion_checkpoint=str(rt.checkpoint(champion)))
    out.write_text(json.dumps(result, indent=2, default=str))


def iteration_record(rt: Any, iteration: int) -> dict[str, Any]:
    """What the store says about one finished iteration: stage CPU, rollouts, update, evaluation, decision."""
    stages = rt.store.query("SELECT stage, wall_s, cpu_s, metrics FROM stage_runs WHERE campaign = ? AND "
                            "iteration = ? AND status = 'completed'", [rt.campaign, iteration])
    cpu = {row.stage: float(row.cpu_s) for row in stages.itertuples(index=False)}
    wall = {row.stage: float(row.wall_s) for row in stages.itertuples(index=False)}
    metrics = {row.stage: json.loads(row.metrics) for row in stages.itertuples(index=False)}
    version = int(metrics["update"]["challenger_version"])
    evals = rt.store.query("SELECT avg(reward) AS pass1 FROM evals WHERE campaign = ? AND iteration = ? AND "
                           "model_version = ? AND sample = 0", [rt.campaign, iteration, version])
    decision = rt.store.query("SELECT promoted, champion_version, reason FROM promotions WHERE campaign = ? AND "
                              "iteration = ?", [rt.campaign, iteration]).iloc[0]
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
        "pass1_challenger_in_loop": float(evals["pass1"].iloc[0]),
        "promoted": promoted, "champion_version_after": version if promoted else int(decision["champion_version"]),
        "promotion_reason": str(decision["reason"]),
    }


# --- TRL: GRPOTrainer on its own ------------------------------------------------------------------------

def train_trl(args: argparse.Namespace, scratch: Path, out: Path, base_model: str) -> None:
    from evertrain.runtime import quiet_libraries

    quiet_libraries()
    config = campaign_config(args, scratch)
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from evertrain.models.policy import MANIFEST, load_tokenizer, set_threads

    set_threads(config.torch_threads)
    env = arithmetic_env(config)
    train = env.problems("train", env.count("train"), config.seed)  # the whole train pool, shuffled
    by_question = {p.prompt: p for p in train}
    budget = args.cpu_minutes * 60
    G = config.group_size
    every = args.trl_save_every
    snapshots = scratch / "trl" / "snapshots"
    result: dict[str, Any] = {"system": "trl", "status": "running", "budget_cpu_s": budget, "checkpoints": [],
                              "steps": [], "train_problems": len(train)}
    acc = {"generate_cpu_s": 0.0, "reward_cpu_s": 0.0, "snapshot_cpu_s": 0.0}
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
                                      "completions": step * TRL_COMPLETIONS_PER_STEP})
        out.write_text(json.dumps(result, indent=2, default=str))

    class Budget(TrainerCallback):
        """Stops training when the CPU budget is spent; snapshots the adapter every ``every`` steps."""

        def on_train_begin(self, args_: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start, self.last = cpu_seconds(), 0.0
            self.wall = time.perf_counter()

        def spent(self) -> float:
            return cpu_seconds() - self.start - acc["snapshot_cpu_s"]

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
        output_dir=str(scratch / "trl" / "output"), use_cpu=True, bf16=False, fp16=False,
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
    dataset = Dataset.from_list([{"prompt": env.messages(p), "question": p.prompt} for p in train])
    callback = Budget()
    trainer = GRPOTrainer(
        model=model, reward_funcs=[arithmetic_reward], args=grpo, train_dataset=dataset, processing_class=tokenizer,
        peft_config=LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                               target_modules=lora.target_modules, task_type="CAUSAL_LM"),
        callbacks=[callback],
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
    completions = steps * TRL_COMPLETIONS_PER_STEP
    result.update(
        status="ok", train_cpu_s=spent, completions=completions, wall_s=time.perf_counter() - wall0,
        update_steps=steps, final_checkpoint=result["checkpoints"][-1]["path"],
        generate_cpu_s=acc["generate_cpu_s"], reward_cpu_s=acc["reward_cpu_s"],
        update_cpu_s=spent - acc["generate_cpu_s"], snapshot_cpu_s=acc["snapshot_cpu_s"],
        groups=groups["groups"], zero_variance_groups=groups["zero_variance"],
        mean_reward=groups["rewards"] / max(groups["completions"], 1),
    )
    out.write_text(json.dumps(result, indent=2, default=str))


# --- evaluation: the same code for every checkpoint ---------------------------------------------------

class Evaluator:
    """Greedy pass@1 of checkpoints on the held-out problems, cached per checkpoint path, CPU-timed."""

    def __init__(self, config: Any, n: int, dtype: str, split: str = "test") -> None:
        import torch

        from evertrain.models.policy import set_threads

        set_threads(config.torch_threads)
        self.config, self.dtype = config, getattr(torch, dtype)
        self.env = arithmetic_env(config)
        # the sealed splits: neither evertrain's curation nor its gate ever sees them
        self.problems = self.env.sealed_problems(split, n, config.seed, gate=config.eval_size("arithmetic"))
        if not self.problems:
            raise RuntimeError(f"arithmetic has no sealed {split!r} split with these options")
        self.cache: dict[str, dict[str, Any]] = {}

    def __call__(self, checkpoint: str) -> dict[str, Any]:
        from evertrain.models.policy import read_manifest

        manifest = read_manifest(checkpoint)
        key = f"base:{manifest['base_model']}" if manifest["kind"] == "base" else str(Path(checkpoint).resolve())
        if key in self.cache:
            return self.cache[key]
        import numpy as np

        from evertrain.models.policy import encode_chat, load_policy, sample

        began, wall = cpu_seconds(), time.perf_counter()
        model, tokenizer = load_policy(checkpoint, dtype=self.dtype, device="cpu")
        prompts = [encode_chat(tokenizer, self.env.messages(p)) for p in self.problems]
        groups, _ = sample(model, tokenizer, prompts, 1, greedy=True,
                           max_new_tokens=self.config.max_new_tokens("arithmetic", evaluation=True),
                           batch_size=self.config.generation.batch_size)
        passed = np.array([self.env.verify(p, g[0].text).reward for p, g in zip(self.problems, groups, strict=True)])
        del model
        low, high = bootstrap_ci(passed)
        record = {"pass1": float(passed.mean()), "ci": [low, high], "passed": "".join(str(int(x)) for x in passed),
                  "eval_cpu_s": cpu_seconds() - began, "eval_wall_s": time.perf_counter() - wall}
        self.cache[key] = record
        log(f"evaluated {checkpoint}: pass@1 {record['pass1']:.3f} [{low:.3f}, {high:.3f}] "
            f"({record['eval_cpu_s']:.0f} CPU-s)")
        return record


def bootstrap_ci(values: Any, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """95% percentile bootstrap CI of the mean, resampling problems."""
    import numpy as np

    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(samples, len(values)))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def as_array(record: dict[str, Any]) -> Any:
    import numpy as np

    return np.array([int(c) for c in record["passed"]], dtype=float)


def summarize(name: str, before: dict[str, Any], after: dict[str, Any], train_cpu_s: float, completions: float,
              eval_cpu_s: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    diff = as_array(after) - as_array(before)
    gain = float(diff.mean())
    low, high = bootstrap_ci(diff)
    hours = train_cpu_s / 3600
    return {
        "system": name, "pass1_before": before["pass1"], "pass1_before_ci": before["ci"],
        "pass1_after": after["pass1"], "pass1_after_ci": after["ci"], "gain": gain, "gain_ci": [low, high],
        "train_cpu_min": train_cpu_s / 60, "completions": int(completions),
        "completions_per_cpu_s": completions / train_cpu_s if train_cpu_s else 0.0,
        "points_per_cpu_hour": 100 * gain / hours if hours else 0.0,
        "points_per_cpu_hour_ci": [100 * low / hours, 100 * high / hours] if hours else [0.0, 0.0],
        "eval_cpu_min": eval_cpu_s / 60, **(extra or {}),
    }


def curve(evaluate: Evaluator, base: dict[str, Any], checkpoints: list[dict[str, Any]]) -> list[dict[str, Any]]:
    points = [{"label": "base", "train_cpu_min": 0.0, "completions": 0, "pass1": base["pass1"], "ci": base["ci"]}]
    for c in checkpoints:
        r = evaluate(c["path"])
        points.append({"label": c["label"], "train_cpu_min": c["train_cpu_s"] / 60, "completions": c["completions"],
                       "pass1": r["pass1"], "ci": r["ci"], "eval_cpu_s": r["eval_cpu_s"]})
    return points


# --- the parent: run both, evaluate, report -----------------------------------------------------------

def run_worker(system: str, args: argparse.Namespace, scratch: Path, base_model: str) -> dict[str, Any]:
    out = scratch / f"{system}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--scratch", str(scratch),
               "--cpu-minutes", str(args.cpu_minutes), "--eval-problems", str(args.eval_problems),
               "--max-completions", str(args.max_completions), "--model", args.model,
               "--trl-save-every", str(args.trl_save_every), "--base-model", base_model,
               "--learning-rate", str(args.learning_rate), "--seed", str(args.seed)]
    if args.trl_gradient_checkpointing:
        command.append("--trl-gradient-checkpointing")
    env = {**os.environ, "EVERTRAIN_PROGRESS": "0"}
    if "PREFECT_API_URL" not in env:  # an ephemeral Prefect of our own: nothing written to the user's Prefect DB
        env["PREFECT_HOME"] = str(scratch / "prefect")
    log(f"training {system}: {' '.join(command[1:])}")
    began = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=str(ROOT), stdout=sys.stderr)  # stdout is the table's
    result = json.loads(out.read_text()) if out.exists() else {"system": system, "checkpoints": []}
    result["worker_wall_s"] = time.perf_counter() - began
    if proc.returncode != 0:
        result["status"] = "failed"
        result["error"] = f"worker exited with status {proc.returncode} (its traceback is on stderr above)"
        log(f"{system} failed: {result['error']}")
    return result


def plot(path: Path, curves: dict[str, list[dict[str, Any]]], budget_min: float, eval_problems: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = {"evertrain": ("tab:blue", "o"), "trl": ("tab:orange", "s")}
    for name, points in curves.items():
        if len(points) < 2:
            continue
        color, marker = styles.get(name, ("tab:gray", "x"))
        x = [p["train_cpu_min"] for p in points]
        y = [p["pass1"] for p in points]
        err = [[p["pass1"] - p["ci"][0] for p in points], [p["ci"][1] - p["pass1"] for p in points]]
        label = "evertrain (campaign flow)" if name == "evertrain" else "TRL GRPOTrainer"
        ax.errorbar(x, y, yerr=err, color=color, marker=marker, capsize=3, linewidth=1.5, markersize=4, label=label)
    ax.axvline(budget_min, color="gray", linestyle=":", linewidth=1, label=f"budget ({budget_min:g} CPU-min)")
    ax.set_xlabel("training CPU-minutes (generation + scoring + updates)")
    ax.set_ylabel(f"held-out pass@1 (greedy, {eval_problems} problems, 95% CI)")
    ax.set_title("SmolLM2-135M-Instruct on arithmetic: evertrain vs TRL, same budget")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt_ci(value: float, ci: list[float]) -> str:
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def fmt_gain(value: float, ci: list[float]) -> str:
    return f"{value:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"


def at_cpu(points: list[dict[str, Any]], minutes: float) -> dict[str, Any]:
    """The last curve point trained with at most ``minutes`` CPU-minutes."""
    eligible = [p for p in points if p["train_cpu_min"] <= minutes + 1e-9]
    return eligible[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-minutes", type=float, default=None,
                        help="training CPU budget per system, in CPU-minutes (default 15; --quick: 1)")
    parser.add_argument("--eval-problems", type=int, default=None,
                        help="held-out arithmetic problems (default 200; --quick: 40)")
    parser.add_argument("--max-completions", type=int, default=0,
                        help="also stop a system after this many sampled completions (0: the CPU budget alone)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 CPU-minute and 40 eval problems")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of evertrain,trl")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                        help="tiny: a few-hundred-thousand-parameter model, for checking the plumbing only")
    parser.add_argument("--eval-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="precision of the benchmark's own held-out evaluations (both systems)")
    parser.add_argument("--trl-save-every", type=int, default=5, help="TRL adapter snapshot every N steps")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="turn TRL's activation (gradient) checkpointing on; off by default: at this model size "
                        "memory is no constraint and recomputation only costs CPU")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="AdamW learning rate of both systems")
    parser.add_argument("--seed", type=int, default=0, help="campaign seed (evertrain) and trainer seed (TRL)")
    parser.add_argument("--scratch", help="scratch directory (default: a new temporary one)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--base-model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_minutes is None:
        args.cpu_minutes = 1.0 if args.quick else 15.0
    if args.eval_problems is None:
        args.eval_problems = 40 if args.quick else 200
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="vs-trl-")).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if args.worker:
        out = scratch / f"{args.worker}.json"
        if args.worker == "evertrain":
            train_evertrain(args, scratch, out)
        else:
            train_trl(args, scratch, out, args.base_model)
        return

    wall0 = time.perf_counter()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    from evertrain.runtime import quiet_libraries

    quiet_libraries()
    from benchmarks.common import print_table, save
    from evertrain.models.policy import resolve_base, write_base_checkpoint

    config = campaign_config(args, scratch)
    base_model = resolve_base(config.model)  # converted or built once, before anything is timed
    base_checkpoint = str(write_base_checkpoint(scratch / "base", base_model))
    log(f"scratch {scratch}; base model {base_model}; budget {args.cpu_minutes:g} CPU-min per system; "
        f"{args.eval_problems} held-out problems")
    settings = {
        **shared_settings(config), "cpu_minutes": args.cpu_minutes, "max_completions": args.max_completions,
        "eval_problems": args.eval_problems, "eval_dtype": args.eval_dtype, "eval_decoding": "greedy",
        "bootstrap_samples": BOOTSTRAP_SAMPLES, "bootstrap_seed": BOOTSTRAP_SEED, "model": args.model,
        "base_model": base_model, "budget_rule": "stop once spent + half the last unit's cost >= budget "
        "(unit: an evertrain iteration, a TRL step)",
        "evertrain": {"config": "configs/default.toml, arithmetic only (weight 1)",
                      "problems_per_iteration": config.problems_per_iteration,
                      "completions_per_iteration": config.problems_per_iteration * config.group_size,
                      "update": config.update.model_dump(mode="json"), "rollout_dtype": config.model.rollout_dtype,
                      "curation": config.curation.model_dump(mode="json"),
                      "promotion": config.promotion.model_dump(mode="json")},
        "trl": {"learning_rate": args.learning_rate, "lr_scheduler_type": "constant",
                "per_device_train_batch_size": TRL_COMPLETIONS_PER_STEP, "num_generations": config.group_size,
                "beta": 0.0, "loss_type": "default (dapo in TRL 1.16)", "bf16": False,
                "gradient_checkpointing": args.trl_gradient_checkpointing, "save_every_steps": args.trl_save_every},
        "design_md_trl_reference": "TRL 1.16 GRPOTrainer, SmolLM2-135M-Instruct, a bare 'What is a + b? Reply with "
        "only the number.' prompt, reward for the last number in the reply, 16 new tokens: 0.28 -> 0.585 held-out in "
        "40 steps, 15.4 CPU-minutes (about 119 points per CPU-hour); a different prompt and a looser grader than here",
    }
    payload: dict[str, Any] = {"settings": settings, "scratch": str(scratch), "systems": {}}

    busy0 = machine_busy_seconds()

    def checkpoint_save() -> None:
        payload["wall_s"] = time.perf_counter() - wall0
        own, busy = cpu_seconds(), machine_busy_seconds() - busy0
        # how much CPU the rest of the machine used meanwhile: the timings are clean only when this is small
        payload["contention"] = {"machine_busy_cpu_s": busy, "benchmark_cpu_s": own,
                                 "other_processes_cpu_s": busy - own, "loadavg_now": Path("/proc/loadavg").read_text()}
        save(RESULTS_NAME, payload)

    training = {}
    for system in systems:
        try:
            training[system] = run_worker(system, args, scratch, base_model)
        except Exception as error:  # the other system's results still count
            training[system] = {"system": system, "status": "failed", "checkpoints": [],
                                "error": "".join(traceback.format_exception_only(error)).strip()}
        payload["systems"][system] = {"training": training[system]}
        checkpoint_save()

    evaluate = Evaluator(config, args.eval_problems, args.eval_dtype, split="test")
    transfer = Evaluator(config, args.eval_problems, args.eval_dtype, split="transfer")
    base = evaluate(base_checkpoint)
    base_transfer = transfer(base_checkpoint)
    payload["base"] = {k: base[k] for k in ("pass1", "ci", "eval_cpu_s", "passed")}
    payload["base_transfer"] = {k: base_transfer[k] for k in ("pass1", "ci", "eval_cpu_s", "passed")}
    rows, curves = [], {}
    for system in systems:
        record, result = payload["systems"][system], training[system]
        try:
            if not result.get("checkpoints"):
                raise RuntimeError(f"{system} produced no checkpoint: {result.get('error', 'no error recorded')}")
            points = curve(evaluate, base, result["checkpoints"])
            curves[system] = record["curve"] = points
            final = evaluate(result["checkpoints"][-1]["path"])
            train_cpu = result["checkpoints"][-1]["train_cpu_s"]
            completions = result["checkpoints"][-1]["completions"]
            eval_cpu = sum(p.get("eval_cpu_s", 0.0) for p in points)
            if system == "evertrain":
                its = result["iterations"]
                loop_eval = sum(i["eval_cpu_s"] for i in its)
                orchestration = sum(i["orchestration_cpu_s"] for i in its)
                stage_totals = {s: sum(i["stage_cpu_s"].get(s, 0.0) for i in its) for s in (*TRAINING_STAGES,
                                                                                            *EVAL_STAGES)}
                extra = {"in_loop_eval_cpu_min": loop_eval / 60, "orchestration_cpu_min": orchestration / 60,
                         "stage_cpu_min": {k: v / 60 for k, v in stage_totals.items()},
                         "iterations": len(its), "update_steps": sum(i["update_steps"] for i in its),
                         "groups": sum(i["groups"] for i in its),
                         "zero_variance_groups": sum(i["skipped_zero_variance_groups"] for i in its),
                         "promotions": sum(i["promoted"] for i in its)}
                extra["points_per_cpu_hour_all_in"] = (
                    100 * (final["pass1"] - base["pass1"]) / ((train_cpu + loop_eval + orchestration) / 3600))
                summary = summarize("evertrain (last challenger)", base, final, train_cpu, completions, eval_cpu, extra)
                rows.append(summary)
                champion_checkpoint = result.get("champion_checkpoint")
                if champion_checkpoint:
                    champ = evaluate(champion_checkpoint)
                    champ_row = summarize(f"evertrain (champion v{result['champion_version']})", base, champ,
                                          train_cpu, completions, 0.0)
                    rows.append(champ_row)
                    record["champion"] = champ_row
            else:
                extra = {"setup_cpu_min": result.get("setup_cpu_s", 0.0) / 60,
                         "generate_cpu_min": result.get("generate_cpu_s", 0.0) / 60,
                         "update_cpu_min": result.get("update_cpu_s", 0.0) / 60,
                         "update_steps": result.get("update_steps"), "groups": result.get("groups"),
                         "zero_variance_groups": result.get("zero_variance_groups")}
                extra["points_per_cpu_hour_all_in"] = 100 * (final["pass1"] - base["pass1"]) / (train_cpu / 3600)
                summary = summarize("trl GRPOTrainer", base, final, train_cpu, completions, eval_cpu, extra)
                rows.append(summary)
            moved = as_array(transfer(result["checkpoints"][-1]["path"])) - as_array(base_transfer)
            summary["transfer_gain"], summary["transfer_gain_ci"] = float(moved.mean()), list(bootstrap_ci(moved))
            record["summary"] = summary
            record["evaluations"] = {c["path"]: {k: v for k, v in evaluate(c["path"]).items()}
                                     for c in result["checkpoints"]}
        except Exception as error:
            record["evaluation_error"] = "".join(traceback.format_exception_only(error)).strip()
            log(f"{system}: evaluation failed: {record['evaluation_error']}")
        checkpoint_save()

    if {"evertrain", "trl"} <= set(curves):
        matched = min(curves["evertrain"][-1]["train_cpu_min"], curves["trl"][-1]["train_cpu_min"])
        payload["matched_cpu"] = {"train_cpu_min": matched,
                                  **{s: at_cpu(curves[s], matched) for s in ("evertrain", "trl")}}
        ours = payload["systems"]["evertrain"].get("summary", {}).get("points_per_cpu_hour")
        theirs = payload["systems"]["trl"].get("summary", {}).get("points_per_cpu_hour")
        if ours is not None and theirs is not None:
            payload["bar"] = {"evertrain_points_per_cpu_hour": ours, "trl_points_per_cpu_hour": theirs,
                              "met": ours >= theirs}

    if rows:
        table = [{"system": r["system"], "pass@1 before [95% CI]": fmt_ci(r["pass1_before"], r["pass1_before_ci"]),
                  "pass@1 after [95% CI]": fmt_ci(r["pass1_after"], r["pass1_after_ci"]),
                  "gain [95% CI]": fmt_gain(r["gain"], r["gain_ci"]), "train CPU-min": r["train_cpu_min"],
                  "completions": r["completions"], "completions/CPU-s": r["completions_per_cpu_s"],
                  "points/CPU-hour": r["points_per_cpu_hour"], "eval CPU-min": r["eval_cpu_min"]} for r in rows]
        payload["table"] = rows
        print_table(table, list(table[0]))
    if "matched_cpu" in payload:
        m = payload["matched_cpu"]
        print(f"\nat matched training CPU ({m['train_cpu_min']:.1f} CPU-min): evertrain {m['evertrain']['pass1']:.3f} "
              f"({m['evertrain']['label']}), TRL {m['trl']['pass1']:.3f} ({m['trl']['label']})")
    if "bar" in payload:
        b = payload["bar"]
        print(f"bar (evertrain points/CPU-hour >= TRL's): {b['evertrain_points_per_cpu_hour']:.1f} vs "
              f"{b['trl_points_per_cpu_hour']:.1f}: {'met' if b['met'] else 'NOT met'}")
    if curves:
        from benchmarks.common import RESULTS

        RESULTS.mkdir(parents=True, exist_ok=True)
        png = RESULTS / f"{RESULTS_NAME}.png"
        plot(png, curves, args.cpu_minutes, args.eval_problems)
        payload["plot"] = str(png.relative_to(ROOT))
    checkpoint_save()
    log(f"saved benchmarks/results/{RESULTS_NAME}.json ({payload['wall_s'] / 60:.1f} min of wall time)")


if __name__ == "__main__":
    main()
