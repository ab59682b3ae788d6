"""The step loop both modes share: a schedule's steps with hooks on them (as Levanter's
`Trainer.add_hook`).

Two call points, because the colocated mode forms a step's global record one step late (host 0
gets every host's numbers with the next step's exchange, `reporting.Reporter`):

- step hooks (`add_hook`) run on every host (every actor-driving process) right after each
  step: checkpoints, the profiler window, GC freezing. A stop (a preemption notice, SIGTERM to
  the DA driver) is checked at every step on every host; the step it arrives at runs every hook,
  then `stopped(step)` gives the exception that ends the run.
- record hooks (`add_record_hook`) run on the leader when a step's global record is formed
  (`record`): the export of steps.jsonl, TensorBoard and the progress line.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterable, Iterator

from tunix_mcjax.config import Config
from tunix_mcjax.profiler import StepProfiler
from tunix_mcjax.runtime.records import StepRecord


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """What a step hook is told: the step, the first step of this run (a resume's too), and
    whether it is the run's last step or a stop arrived at it."""

    step: int
    first: int
    last: bool
    stopping: bool


StepHook = Callable[[StepEnd], None]


class StepLoop:
    def __init__(self, steps: int, stop: Callable[[int], bool],
                 stopped: Callable[[int], BaseException]):
        """`stop(step)`: whether a stop arrived by the end of `step` (every host calls it at
        every step); `stopped(step)`: the exception raised once the step's hooks ran."""
        self.steps, self.stop, self.stopped = steps, stop, stopped
        self._start: list[Callable[[int], None]] = []
        self._hooks: list[tuple[StepHook, int]] = []
        self._record_hooks: list[Callable[[StepRecord], None]] = []

    def add_start_hook(self, hook: Callable[[int], None]) -> None:
        """`hook(step)` on every host before each step (the profiler's window opens there)."""
        self._start.append(hook)

    def add_hook(self, hook: StepHook, every: int = 1) -> None:
        """`hook(StepEnd)` on every host after each step whose count (step + 1) divides by
        `every`, after the run's last step, and after the step a stop arrives at."""
        if every < 1:
            raise ValueError(f"add_hook: every={every} must be at least 1")
        self._hooks.append((hook, every))

    def add_record_hook(self, hook: Callable[[StepRecord], None]) -> None:
        """`hook(StepRecord)` on the leader, on each global record, as `record` gets it."""
        self._record_hooks.append(hook)

    def record(self, rec: StepRecord) -> None:
        for hook in self._record_hooks:
            hook(rec)

    def end_step(self, first: int, step: int) -> None:
        """The step hooks due after `step`; raises `stopped(step)` when a stop arrived."""
        end = StepEnd(step, first, step == self.steps - 1, self.stop(step))
        for hook, every in self._hooks:
            if (step + 1) % every == 0 or end.last or end.stopping:
                hook(end)
        if end.stopping:
            raise self.stopped(step)

    def run(self, first: int, step: Callable[[int], None]) -> None:
        """Steps first..steps-1 of a per-host schedule (`step(step)`), with their hooks."""
        for t in range(first, self.steps):
            for hook in self._start:
                hook(t)
            step(t)
            self.end_step(first, t)

    def follow(self, first: int, records: Iterable[StepRecord]) -> Iterator[StepRecord]:
        """A schedule that yields global records (one driver, as DA's): each record's hooks
        (record hooks first), then the record."""
        for rec in records:
            self.record(rec)
            self.end_step(first, rec.step)
            yield rec


def add_host_hooks(loop: StepLoop, cfg: Config, save: Callable[[int], None],
                   profiler: StepProfiler | None = None, gc_freeze: bool = False) -> None:
    """Both modes' per-host hooks: the profiler's window (when given); checkpoints
    (`save(step)`, with enable_checkpointing) every checkpoint_period steps, at the last step and
    at a stop; O2's GC freeze after the first step (when `gc_freeze`)."""
    if profiler is not None:
        loop.add_start_hook(profiler.before_step)
        loop.add_hook(lambda end: profiler.after_step(end.step))
    if cfg.enable_checkpointing:
        loop.add_hook(lambda end: save(end.step), every=cfg.checkpoint_period)
    if gc_freeze:
        loop.add_hook(freeze_gc_after_first)


def freeze_gc_after_first(end: StepEnd) -> None:
    """O2's hook: `freeze_gc` after the run's first (warm-up) step."""
    if end.step == end.first:
        freeze_gc()


def freeze_gc() -> None:
    """O2: collect once, move survivors to the permanent generation, stop automatic GC."""
    gc.collect()
    gc.freeze()
    gc.disable()
