"""Running untrusted code: bubblewrap sandboxes with limits, and an audit record for every run.

- :mod:`.bwrap`: run Python or a command in a sandbox (:func:`run_python`, :func:`run_command`,
  :func:`run_group`); every run returns a :class:`SandboxRunRecord`, whose ``to_row()`` is a row of
  the ``sandbox_runs`` table. To see every record as it is made, set ``evertrain.sandbox.bwrap.audit_sink``.
- :mod:`.prelude`: the first code inside every sandbox (limits, the uid drop, a watchdog PID 1).
- :mod:`.plain`: the strict plain-data codec for values that cross between sandboxes.
- :mod:`.serve_candidate`, :mod:`.run_tests`: the two sides of the code grader
  (:func:`evertrain.envs.code.grade_code`).
"""

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
