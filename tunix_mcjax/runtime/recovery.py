"""Run-level recovery policy: checkpoints and resume, preemption, non-finite steps.

- Checkpoints (`RunState`): every Orbax call that waits on other hosts runs under the watchdog;
  a resume checks the config fingerprint and falls back past an unreadable newest checkpoint.
- Preemption: SIGTERM on any host (JAX's preemption notice) makes every host save at the same
  step boundary, agreed through JAX's preemption sync, then exit 143 (`Preempted`).
- Non-finite steps (`NonFinitePolicy`): the trainer never applies a non-finite update (its
  `finite` metric is 0.0); by default the run then stops, keeping the last good checkpoint;
  `max_nonfinite_steps=N` skips up to N such steps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from tunix_mcjax import topology
from tunix_mcjax.config import Config
from tunix_mcjax.train.checkpoint import Checkpointer


class Preempted(Exception):
    """Every host saved (when checkpointing is on) after a preemption notice; exit 143."""


class NonFiniteError(RuntimeError):
    """Too many steps with a non-finite loss or gradient norm; none of them was applied."""


class RunState:
    """The run's checkpoints: restore at start, periodic and preemption saves, close."""

    def __init__(self, cfg: Config, watchdog: topology.Watchdog, is_leader: bool):
        self.cfg, self.watchdog, self.is_leader = cfg, watchdog, is_leader
        self.checkpointer: Checkpointer | None = None
        self.last_saved: int | None = None
        if cfg.enable_checkpointing:
            with watchdog.guard("checkpoint manager"):
                self.checkpointer = Checkpointer(cfg.checkpoint_dir,
                                                 cfg.max_num_checkpoints_to_keep)

    def restore(self, like: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
        """(first step to run, restored state or None)."""
        if self.checkpointer is None or self.checkpointer.latest_step() is None:
            return 0, None
        with self.watchdog.guard("restore", compiles=True):
            found = self.checkpointer.restore_latest(like, self.cfg)
        if found is None:
            return 0, None
        step, state = found
        self.last_saved = step
        if self.is_leader:
            print(f"resumed from {self.cfg.checkpoint_dir} step {step}", flush=True)
        return step + 1, state

    def due(self, step: int) -> bool:
        cfg = self.cfg
        return step == cfg.steps - 1 or (step + 1) % cfg.checkpoint_period == 0

    def save(self, step: int, state_fn: Callable[[], dict[str, Any]]) -> None:
        if self.checkpointer is None or self.last_saved == step:
            return
        with self.watchdog.guard("checkpoint"):
            self.checkpointer.save(step, state_fn(), self.cfg)
        self.last_saved = step

    def describe_last(self) -> str:
        if self.checkpointer is None:
            return "checkpointing is off (enable_checkpointing=true keeps one)"
        if self.last_saved is None:
            return f"no checkpoint was saved yet in {self.cfg.checkpoint_dir}"
        return f"the last good checkpoint is step {self.last_saved} in {self.cfg.checkpoint_dir}"

    def close(self) -> None:
        if self.checkpointer is not None:
            with self.watchdog.guard("checkpoint close"):
                self.checkpointer.close()
            self.checkpointer = None


class NonFinitePolicy:
    """Counts steps the trainer did not apply; stops past `max_nonfinite_steps`."""

    def __init__(self, max_steps: int):
        self.max_steps, self.count = max_steps, 0

    def applied(self, step: int, train_metrics: dict[str, float], last_checkpoint: str) -> bool:
        """True when the step's update was applied; counts (or stops on) one that was not."""
        if train_metrics.get("finite", 1.0) == 1.0:
            return True
        self.count += 1
        what = (f"step {step}: loss={train_metrics.get('loss')} grad_norm="
                f"{train_metrics.get('grad_norm')} is not finite; the update was not applied")
        if self.count > self.max_steps:
            raise NonFiniteError(
                f"{what}. Stopping ({self.count} non-finite steps, max_nonfinite_steps="
                f"{self.max_steps}); {last_checkpoint}. Lower learning_rate or check the "
                "rewards, or set max_nonfinite_steps=N to skip up to N such steps.")
        print(f"{what}; skipped ({self.count} of max_nonfinite_steps={self.max_steps})",
              file=sys.stderr, flush=True)
        return False


def train_state(trainer: Any, history: Any, nonfinite: NonFinitePolicy,
                **extra: np.ndarray) -> dict[str, Any]:
    """What a resume needs: the trainer state, O3's output-length history (kept whatever the
    flags, so they may change), and the count of skipped non-finite steps; `extra`: a mode's
    own entries (DA's batch in flight)."""
    return {"params": trainer.params, "opt_state": trainer.opt_state,
            "output_len": history.state(),
            "nonfinite_steps": np.array(nonfinite.count, np.int32), **extra}


def restore(state: RunState, trainer: Any, history: Any, nonfinite: NonFinitePolicy,
            **extra: np.ndarray) -> tuple[int, dict[str, np.ndarray]]:
    """Resumes from the newest readable checkpoint in the run directory: (the first step, the
    `extra` entries it holds). An `extra` value is a placeholder: numpy entries restore at their
    saved shape."""
    first, saved = state.restore(train_state(trainer, history, nonfinite, **extra))
    if saved is None:
        return first, {}
    trainer.params, trainer.opt_state = saved["params"], saved["opt_state"]
    if "output_len" in saved:
        history.load(saved["output_len"])
    nonfinite.count = int(saved.get("nonfinite_steps", 0))
    return first, {k: saved[k] for k in extra if k in saved}


def preempted(host: int, step: int, state: RunState) -> Preempted:
    """The notice's exception, once every host saved; the run state is closed."""
    message = (f"host {host}: preemption notice (SIGTERM) at step {step}; "
               f"{state.describe_last()}. Rerun the same command to resume.")
    state.close()
    return Preempted(message)
