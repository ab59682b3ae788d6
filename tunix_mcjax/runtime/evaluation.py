"""Evaluation during a run, on MaxText's schedule, aggregated over all hosts.

MaxText's RL trainer evaluates before training, every `eval_interval` steps (after the step
whose count of finished steps divides by it) and after training, when `num_test_batches > 0`;
with `eval_schedule=tunix`, as Tunix's learner: at every such count, 0 included, but the last.
Here each host scores its own share of the evaluation prompts on its own engine (an
`Evaluator`: the MaxText adapter's, which scores with MaxText's `evaluate_rl`, the Tunix
adapter's, or `TaskEvaluator` on the built-in task's held-out prompts), and one tiny all-gather
sums the hosts' counts into the global result every host then holds. Under rl_runtime=mcjax_da
the rollout actors are the hosts and the driver sums their results (`EvalSchedule` is the same).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from tunix_mcjax import rewards, topology
from tunix_mcjax.config import Config, ConfigError
from tunix_mcjax.engine import Engine
from tunix_mcjax.runtime import phases
from tunix_mcjax.tasks import RewardFn, Task, held_out_task

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


def sample_texts(cfg: Config, engine: Engine, tokenizer: Any, tokens: list, seed: int
                 ) -> list[str]:
    """num_generations completions' texts of each prompt in `tokens`, a prompt's in a row."""
    g = cfg.num_generations
    completions = engine.generate([t for t in tokens for _ in range(g)],
                                  phases.sampling_params(cfg), seed)
    return phases.completion_texts(tokenizer, completions)


class SampledEvaluator(abc.ABC):
    """The evaluators that sample each of this host's evaluation prompts num_generations times
    and score the texts, with one `local_sums`: corr is the mean accuracy of a prompt's samples
    (pass@1), partially_corr any sample right, corr_format the mean of formatted samples. A
    kind says what is accurate (`accuracy`) and what is formatted (`formatted`)."""

    mode = "pass_at_1"

    def __init__(self, cfg: Config, tokenizer: Any, prompts: list[str], fields: dict[str, list],
                 reward_fns: Sequence[RewardFn], indices: list[int] | None = None):
        """`fields`: per-prompt columns; `indices`: each prompt's dataset index, for errors."""
        self.cfg, self.tokenizer, self.prompts, self.fields = cfg, tokenizer, prompts, fields
        self.reward_fns, self.indices = tuple(reward_fns), indices
        self.tokens = [phases.encode_prompt(tokenizer, i, text) for i, text in
                       zip(indices or range(len(prompts)), prompts, strict=True)]

    @abc.abstractmethod
    def accuracy(self, prompts: list[str], texts: list[str], fields: dict[str, list]
                 ) -> Sequence[float]:
        """Per sample: its accuracy (1.0 right, 0.0 wrong)."""

    @abc.abstractmethod
    def formatted(self, texts: list[str], reward: np.ndarray) -> Sequence[float]:
        """Per sample: whether it has the expected format."""

    def local_sums(self, engine: Engine, seed: int) -> np.ndarray:
        sums = dict.fromkeys(SUM_FIELDS, 0.0)
        g = self.cfg.num_generations
        if self.prompts:
            texts = sample_texts(self.cfg, engine, self.tokenizer, self.tokens, seed)
            rows = [j for j in range(len(self.prompts)) for _ in range(g)]
            prompts = [self.prompts[j] for j in rows]
            fields = {k: [v[j] for j in rows] for k, v in self.fields.items()}
            where = [self.indices[j] for j in rows] if self.indices is not None else None
            reward = rewards.score(self.reward_fns, prompts, texts, fields, where)
            correct = np.asarray(self.accuracy(prompts, texts, fields)).reshape(-1, g)
            formatted = np.asarray(self.formatted(texts, reward)).reshape(-1, g)
            sums.update(corr=correct.mean(1).sum(), partially_corr=(correct.max(1) > 0).sum(),
                        corr_format=formatted.mean(1).sum(), total=len(self.prompts),
                        reward_sum=float(reward.sum()), reward_count=len(texts))
        return np.array([sums[k] for k in SUM_FIELDS], np.float64)


