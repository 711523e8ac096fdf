"""The CLI answers bad input without loading the training stack: a typo in a config path or a setting is
reported in a couple of CPU-seconds, not after torch and Prefect are imported (about 6 before); a Ray grading
task's worker process does not import the training stack either."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

PROBE = """
import sys
from evertrain.cli import main
status = main(sys.argv[1:])
print(status, sorted(m for m in ("torch", "prefect") if m in sys.modules))
"""


def _probe(*argv: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    return done.stdout.strip(), done.stderr


def test_a_bad_config_path_is_refused_with_status_2_and_no_training_imports(tmp_path):
    out, err = _probe("run", "--config", str(tmp_path / "no-such.toml"))
    assert out == "2 []", (out, err)
    assert "evertrain: error:" in err and "no-such.toml" in err and "Traceback" not in err


def test_a_bad_setting_is_refused_with_status_2_and_no_training_imports():
    out, err = _probe("run", "--config", "configs/smoke.toml", "--set", "update.learning_rate=-1")
    assert out == "2 []", (out, err)
    assert "learning_rate" in err and "Traceback" not in err


def test_a_ray_grading_task_s_module_loads_no_training_stack():
    """A grading task on a Ray cluster runs ``evertrain.cluster._grade`` in a Ray worker process, which imports
    that module first: it must not bring torch, transformers or peft (about 6 CPU-seconds a worker process,
    paid in every Ray worker that grades), only what grading uses."""
    done = subprocess.run([sys.executable, "-c", "import sys, evertrain.cluster\n"
                           "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "[]", (done.stdout, done.stderr)
