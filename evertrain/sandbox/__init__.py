"""Running untrusted code: bubblewrap sandboxes with limits and an audit record for every run."""

from evertrain.sandbox.bwrap import (
    Job,
    Limits,
    SandboxRunRecord,
    SandboxUnavailable,
    check_available,
    run_command,
    run_group,
    run_python,
)

__all__ = ["Job", "Limits", "SandboxRunRecord", "SandboxUnavailable", "check_available", "run_command",
           "run_group", "run_python"]
