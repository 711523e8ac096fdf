"""Concurrent requests answered together: one ``sample`` call of the in-house sampler for several requests.

The in-house sampler takes one call at a time (it uses every torch thread). Requests that arrive while a
call runs wait in a queue; when the call ends, everything waiting (up to ``serving.max_batch``) that can
share a call (the same loaded version, number of choices and sampling settings) is sampled in one call,
each prompt with its own seed, so a request's answer does not depend on which others shared its call.
No request waits for a batch to fill: a request that finds the sampler idle starts at once, alone.

Admission is shortest first: when a call ends, the next one is for the waiting request that asks for the fewest
tokens (``max_tokens`` x ``n``), so a small request waits for at most the call already running, not for every
large request queued before it; a request that has waited ``max_wait`` seconds (``serving.fair_wait_seconds``)
goes next whatever its size, so large ones are not starved.

A request's prompt, completion tokens and choices are its own; the call's time and prefix-cache savings
are shared among its requests in proportion to their tokens (what one request cost cannot be separated
inside a shared forward pass).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from evertrain.inference.base import SamplingStats

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
    queued_at: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        """What admission orders by: the completion tokens it may take."""
        return self.max_new_tokens * self.n

    def key(self) -> tuple[Any, ...]:
        return (id(self.served), self.n, self.max_new_tokens, self.temperature, self.top_p, self.greedy,
                self.stop_strings)


class Batcher:
    """A thread that runs queued sampling jobs, several compatible ones per ``sample`` call."""

    def __init__(self, max_batch: int, max_wait: float = 30.0) -> None:
        self.max_batch, self.max_wait = max_batch, max_wait
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._waiting: list[Job] = []
        # each call: (when it started, its jobs' sizes, the sizes still waiting): how admission chose
        self.history: list[tuple[float, list[int], list[int]]] = []
        self.calls = 0
        self.jobs = 0
        self.largest = 0
        self._thread = threading.Thread(target=self._run, name="evertrain-batcher", daemon=True)
        self._thread.start()

    def sample(self, job: Job) -> tuple[list[Any], Any]:
        """(this job's samples, its share of the call's stats), once its call has run."""
        self._queue.put(job)
        return job.future.result()

    def pending(self) -> int:
        """Jobs queued and not yet in a call."""
        return self._queue.qsize() + len(self._waiting)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        waiting = self._waiting
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
            batch = self._next(waiting)
            waiting[:] = [j for j in waiting if j not in batch]
            self.history.append((time.monotonic(), [j.size for j in batch], [j.size for j in waiting]))
            del self.history[:-1000]
            self._call(batch)

    def _next(self, waiting: list[Job]) -> list[Job]:
        """The next call's jobs: the oldest's if it waited ``max_wait``, else the smallest's (ties: the oldest);
        every waiting job that can share its call, oldest first, up to ``max_batch``."""
        oldest = waiting[0]
        first = oldest if time.monotonic() - oldest.queued_at >= self.max_wait else \
            min(waiting, key=lambda j: (j.size, j.queued_at))
        key = first.key()
        return [first, *[j for j in waiting if j is not first and j.key() == key]][:self.max_batch]

    @staticmethod
    def _fail(jobs: list[Job], error: BaseException) -> None:
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)

    def _call(self, batch: list[Job]) -> None:
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
