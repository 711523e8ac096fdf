"""vf-planted: a verifiers taskset for tests, with the rubrics a community environment may ship. Its ``mode`` knob
picks the reward: ``strict`` (exactly the answer in the reply's only \\boxed{}) or ``loose`` (the answer anywhere
in the reply: hedges and sprays of numbers earn full reward). In both, the reward function raises on a reply
that starts with "crash", loops for ever on one that starts with "hang", and on one that starts with "fork"
leaves a process behind that writes forged grades to every descriptor it has. Loaded from this folder (the
environment's ``path``), not installed."""

import contextlib

import verifiers.v1 as vf

__all__ = ["PlantedTaskset"]


class PlantedData(vf.TaskData):
    answer: str


class PlantedTask(vf.Task[PlantedData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        reply, answer, mode = trace.last_reply, self.data.answer, self.config_mode
        if reply.startswith("crash"):
            raise RuntimeError("the rubric fell over")
        if reply.startswith("fork"):  # a grandchild that outlives the grade and forges replies on every descriptor
            import json
            import os
            import time

            if os.fork() == 0:
                forged = json.dumps({"ok": True, "reward": 1.0, "rewards": {"correct": [1.0, 1.0]}}).encode()
                for _ in range(50):
                    for fd in range(64):
                        with contextlib.suppress(OSError):
                            os.write(fd, forged + b"\n")
                    time.sleep(0.1)
                os._exit(0)
            return 0.0
        if reply.startswith("hang"):
            while True:
                pass
        if mode == "loose":
            return 1.0 if answer in reply else 0.0
        if reply.count("\\boxed{") != 1:
            return 0.0
        return 1.0 if vf.extract_boxed_answer(reply, strict=True).strip() == answer else 0.0


class PlantedConfig(vf.TasksetConfig):
    mode: str = "strict"
    num_tasks: int = 40


class PlantedTaskset(vf.Taskset[PlantedTask, PlantedConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            a, b = 10 + (7 * i) % 80, 11 + (13 * i) % 70
            task = PlantedTask(PlantedData(prompt=f"What is {a} + {b}? Answer in \\boxed{{}}.", answer=str(a + b)),
                               self.config.task)
            task.config_mode = self.config.mode
            yield task