class TaskEvaluator(SampledEvaluator):
    """This host's share of the built-in task's held-out prompts (`tasks.held_out_task`,
    num_test_batches x batch_size of them), scored by the run's reward and accuracy functions;
    formatted: a sample that earned any reward (the built-in tasks have no format check)."""

    def __init__(self, cfg: Config, tokenizer: Any, task: Task, host: int, num_hosts: int):
        share = list(range(host, len(task.prompts), num_hosts))
        super().__init__(cfg, tokenizer, [task.prompts[i] for i in share],
                         {k: [v[i] for i in share] for k, v in task.fields.items()},
                         rewards.resolve_reward_fns(cfg.reward_functions, task), share)
        self.task = task

    def accuracy(self, prompts: list[str], texts: list[str], fields: dict[str, list]
                 ) -> Sequence[float]:
        return self.task.accuracy_fn(prompts=prompts, completions=texts, **fields)

    def formatted(self, texts: list[str], reward: np.ndarray) -> Sequence[float]:
        return reward > 0


def task_evaluator(cfg: Config, tokenizer: Any, host: int, num_hosts: int
                   ) -> TaskEvaluator | None:
    """The built-in task's evaluator when num_test_batches > 0 and the task has held-out
    prompts; else None."""
    task = held_out_task(cfg, cfg.num_test_batches * cfg.batch_size) \
        if cfg.num_test_batches > 0 else None
    return TaskEvaluator(cfg, tokenizer, task, host, num_hosts) if task else None


# (what to evaluate: an engine, or DA's published policy; steps done; may it compile) ->
# every host's sums, [hosts, SUM_FIELDS].
PerHostSums = Callable[[Any, int, bool], np.ndarray]


class EvalSchedule:
    """When to evaluate, and the global result of each evaluation from every host's sums
    (`per_host_sums`); `mode` None: no evaluation."""

    def __init__(self, cfg: Config, mode: str | None, per_host_sums: PerHostSums | None):
        self.cfg, self.mode, self.per_host_sums = cfg, mode, per_host_sums
        self._pending: dict[str, Any] = {}
        self._compiled = False

    @classmethod
    def on_hosts(cls, cfg: Config, evaluator: Evaluator | None, topo: topology.Topology,
                 watchdog: topology.Watchdog) -> EvalSchedule:
        """The colocated mode's: each host scores its share on its engine; one all-gather."""
        if cfg.num_test_batches == 0:
            return cls(cfg, None, None)
        if evaluator is None:
            raise ConfigError(
                f"num_test_batches={cfg.num_test_batches}: evaluation needs an evaluator, which "
                "the MaxText and Tunix adapters build from their eval keys and dataset_name="
                "next_digit has built in; set num_test_batches=0 for this recipe.")

        def per_host_sums(engine: Engine, steps_done: int, compiles: bool) -> np.ndarray:
            local = evaluator.local_sums(engine, eval_seed(cfg.seed, steps_done, topo.host))
            # The first evaluation may compile (new sampling settings) on a slower host.
            with watchdog.guard("eval", compiles=compiles):
                return topology.allgather(np.asarray(local, np.float64))
        return cls(cfg, evaluator.mode, per_host_sums)

    def before_training(self, engine: Any, start_step: int) -> None:
        """MaxText's pre-training evaluation (also on resume); kept for the first step's record.
        eval_schedule=tunix: only when the finished steps divide by eval_interval (Tunix's)."""
        tunix_skips = (self.cfg.eval_schedule == "tunix"
                       and start_step % max(self.cfg.eval_interval, 1) != 0)
        if self.mode is not None and not tunix_skips:
            self._pending["pre"] = self.evaluate(engine, start_step)

    def after_step(self, step: int, engine: Any) -> dict[str, Any]:
        """{"eval": {label: result}} for the evaluations due after `step` (plus a pending
        pre-training one), or {} when none is."""
        if self.mode is None:
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

    def evaluate(self, engine: Any, steps_done: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        per_host = self.per_host_sums(engine, steps_done, not self._compiled)
        self._compiled = True
        return {"steps_done": steps_done, "mode": self.mode,
                **global_result(per_host), "eval_s": time.perf_counter() - t0}


def summary_fields(records: list[dict]) -> dict[str, Any]:
    """summary.json's evaluation entries: every evaluation of the run, in order."""
    evals = [{"when": label, **r} for rec in records for label, r in rec.get("eval", {}).items()]
    return {"eval": evals} if evals else {}
