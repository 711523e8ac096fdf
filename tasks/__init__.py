"""The six stages. Each module holds a plain function ``stage(runtime, iteration) -> metrics`` that
does the work, and a thin Prefect task ``stage_task(runtime, iteration)`` around it: the flow opens the
campaign context (:class:`evertrain.runtime.Runtime`) once and passes it to every stage task."""

from evertrain.tasks.base import STAGES, run_stage
from evertrain.tasks.curate import curate, curate_task
from evertrain.tasks.evaluate import evaluate, evaluate_task
from evertrain.tasks.promote import promote, promote_task
from evertrain.tasks.rollout import rollout, rollout_task
from evertrain.tasks.score import score, score_task
from evertrain.tasks.update import update, update_task

STAGE_FUNCTIONS = {"curate": curate, "rollout": rollout, "score": score, "update": update,
                   "evaluate": evaluate, "promote": promote}
STAGE_TASKS = {"curate": curate_task, "rollout": rollout_task, "score": score_task, "update": update_task,
               "evaluate": evaluate_task, "promote": promote_task}

__all__ = ["STAGES", "STAGE_FUNCTIONS", "STAGE_TASKS", "run_stage"]
