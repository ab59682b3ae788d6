"""LoCoJAX-CO: the colocated step loop (paper Algorithm 1), run by every host's own process.

Per step, on host h of H: admit this host's whole GRPO groups, generate on the host's engine,
score and compute group advantages locally, pack rows (hosts agree on rows per device K with one
tiny all-gather), one global FSDP update, publish the new weights into the local engine.
`rl_runtime=single` runs the same step in one process with one lockstep engine over all devices:
the single-controller (Pathways) structure, built from the same parts, as a benchmark arm.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tunix_mcjax import admission, metrics, models, rewards, topology
from tunix_mcjax.config import Config, ConfigError
from tunix_mcjax.engine import Completion, Engine, stops
from tunix_mcjax.profiler import StepProfiler
from tunix_mcjax.publish import Publisher
from tunix_mcjax.runtime import evaluation, phases
from tunix_mcjax.runtime.phases import default_engine
from tunix_mcjax.runtime.recovery import NonFinitePolicy, Preempted, RunState
from tunix_mcjax.tasks import Task, load_task
from tunix_mcjax.tokenizer import load_tokenizer
from tunix_mcjax.trainer import Policy, Trainer, qwen3_policy

EngineFactory = Callable[..., Engine]
__all__ = ["ColocatedRuntime", "Components", "default_engine", "run"]


@dataclasses.dataclass
class Components:
    """What a run trains and samples with. Built from the config by default; the MaxText adapter
    supplies its own (MaxText's model as the policy, its tokenizer, data and rewards)."""

    tokenizer: Any
    task: Task
    mesh: jax.sharding.Mesh  # the trainer's global mesh; batch rows shard over its "fsdp" axis
    policy: Policy
    params: Any
    engine_model_config: Any  # the engine's: Tunix Qwen3 ModelConfig (jax), MaxText's (maxtext)
    optimizer: Any = None  # an optax transformation; None: `trainer.make_optimizer(cfg)`
    evaluator: Any = None  # a runtime.evaluation.Evaluator; needed when num_test_batches > 0


def default_components(cfg: Config, topo: topology.Topology, tokenizer, task: Task
                       ) -> Components:
    """The config's tiny Qwen3 on the global mesh (a cross-host build: run it guarded)."""
    mesh = topology.trainer_mesh(topo)
    vocab = len(tokenizer)
    model = models.build_model(cfg, models.model_config(cfg, vocab), mesh)
    policy, params = qwen3_policy(model)
    return Components(tokenizer, task, mesh, policy, params,
                      models.model_config(cfg, vocab, for_sampling=True))


class ColocatedRuntime:
    """One host's controller: owns its engine, its share of the batch, its metrics."""

    def __init__(self, cfg: Config, topo: topology.Topology,
                 components: Components | Callable[[], Components] | None = None,
                 engine_factory: EngineFactory = default_engine):
        """`components`: prebuilt, or a function that builds them (run under the watchdog)."""
        cfg.validate_topology(topo.num_hosts, len(topo.local_devices))
        self.cfg, self.topo = cfg, topo
        self.watchdog = topology.Watchdog(topo.host, cfg.collective_timeout_s,
                                          cfg.compile_timeout_s)
        if callable(components):
            with self.watchdog.guard("build", compiles=True):
                components = components()
        tokenizer = components.tokenizer if components else \
            load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
        # Prompts over the budget go before any device work (MaxText filters its data too).
        self.task, self.prompt_tokens = phases.filter_task(
            components.task if components else load_task(cfg), tokenizer, cfg, topo.host)
        self.reward_fns = rewards.resolve_reward_fns(cfg.reward_functions, self.task)
        with self.watchdog.guard("build", compiles=True):
            parts = components or default_components(cfg, topo, tokenizer, self.task)
            self.trainer = Trainer(cfg, parts.policy, parts.params, parts.mesh,
                                   tx=parts.optimizer)
        self.tokenizer, self.mesh = tokenizer, parts.mesh
        self.pad_id = self.tokenizer.pad_token_id
        self.eos_ids = stops.model_stop_ids(self.tokenizer, (cfg.load_parameters_path,
                                                             cfg.tokenizer_path))
        self.prompt_lengths = np.array([len(t) for t in self.prompt_tokens])
        self.output_len_sum = np.zeros(len(self.prompt_tokens))  # for O3's expected output
        self.output_len_count = np.zeros(len(self.prompt_tokens))
        self.engine = engine_factory(cfg, parts.engine_model_config, list(topo.local_devices),
                                     self.pad_id, self.eos_ids)
        self.publisher = Publisher(self.mesh, cfg.rl_publish_weights_single_call)
        self.evaluation = evaluation.EvalSchedule(cfg, parts.evaluator, topo, self.watchdog)
        self.sampling = phases.sampling_params(cfg)
        self.state = RunState(cfg, self.watchdog, topo.is_leader)
        self.nonfinite = NonFinitePolicy(cfg.max_nonfinite_steps)
        self.start_step = self._maybe_restore()
        with self.watchdog.guard("publish", compiles=True):
            self._publish()

        self.run_dir = cfg.run_dir
        # Records of steps a resume re-runs are dropped: every step appears once.
        self.host_log = metrics.JsonlSink(self.run_dir / f"host_{topo.host}.jsonl",
                                          self.start_step)
        self.step_log = metrics.JsonlSink(self.run_dir / "steps.jsonl", self.start_step) \
            if topo.is_leader else None
        self.tensorboard = metrics.TensorBoard(self.run_dir / "tensorboard", cfg.log_period) \
            if topo.is_leader and cfg.enable_tensorboard else None
        self.profiler = StepProfiler(cfg, topo.host, self.start_step)
        self.exporter = metrics.Exporter(self._export, cfg.rl_async_metrics_export,
                                         cfg.rl_metrics_queue_size)
        # The summary covers the whole run, resumed segments included.
        self.step_records: list[dict] = list(self.step_log.kept) if self.step_log else []
        self._pending: tuple[int, dict] | None = None  # last step's host record, not yet global
        self._gathered: np.ndarray | None = None  # base path: its every-host metrics, not emitted
        self._step_start: dict[int, float] = {}
        self._seen_k: set[int] = set()  # rows per device the train step has compiled for
        self._compiles = self._compile_count()

    # --- checkpoints -----------------------------------------------------------------------

    def _maybe_restore(self) -> int:
        """Resumes from the newest readable checkpoint in the run directory; the first step."""
        first, state = self.state.restore(self._train_state())
        if state is not None:
            self.trainer.params, self.trainer.opt_state = state["params"], state["opt_state"]
            if "output_len" in state:
                self.output_len_sum, self.output_len_count = np.array(state["output_len"])
            self.nonfinite.count = int(state.get("nonfinite_steps", 0))
        return first

    def _train_state(self) -> dict:
        """What a resume needs: the trainer state, the output-length history that O3's
        expected-output weights admit by (kept whatever the flags, so they may change), and
        the count of skipped non-finite steps."""
        return {"params": self.trainer.params, "opt_state": self.trainer.opt_state,
                "output_len": np.stack([self.output_len_sum, self.output_len_count]),
                "nonfinite_steps": np.array(self.nonfinite.count, np.int32)}

    # --- phases ----------------------------------------------------------------------------

    def admit(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(global batch indices, this host's dataset indices), whole groups only."""
        cfg = self.cfg
        global_idx = admission.global_prompt_indices(
            len(self.prompt_tokens), cfg.batch_size, cfg.seed, step, cfg.data_repeat_period)
        expected = None
        if cfg.rl_balance_by_expected_output:
            seen = self.output_len_count[global_idx]
            mean = self.output_len_sum[global_idx] / np.maximum(seen, 1)
            expected = np.where(seen > 0, mean, cfg.max_completion_length / 2)
        positions = admission.host_prompt_positions(
            self.topo.num_hosts, self.topo.host, self.prompt_lengths[global_idx],
            cfg.rl_balance_prompts_by_length, expected, cfg.num_generations)
        return global_idx, global_idx[positions]

    def generate(self, step: int, local_idx: np.ndarray) -> list[Completion]:
        g = self.cfg.num_generations
        requests = [self.prompt_tokens[i] for i in local_idx for _ in range(g)]
        return self.engine.generate(requests, self.sampling,
                                    phases.rollout_seed(self.cfg.seed, step, self.topo.host))

    def score(self, local_idx: np.ndarray, completions: list[Completion]):
        g = self.cfg.num_generations
        expanded = [i for i in local_idx for _ in range(g)]
        # A completion that stopped ends with its stop token; only that one is dropped.
        texts = self.tokenizer.batch_decode(
            [c.tokens[:-1] if c.finish_reason != "length" else c.tokens for c in completions],
            skip_special_tokens=True)
        prompts = [self.task.prompts[i] for i in expanded]
        fields = {k: [v[i] for i in expanded] for k, v in self.task.fields.items()}
        reward = rewards.score(self.reward_fns, prompts, texts, fields, expanded)
        correct = np.asarray(self.task.accuracy_fn(prompts=prompts, completions=texts, **fields))
        return reward, correct, rewards.group_advantages(reward, g)

    def pack(self, local_idx, completions, advantages, sync_payload: np.ndarray):
        """Local rows padded to the agreed K; also all-gathers `sync_payload` (O1 metrics)."""
        g = self.cfg.num_generations
        prompts = [self.prompt_tokens[i] for i in local_idx for _ in range(g)]
        return phases.pack_local(self.cfg, prompts, completions, advantages, self.pad_id,
                                 len(self.topo.local_devices), sync_payload, self.watchdog)

    # --- the step --------------------------------------------------------------------------

    def step(self, step: int) -> None:
        cfg, timer = self.cfg, metrics.PhaseTimer()
        self._step_start[step] = time.perf_counter()
        if self._gathered is not None:
            self._emit_global(self._take_gathered())
        with timer.phase("admit"):
            global_idx, local_idx = self.admit(step)
        with timer.phase("generate"):
            completions = self.generate(step, local_idx)
        with timer.phase("reward"):
            reward, correct, advantages = self.score(local_idx, completions)
        with timer.phase("pack"):
            payload = self._pending_payload() if cfg.rl_async_metrics_export else np.zeros(0)
            local, prev_hosts, k = self.pack(local_idx, completions, advantages, payload)
        if cfg.rl_async_metrics_export and self._pending is not None:
            self._emit_global(prev_hosts)
        compiles = k not in self._seen_k  # step 0, or a K the update has not compiled for
        self._seen_k.add(k)
        train_programs = self.trainer.compile_count
        with timer.phase("train"), self.watchdog.guard("train", compiles=compiles):
            train_metrics = self.trainer.step(local)
        train_compiled = int(self.trainer.compile_count > train_programs)
        # A step the trainer did not apply (non-finite) changed nothing: nothing to publish.
        if self.nonfinite.applied(step, train_metrics, self.state.describe_last()):
            with timer.phase("publish"), self.watchdog.guard("publish", compiles=compiles):
                self._publish()
        train_metrics = {**train_metrics, "nonfinite_steps": self.nonfinite.count}
        lens = np.array([len(c.tokens) for c in completions])
        lens_by_prompt = lens.reshape(len(local_idx), -1).mean(1)
        self._record_lengths(local_idx, lens_by_prompt)
        record = self._host_record(step, local_idx, global_idx, timer, reward, correct,
                                   completions, lens, lens_by_prompt, train_metrics)
        record.update(rows_per_device=k, train_compiled=train_compiled)
        record.update(self._evaluate_after(step))
        self.exporter.export({"kind": "host", **record})
        self._pending = (step, record)
        if not cfg.rl_async_metrics_export:
            self._gather_metrics()

    def _publish(self) -> None:
        self.publisher.publish_trainer(self.trainer, self.engine)

    def _evaluate_after(self, step: int) -> dict:
        """The evaluations due after `step`, kept out of its wall period and compile count."""
        t0 = time.perf_counter()
        out = self.evaluation.after_step(step, self.engine)
        self._step_start[step] += time.perf_counter() - t0
        self._compiles = self._compile_count()
        return out

    def _record_lengths(self, local_idx, lens_by_prompt) -> None:
        """Mean completion length per prompt, shared by all hosts for O3's expected output."""
        if not self.cfg.rl_balance_by_expected_output:
            return
        mine = np.stack([local_idx.astype(np.float64), lens_by_prompt], axis=1)
        with self.watchdog.guard("lengths"):
            every = topology.allgather(mine).reshape(-1, 2)
        idx = every[:, 0].astype(int)
        np.add.at(self.output_len_sum, idx, every[:, 1])
        np.add.at(self.output_len_count, idx, 1)

    def _compile_count(self) -> int:
        return self.engine.compile_count + self.trainer.compile_count

    def _host_record(self, step, local_idx, global_idx, timer, reward, correct, completions,
                     lens, lens_by_prompt, train_metrics) -> dict:
        compiles = self._compile_count()
        compiled, self._compiles = compiles > self._compiles, compiles
        phase = {f"{p}_s": timer.seconds.get(p, 0.0) for p in metrics.PHASES}
        return {
            "step": step, "host": self.topo.host, "step_s": timer.total(), **phase,
            "reward_sum": float(reward.sum()), "correct_sum": float(correct.sum()),
            "completions": len(completions), "completion_tokens": int(lens.sum()),
            "completion_len_max": int(lens.max()), "prompts": len(local_idx),
            "truncated": sum(c.finish_reason == "length" for c in completions),
            "prompt_tokens": int(self.prompt_lengths[local_idx].sum()),
            "compiled": int(compiled), "local_prompt_indices": local_idx.tolist(),
            "completion_len_by_prompt": lens_by_prompt.round(2).tolist(),
            "global_prompt_indices": global_idx.tolist(), **train_metrics,
        }

    # --- metrics (phase 7) -----------------------------------------------------------------

    def _pending_payload(self) -> np.ndarray:
        if self._pending is None:
            return np.zeros(len(metrics.HOST_FIELDS))
        return metrics.host_vector(self._pending[1])

    def _gather_metrics(self) -> None:
        """Base path: the step ends with a host barrier (all-gather) for its metrics; host 0
        exports them inline at the start of the next step, so the export (JSONL, progress
        line) is inside a step period, as in Tunix's loop."""
        with self.watchdog.guard("metrics"):
            self._gathered = topology.allgather(self._pending_payload())

    def _take_gathered(self) -> np.ndarray:
        per_host, self._gathered = self._gathered, None
        return per_host

    def _flush_metrics(self) -> None:
        """The pending step's record out now (end of run, preemption)."""
        if self._gathered is None:
            self._gather_metrics()
        self._emit_global(self._take_gathered())

    def _emit_global(self, per_host: np.ndarray) -> None:
        step, record = self._pending
        self._pending = None
        # The step's wall period: to the next step's start, or to now (metrics barrier done).
        period = self._step_start.get(step + 1, time.perf_counter()) - self._step_start.pop(step)
        if self.topo.is_leader:
            rec = metrics.global_record(step, per_host, record["global_prompt_indices"])
            rec["step_s"] = period
            rec.update({k: record[k] for k in ("loss", "grad_norm", "kl", "kl_loss", "finite",
                                               "nonfinite_steps", "eval") if k in record})
            self.step_records.append(rec)
            self.exporter.export({"kind": "global", **rec})

    def _export(self, record: dict) -> None:
        kind = record.pop("kind")
        if kind == "host":
            self.host_log(record)
        else:
            self.step_log(record)
            if self.tensorboard is not None:
                self.tensorboard.write(record)
            if record["step"] % self.cfg.log_period == 0 or "eval" in record:
                print(metrics.progress_line(record), flush=True)

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> dict | None:
        """All steps, then host 0 writes and returns summary.json.

        Raises `Preempted` (after every host saved) when a host got a preemption notice, and
        `NonFiniteError` when non-finite steps pass max_nonfinite_steps (nothing saved).
        """
        try:
            self.evaluation.before_training(self.engine, self.start_step)
            for step in range(self.start_step, self.cfg.steps):
                self.profiler.before_step(step)
                self.step(step)
                self.profiler.after_step(step)
                preempted = topology.preemption_noticed(step)
                if preempted or self.state.due(step):
                    if preempted and self._pending is not None:
                        self._flush_metrics()  # O1: the step's record before the process ends
                    self.state.save(step, self._train_state)
                if preempted:
                    message = (f"host {self.topo.host}: preemption notice (SIGTERM) at step "
                               f"{step}; {self.state.describe_last()}. Rerun the same command "
                               "to resume.")
                    self.state.close()
                    raise Preempted(message)
                if step == self.start_step and self.cfg.rl_gc_freeze_after_warmup:
                    freeze_gc()
            if self._pending is not None:
                self._flush_metrics()
            self.state.close()
        finally:
            self.profiler.close()
            self.exporter.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
            self.host_log.close()
            if self.step_log:
                self.step_log.close()
        return self._write_summary() if self.topo.is_leader else None

    def _write_summary(self) -> dict | None:
        recs = sorted(self.step_records, key=lambda r: r["step"])
        if not recs:
            print(f"nothing to run: the checkpoint already covers steps={self.cfg.steps}")
            return None
        steady = [r for r in recs if not r["compiled"]] or recs

        def mean(key, part):
            return float(np.mean([r[key] for r in part])) if part else 0.0

        summary = {
            "run_name": self.cfg.run_name,
            "hosts": self.topo.num_hosts,
            "devices_per_host": len(self.topo.local_devices),
            "steps": len(recs),
            "accuracy_first10": mean("accuracy", recs[:10]),
            "accuracy_last10": mean("accuracy", recs[-10:]),
            "reward_first10": mean("reward_mean", recs[:10]),
            "reward_last10": mean("reward_mean", recs[-10:]),
            "median_step_s": statistics.median(r["step_s"] for r in steady),
            "phase_median_s": {p: statistics.median(r["phase_s"][p] for r in steady)
                               for p in metrics.PHASES},
            "tokens_generated": int(sum(r["tokens_generated"] for r in recs)),
            "compiled_steps": int(sum(r["compiled"] for r in recs)),
            "nonfinite_steps": self.nonfinite.count,
            **evaluation.summary_fields(recs),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(summary_table(summary), flush=True)
        return summary


def freeze_gc() -> None:
    """O2: collect once, move survivors to the permanent generation, stop automatic GC."""
    gc.collect()
    gc.freeze()
    gc.disable()


def summary_table(s: dict) -> str:
    rows = [("hosts x devices", f"{s['hosts']} x {s['devices_per_host']}"),
            ("steps", s["steps"]),
            ("accuracy first10 -> last10", f"{s['accuracy_first10']:.3f} -> "
                                          f"{s['accuracy_last10']:.3f}"),
            ("reward first10 -> last10", f"{s['reward_first10']:.3f} -> {s['reward_last10']:.3f}"),
            ("median step", f"{s['median_step_s']:.3f} s"),
            *((f"  {p}", f"{v:.3f} s") for p, v in s["phase_median_s"].items()),
            ("tokens generated", s["tokens_generated"]),
            *((f"eval {e['when']} ({e['mode']})", f"{e['accuracy']:.2f}% of {e['total']}")
              for e in s.get("eval", ()))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def run(cfg: Config, topo: topology.Topology | None = None) -> dict | None:
    topo = topo or topology.current()
    if jax.process_count() > 1 and cfg.rl_runtime == "single":
        raise ConfigError("rl_runtime=single runs in one process: use --hosts 1")
    return ColocatedRuntime(cfg, topo).run()
