"""Quiet third-party libraries: no telemetry, no hub calls, no progress bars (this machine has no internet).

Its own module, below everything that opens a process's libraries: the campaign context (evertrain.runtime)
and a Ray rollout worker (evertrain.cluster, which the context opens) both call it.
"""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    """No telemetry (nothing here reaches the internet), no hub calls, no per-file progress bars."""
    for key, value in {
        "DO_NOT_TRACK": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3",
        # Prefect waits 20 s for its ephemeral server by default: on 2 busy cores it took longer (a benchmark
        # worker failed "Timed out while attempting to connect to ephemeral Prefect API server")
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }.items():
        os.environ.setdefault(key, value)
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated.*")
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    try:
        # late: transformers (heavy) reads the settings above (HF_HUB_OFFLINE ...) when imported
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def quiet_prefect_console(level: str = "WARNING") -> None:
    """Prefect's INFO lines (flow and task runs created, finished) off the terminal; the Prefect UI keeps them:
    they reach its API through another handler. Both ways: the console handlers Prefect has already set up (where
    it was imported before) and every later set-up of its logging, in this process and the ones it starts, through
    Prefect's override ``PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL`` (a value the caller set is kept). Prefect sets its
    logging up again after import (a plain `evertrain run` showed every flow run's INFO lines when only the handlers
    of the moment were quieted)."""
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", level)
    # late: Prefect reads PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL (set above) when imported
    import prefect  # noqa: F401 - its logging set-up runs on import
    from prefect.logging.handlers import PrefectConsoleHandler

    level = os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"]
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.root.manager.loggerDict))]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler):
                handler.setLevel(level)
