"""Does async mode (rollouts of iteration i+1 beside the update of i) beat sync on this machine?

Runs the same short campaign twice, sync and async (max_staleness 1), through the real Prefect flow in
scratch directories, and compares wall and CPU time per iteration and completions per wall-second.
On a 2-core CPU both modes compete for the same cores, so async can only win by filling idle gaps;
on a GPU box with separate rollout and training devices it is the mode to use.

    .venv/bin/python benchmarks/async_vs_sync.py [--iterations 3] [--config configs/default.toml]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(mode: str, config_path: str, iterations: int) -> dict[str, float]:
    from evertrain.config import load_config
    from evertrain.flows.campaign import campaign_flow
    from evertrain.runtime import Runtime

    scratch = Path(tempfile.mkdtemp(prefix=f"evertrain-{mode}-"))
    data = load_config(config_path).model_dump()
    data["name"] = f"bench-{mode}"
    data["environments"] = [{"name": "arithmetic", "weight": 1, "max_new_tokens": 24}]
    data["eval"]["problems_per_env"] = 50
    data["promotion"]["futility"] = 0.0  # the same evaluation work in both modes, whatever the challengers do
    data["model"]["models_dir"] = str(ROOT / "models")
    data["update"].update(mode=mode, max_staleness=1 if mode == "async" else 0)
    data["paths"] = {"store": str(scratch / "store.duckdb"), "mlflow_uri": f"sqlite:///{scratch / 'mlflow.db'}",
                     "artifacts": str(scratch / "artifacts"), "checkpoints": str(scratch / "checkpoints")}
    config = type(load_config(config_path)).model_validate(data)
    with Runtime.open(config) as rt:  # closed before the flow opens its own
        _ = rt.base_model
    t = os.times()
    cpu0, wall0 = t.user + t.system + t.children_user + t.children_system, time.perf_counter()
    campaign_flow(config, iterations)
    wall = time.perf_counter() - wall0
    t = os.times()
    cpu = t.user + t.system + t.children_user + t.children_system - cpu0
    with Runtime.open(config) as rt:
        completions = int(rt.store.scalar("SELECT count(*) FROM rollouts WHERE iteration < ?", [iterations]))
        pass1 = rt.store.query(
            "SELECT iteration, json_extract(metrics, '$.pass1_challenger')::DOUBLE AS p FROM stage_runs "
            "WHERE stage = 'evaluate' ORDER BY iteration")["p"].tolist()
    return {"mode": mode, "iterations": iterations, "wall_s": wall, "cpu_s": cpu,
            "wall_s_per_iteration": wall / iterations, "cpu_s_per_iteration": cpu / iterations,
            "completions": completions, "completions_per_wall_s": completions / wall,
            "last_pass1_challenger": pass1[-1] if pass1 else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.toml"))
    args = parser.parse_args()
    os.environ.setdefault("EVERTRAIN_PROGRESS", "0")
    from evertrain.quiet import quiet_libraries

    quiet_libraries()
    from benchmarks.common import print_table, save

    rows = [run(mode, args.config, args.iterations) for mode in ("sync", "async")]
    print_table(rows, ["mode", "iterations", "wall_s", "cpu_s", "wall_s_per_iteration", "completions_per_wall_s",
                       "last_pass1_challenger"])
    faster = min(rows, key=lambda r: r["wall_s_per_iteration"])["mode"]
    print(f"\nfaster on this machine: {faster}")
    path = save("async_vs_sync", {"rows": rows, "faster": faster})
    print(f"saved {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
