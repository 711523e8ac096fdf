"""Shared by the benchmarks: where results go and what machine made them."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """The machine a number was measured on."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    import torch

    from evertrain.models.precision import cpu_supports_bf16  # which precision samples faster depends on it

    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)), "memory_gib": memory_gib, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "gpu": torch.cuda.get_device_name(0)
            if torch.cuda.is_available() else None, "cpu_bfloat16_native": cpu_supports_bf16()}


def machine_cpu() -> dict[str, float]:
    """The machine's CPU time since boot in seconds, every process's (``/proc/stat``'s first line): ``busy`` (user,
    nice, system, irq, softirq), ``idle`` (idle and iowait), ``steal`` (taken by the host). Guest time is inside
    user already and is not counted again. NaN each where there is no /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return {"busy": float("nan"), "idle": float("nan"), "steal": float("nan")}
    fields += [0] * (8 - len(fields))
    tick = os.sysconf("SC_CLK_TCK")
    idle, steal = fields[3] + fields[4], fields[7]
    return {"busy": (sum(fields) - idle - steal) / tick, "idle": idle / tick, "steal": steal / tick}


def save(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` with the command line, machine and date to benchmarks/results/<name>.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": datetime.now(UTC).isoformat(),
              "machine": machine(), **payload}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A plain aligned table on stdout."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
        return str(value)

    widths = {c: max(len(c), *(len(cell(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(cell(row.get(c, "")).rjust(widths[c]) for c in columns))


def tiny_campaign(prefix: str, name: str, environment: str) -> tuple[Path, dict[str, Any]]:
    """A scratch folder holding the tests' tiny model (built from a config) and configs/smoke.toml as a JSON-ready
    dict for campaign ``name`` on ``environment``, every path under that folder: what the serving benchmarks run."""
    import tempfile

    from evertrain.config import load_config
    from evertrain.models.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix=prefix))
    build_tiny_model(root / "models" / "tiny-llama")
    data = load_config(Path(__file__).resolve().parents[1] / "configs" / "smoke.toml").model_dump(mode="json")
    data.update(name=name, torch_threads=1, environments=[{"name": environment, "weight": 1}])
    data["model"]["models_dir"] = str(root / "models")
    data["paths"] = {"store": f"ducklake:sqlite:{root / 'evertrain.sqlite'}",
                     "mlflow_uri": f"sqlite:///{root / 'mlflow' / 'mlflow.db'}",
                     "artifacts": str(root / "mlflow" / "artifacts"), "checkpoints": str(root / "checkpoints")}
    return root, data
