"""Whole GRPO groups scored on a bounded pool of worker threads, each under a deadline.

`reward_num_workers` and `reward_worker_timeout_seconds` are MaxText's and Tunix's names. With
no workers (MaxText's default) a group is scored when it is submitted, in the caller's thread.
With workers, a group is scored as soon as it is submitted, while the caller goes on (decoding
the rest of the batch, when the engine streams); `results` waits for every group, in order.

Workers are threads: a reward that waits (a verifier, a sandbox, a remote call) overlaps with
the others and with decoding; a pure-Python reward holds the interpreter's lock while it runs.
A group whose rewards outlast the timeout ends the step with an error that names the group
(Tunix falls back to scoring it again in the parent process; here a reward that hangs once
would hang again). A thread cannot be stopped: the one left running is a daemon, so it cannot
hold the process.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from tunix_mcjax.rewards import RewardError


@dataclasses.dataclass
class _Group:
    """One submitted group: its name (for errors), its scoring call and what came of it."""

    name: str
    score: Callable[[], Any]
    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)
    start_time: float = 0.0
    end_time: float = 0.0
    value: Any = None
    error: BaseException | None = None

    def run(self) -> None:
        self.start_time = time.monotonic()
        self.started.set()
        try:
            self.value = self.score()
        except BaseException as e:  # handed to `results`, in the caller's thread
            self.error = e
        self.end_time = time.monotonic()
        self.finished.set()


def worker_count(reward_num_workers: int) -> int:
    """The pool's threads: -1 is one per CPU, as in MaxText and Tunix."""
    return (os.cpu_count() or 1) if reward_num_workers == -1 else reward_num_workers


class RewardPool:
    """Scores submitted groups on `workers` threads (0: in `submit`, in the caller's thread);
    a started group has `timeout_s` to finish."""

    def __init__(self, workers: int, timeout_s: float):
        self.workers, self.timeout_s = worker_count(workers), timeout_s
        self._queue: queue.Queue[_Group] = queue.Queue()
        self._pending: list[_Group] = []
        # (start, end) of each group the last `results` returned, in time.monotonic's seconds
        self.spans: list[tuple[float, float]] = []
        for i in range(self.workers):
            threading.Thread(target=self._work, name=f"reward-worker-{i}", daemon=True).start()

    def _work(self) -> None:
        while True:
            self._queue.get().run()

    def submit(self, name: str, score: Callable[[], Any]) -> None:
        """Scores one group: `score()` gives its scores; `name` says which group it is."""
        group = _Group(name, score)
        self._pending.append(group)
        if self.workers:
            self._queue.put(group)
        else:
            group.run()

    def results(self) -> list[Any]:
        """Every submitted group's scores, in submission order; the pool is empty after. The
        first error (a reward's `RewardError`, or a group past its deadline) is raised."""
        pending, self._pending = self._pending, []
        for group in pending:
            group.started.wait()  # the groups before it have deadlines: this wait is bounded
            left = group.start_time + self.timeout_s - time.monotonic()
            if self.workers and not group.finished.wait(max(left, 0.0)):
                raise RewardError(
                    f"the reward functions on {group.name} ran past "
                    f"reward_worker_timeout_seconds={self.timeout_s:g}: raise the key, or make "
                    "the reward return in time (a verifier's own timeout)")
            if group.error is not None:
                raise group.error
        self.spans = [(group.start_time, group.end_time) for group in pending]
        return [group.value for group in pending]


def seconds_within(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """The seconds of `spans` that fall in [start, end], summed (a span per group: with
    several workers, more than end - start)."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)
