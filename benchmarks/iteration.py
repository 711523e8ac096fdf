"""Where one iteration of the default campaign spends its time.

Runs iteration 0 of configs/default.toml (SmolLM2-135M-Instruct) through the real Prefect flow in a
scratch directory, then prints each stage's wall and CPU seconds, the seconds spent in model compute
(sampling, forward/backward), and the share of the iteration spent outside model compute:
orchestration (Prefect), tracking (MLflow), storage (DuckDB), grading and loading.

    .venv/bin/python benchmarks/iteration.py [--config configs/default.toml]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    parser.add_argument("--name", default="iteration")
    args = parser.parse_args()
    os.environ.setdefault("EVERTRAIN_PROGRESS", "0")
    from evertrain.quiet import quiet_libraries

    quiet_libraries()
    from evertrain.config import load_config

    scratch = Path(tempfile.mkdtemp(prefix="evertrain-bench-"))
    config = load_config(args.config)
    data = config.model_dump()
    data["model"]["models_dir"] = str(ROOT / "models")  # reuse the converted model
    data["paths"] = {"store": str(scratch / "store.duckdb"), "mlflow_uri": f"sqlite:///{scratch / 'mlflow.db'}",
                     "artifacts": str(scratch / "artifacts"), "checkpoints": str(scratch / "checkpoints")}
    config = type(config).model_validate(data)

    from benchmarks.common import print_table, save
    from evertrain.flows.campaign import campaign_flow
    from evertrain.runtime import Runtime

    with Runtime.open(config) as rt:  # closed before the flow opens its own
        _ = rt.base_model  # conversion happens once, outside the measurement
    wall0, cpu0 = time.perf_counter(), time.process_time()
    campaign_flow(config, 1)
    total_wall, total_cpu = time.perf_counter() - wall0, time.process_time() - cpu0

    with Runtime.open(config) as rt:
        frame = rt.store.query("SELECT stage, wall_s, cpu_s, metrics FROM stage_runs WHERE iteration = 0")
    order = ["curate", "rollout", "score", "update", "evaluate", "promote"]
    rows = []
    for stage in order:
        row = frame[frame["stage"] == stage].iloc[0]
        metrics = json.loads(row["metrics"])
        model_s = float(metrics.get("model_s", 0.0)) + float(metrics.get("challenger_model_s", 0.0)) + \
            float(metrics.get("champion_model_s", 0.0))
        rows.append({"stage": stage, "wall_s": float(row["wall_s"]), "cpu_s": float(row["cpu_s"]),
                     "model_s": model_s, "outside_model_share": 1 - model_s / max(float(row["wall_s"]), 1e-9)})
    stage_wall = sum(r["wall_s"] for r in rows)
    model_wall = sum(r["model_s"] for r in rows)
    rows.append({"stage": "orchestration (flow, outside stages)", "wall_s": total_wall - stage_wall,
                 "cpu_s": float("nan"), "model_s": 0.0, "outside_model_share": 1.0})
    rows.append({"stage": "iteration total", "wall_s": total_wall, "cpu_s": total_cpu, "model_s": model_wall,
                 "outside_model_share": 1 - model_wall / total_wall})
    print_table(rows, ["stage", "wall_s", "cpu_s", "model_s", "outside_model_share"])
    path = save(args.name, {"config": args.config, "stages": rows,
                            "outside_model_share": 1 - model_wall / total_wall})
    print(f"\nsaved {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
