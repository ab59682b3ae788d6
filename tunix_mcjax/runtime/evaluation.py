"""Evaluation during a run, on MaxText's schedule, aggregated over all hosts.

MaxText's RL trainer evaluates before training, every `eval_interval` steps (after the step
whose count of finished steps divides by it) and after training, when `num_test_batches > 0`;
with `eval_schedule=tunix`, as Tunix's learner: at every such count, 0 included, but the last.
Here each host scores its own share of the evaluation prompts on its own engine (an
`Evaluator`, e.g. the MaxText adapter's, which scores with MaxText's `evaluate_rl`), and one
tiny all-gather sums the hosts' counts into the global result every host then holds.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from tunix_mcjax import topology
from tunix_mcjax.config import Config, ConfigError
from tunix_mcjax.engine import Engine

# What each host sends: sums over its evaluation prompts, in this order.
SUM_FIELDS = ("corr", "partially_corr", "corr_format", "total", "reward_sum", "reward_count")


class Evaluator(Protocol):
    mode: str  # what the scores mean (MaxText's eval_mode: pass, maj, pass_at_1)

    def local_sums(self, engine: Engine, seed: int) -> np.ndarray:
        """SUM_FIELDS over this host's share of the evaluation prompts, as float64."""


def eval_seed(seed: int, steps_done: int, host: int) -> int:
    """A sampling seed per (run seed, evaluation point, host), apart from the rollout seeds."""
    return int(np.random.SeedSequence([seed, 0xE7A1, steps_done, host]).generate_state(1)[0]
               >> 1)


def global_result(per_host: np.ndarray) -> dict[str, float]:
    """MaxText's evaluation numbers (percentages, as its `evaluate` returns them) from every
    host's sums ([num_hosts, len(SUM_FIELDS)])."""
    s = dict(zip(SUM_FIELDS, per_host.sum(axis=0).tolist(), strict=True))
    total = s["total"]

    def pct(key: str) -> float:
        return s[key] / total * 100 if total > 0 else 0.0

    return {
        "corr": s["corr"], "total": int(total), "accuracy": pct("corr"),
        "partial_accuracy": pct("partially_corr"), "format_accuracy": pct("corr_format"),
        "mean_reward": s["reward_sum"] / s["reward_count"] if s["reward_count"] > 0 else 0.0,
    }


class EvalSchedule:
    """When to evaluate, and the global result of each evaluation."""

    def __init__(self, cfg: Config, evaluator: Evaluator | None, topo: topology.Topology,
                 watchdog: topology.Watchdog):
        if cfg.num_test_batches > 0 and evaluator is None:
            raise ConfigError(
                f"num_test_batches={cfg.num_test_batches}: evaluation needs an evaluator, which "
                "the MaxText adapter builds from MaxText's eval_* keys; set num_test_batches=0 "
                "for this recipe.")
        self.cfg, self.topo, self.watchdog = cfg, topo, watchdog
        self.evaluator = evaluator if cfg.num_test_batches > 0 else None
        self._pending: dict[str, Any] = {}
        self._compiled = False

    def before_training(self, engine: Engine, start_step: int) -> None:
        """MaxText's pre-training evaluation (also on resume); kept for the first step's record.
        eval_schedule=tunix: only when the finished steps divide by eval_interval (Tunix's)."""
        tunix_skips = (self.cfg.eval_schedule == "tunix"
                       and start_step % max(self.cfg.eval_interval, 1) != 0)
        if self.evaluator is not None and not tunix_skips:
            self._pending["pre"] = self.evaluate(engine, start_step)

    def after_step(self, step: int, engine: Engine) -> dict[str, Any]:
        """{"eval": {label: result}} for the evaluations due after `step` (plus a pending
        pre-training one), or {} when none is."""
        if self.evaluator is None:
            return {}
        done = step + 1
        interval = self.cfg.eval_interval
        # eval_schedule=tunix: Tunix's learner evaluates before a step, so not after the last.
        after_last = self.cfg.eval_schedule == "maxtext"
        if interval > 0 and done % interval == 0 and (done < self.cfg.steps or after_last):
            self._pending["intermediate"] = self.evaluate(engine, done)
        if done == self.cfg.steps and after_last:
            self._pending["post"] = self.evaluate(engine, done)
        out, self._pending = ({"eval": self._pending} if self._pending else {}), {}
        return out

    def evaluate(self, engine: Engine, steps_done: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        local = self.evaluator.local_sums(
            engine, eval_seed(self.cfg.seed, steps_done, self.topo.host))
        # The first evaluation may compile (new sampling settings) on a slower host.
        with self.watchdog.guard("eval", compiles=not self._compiled):
            per_host = topology.allgather(np.asarray(local, np.float64))
        self._compiled = True
        return {"steps_done": steps_done, "mode": self.evaluator.mode,
                **global_result(per_host), "eval_s": time.perf_counter() - t0}


def eval_lines(record: dict) -> list[str]:
    """Progress lines for the evaluations in a step record."""
    return [f"eval {label:<12} after {r['steps_done']:4d} steps | {r['mode']} accuracy "
            f"{r['accuracy']:.2f}% | partial {r['partial_accuracy']:.2f}% | format "
            f"{r['format_accuracy']:.2f}% | reward {r['mean_reward']:.3f} | {r['total']} prompts"
            f" | {r['eval_s']:.2f}s"
            for label, r in record.get("eval", {}).items()]


def summary_fields(records: list[dict]) -> dict[str, Any]:
    """summary.json's evaluation entries: every evaluation of the run, in order."""
    evals = [{"when": label, **r} for rec in records for label, r in rec.get("eval", {}).items()]
    return {"eval": evals} if evals else {}
