"""Concurrent requests answered together: one ``sample`` call of the in-house sampler for several requests.

The in-house sampler takes one call at a time (it uses every torch thread). Requests that arrive while a
call runs wait in a queue; when the call ends, everything waiting (up to ``serving.max_batch``) that can
share a call (the same loaded version, number of choices and sampling settings) is sampled in one call,
each prompt with its own seed, so a request's answer does not depend on which others shared its call.
No request waits for a batch to fill: a request that finds the sampler idle starts at once, alone.

A request's prompt, completion tokens and choices are its own; the call's time and prefix-cache savings
are shared among its requests in proportion to their tokens (what one request cost cannot be separated
inside a shared forward pass).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("evertrain.serving")


@dataclass
class Job:
    """One request's sampling: the loaded version it uses, its prompt and settings, and where the answer goes."""

    served: Any
    prompt: list[int]
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    greedy: bool
    seed: int
    stop_strings: tuple[str, ...]
    future: Future = field(default_factory=Future)

    def key(self) -> tuple[Any, ...]:
        return (id(self.served), self.n, self.max_new_tokens, self.temperature, self.top_p, self.greedy,
                self.stop_strings)


class Batcher:
    """A thread that runs queued sampling jobs, several compatible ones per ``sample`` call."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self.calls = 0
        self.jobs = 0
        self.largest = 0
        self._thread = threading.Thread(target=self._run, name="evertrain-batcher", daemon=True)
        self._thread.start()

    def sample(self, job: Job) -> tuple[list[Any], Any]:
        """(this job's samples, its share of the call's stats), once its call has run."""
        self._queue.put(job)
        return job.future.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        waiting: list[Job] = []
        while True:
            if not waiting:
                first = self._queue.get()
                if first is None:
                    return
                waiting.append(first)
            while True:  # everything queued meanwhile: no waiting for more
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._fail(waiting, RuntimeError("the endpoint is stopping"))
                    return
                waiting.append(job)
            key = waiting[0].key()
            batch = [j for j in waiting if j.key() == key][:self.max_batch]
            waiting = [j for j in waiting if j not in batch]
            self._call(batch)

    @staticmethod
    def _fail(jobs: list[Job], error: BaseException) -> None:
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)

    def _call(self, batch: list[Job]) -> None:
        from evertrain.inference.base import SamplingStats

        first = batch[0]
        try:
            groups, stats = first.served.sampler.sample(
                [j.prompt for j in batch], first.n, max_new_tokens=first.max_new_tokens,
                temperature=first.temperature, top_p=first.top_p, greedy=first.greedy, seed=first.seed,
                seeds=[j.seed for j in batch], stop_strings=first.stop_strings, batch_size=len(batch) * first.n)
        except BaseException as error:  # each request answers with the error, as it would have alone
            self._fail(batch, error)
            return
        self.calls += 1
        self.jobs += len(batch)
        self.largest = max(self.largest, len(batch))
        tokens = [len(j.prompt) * j.n + sum(len(s.completion_ids) for s in g) for j, g in zip(batch, groups,
                                                                                              strict=True)]
        total = max(sum(tokens), 1)
        prompt_total = max(sum(len(j.prompt) * j.n for j in batch), 1)
        for job, group, weight in zip(batch, groups, tokens, strict=True):
            share = SamplingStats(
                completion_tokens=sum(len(s.completion_ids) for s in group),
                cached_prompt_tokens=round(stats.cached_prompt_tokens * len(job.prompt) * job.n / prompt_total),
                forward_seconds=stats.forward_seconds * weight / total)
            share.prompt_tokens = len(job.prompt) * job.n - share.cached_prompt_tokens
            job.future.set_result((group, share))
