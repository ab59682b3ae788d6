"""`profiler=xplane`: a JAX profiler trace per host over MaxText's profiled steps.

As MaxText's `Profiler`: the trace starts at step `start + skip_first_n_steps_for_profiler` (the
run's first step, a resume's too) and ends after `profiler_steps` steps, or the last step.
Unlike MaxText (host 0 unless upload_all_profiler_results), every host traces its own process,
into `<run dir>/tensorboard/host_<h>` (TensorBoard's profile plugin reads it from there).
"""

from __future__ import annotations

import jax

from tunix_mcjax.config import Config


class StepProfiler:
    def __init__(self, cfg: Config, host: int, start_step: int):
        self.enabled = cfg.profiler == "xplane"
        self.first = start_step + cfg.skip_first_n_steps_for_profiler
        self.last = min(self.first + cfg.profiler_steps - 1, cfg.steps - 1)
        self.directory = cfg.run_dir / "tensorboard" / f"host_{host}"
        self.active = False

    def before_step(self, step: int) -> None:
        if self.enabled and step == self.first:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after_step(self, step: int) -> None:
        if self.active and step >= self.last:
            self.close()

    def close(self) -> None:
        """Ends a running trace (also when the run stops early) and writes it."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
