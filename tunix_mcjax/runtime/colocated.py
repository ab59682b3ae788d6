"""LoCoJAX-CO: the colocated step loop (paper Algorithm 1), run by every host's own process.

Per step, on host h of H: admit this host's whole GRPO groups, generate on the host's engine,
score and compute group advantages locally, pack rows (the step's one exchange: K, counts, the
previous step's metrics, O3's lengths), num_iterations global FSDP updates, publish the new
weights into the local engine. `rl_runtime=single` runs the same step in one process with one
lockstep engine over all devices: the single-controller (Pathways) structure, from the same
parts, as a benchmark arm. The phases are `runtime.phases`'; this module is their schedule.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from tunix_mcjax import metrics, topology
from tunix_mcjax.config import Config
from tunix_mcjax.engine import Engine
from tunix_mcjax.profiler import StepProfiler
from tunix_mcjax.publish import Publisher
from tunix_mcjax.runtime import dynamic_sampling, evaluation, phases, recovery, reporting
from tunix_mcjax.runtime.components import Components, build, rollout_phases
from tunix_mcjax.runtime.loop import StepEnd, StepLoop, add_host_hooks
from tunix_mcjax.runtime.phases import default_engine
from tunix_mcjax.runtime.records import HostRecord
from tunix_mcjax.runtime.stepmath import LengthHistory
from tunix_mcjax.train.trainer import Trainer


class ColocatedRuntime:
    """One host's controller: owns its engine, its share of the batch, its metrics."""

    def __init__(self, cfg: Config, topo: topology.Topology,
                 components: Components | Callable[[], Components] | None = None,
                 engine_factory: Callable[..., Engine] = default_engine):
        """`components`: prebuilt, or a function that builds them (run under the watchdog)."""
        cfg.validate_topology(topo.num_hosts, len(topo.local_devices))
        self.cfg, self.topo = cfg, topo
        self.watchdog = topology.Watchdog(topo.host, cfg.collective_timeout_s,
                                          cfg.compile_timeout_s)
        parts, self.prompts = build(cfg, topo, components, self.watchdog)
        with self.watchdog.guard("build", compiles=True):
            self.trainer = Trainer(cfg, parts.policy, parts.params, parts.mesh,
                                   tx=parts.optimizer)
        self.engine = engine_factory(cfg, parts.engine_model_config, list(topo.local_devices),
                                     self.prompts.pad_id, self.prompts.eos_ids)
        self.rollouts = rollout_phases(cfg, self.prompts, self.engine, topo, parts.chat_parser)
        self.train = phases.TrainPhase(self.trainer, self.watchdog, cfg.num_iterations)
        self.publisher = Publisher(parts.mesh, cfg.rl_publish_weights_single_call)
        self.evaluation = evaluation.EvalSchedule.on_hosts(cfg, parts.evaluator, topo,
                                                            self.watchdog)
        self.state = recovery.RunState(cfg, self.watchdog, topo.is_leader)
        self.nonfinite = recovery.NonFinitePolicy(cfg.max_nonfinite_steps)
        self.history = LengthHistory(len(self.prompts.tokens))  # O3's expected output
        self.start_step, _ = recovery.restore(self.state, self.trainer, self.history,
                                              self.nonfinite)
        with self.watchdog.guard("publish", compiles=True):
            phases.publish(self.publisher, self.trainer, self.engine)
        self.loop = self._loop()
        self.reporter = reporting.Reporter(cfg, topo, self.start_step, self.loop.record)
        self.compiles = reporting.CompileWatch(
            lambda: self.engine.compile_count + self.trainer.compile_count)

    def step(self, step: int) -> None:
        cfg, timer = self.cfg, metrics.PhaseTimer()
        self.reporter.begin(step)
        # The policy has taken `step` train steps: its version, which the rollout carries.
        rollout = self.rollouts.rollout(step, step, self.history, timer)
        sampled: dict[str, float] = {}
        drawn = [rollout]
        if cfg.dynamic_sampling:
            rollout, sampled, drawn = dynamic_sampling.fill(
                cfg, self.rollouts, rollout, self.history, timer, self.watchdog)
        local_devices = len(self.topo.local_devices)
        with timer.phase("pack"):
            lengths = rollout.length_pairs() if cfg.rl_balance_by_expected_output else None
            local, everyone = phases.pack(cfg, rollout.sequences(), self.prompts.pad_id,
                                          local_devices, self.watchdog,
                                          metrics=self.reporter.outgoing(), lengths=lengths)
        self.reporter.arrived(everyone.metrics)
        if rollout.turns is not None:  # agentic: the tokens that carry loss in the packed rows
            rollout.turns["loss_tokens"] = float(local["loss_mask"].sum())
        k = everyone.rows_per_device(local_devices)
        with timer.phase("train"):
            # Dynamic sampling may leave no group on any host: no update, nothing to publish.
            result = self.train(local, k) if everyone.global_sequences else \
                phases.TrainResult({"finite": 1.0}, 0, False)
        self.nonfinite.applied(step, result.metrics, self.state.describe_last())
        if result.applied:  # an update that was not applied changed nothing: nothing to publish
            with timer.phase("publish"), self.watchdog.guard("publish", compiles=result.compiled):
                phases.publish(self.publisher, self.trainer, self.engine)
        self.history.add(everyone.lengths)
        record = HostRecord.of(
            rollout, self.topo.host, timer.total(), timer.seconds,
            {**result.metrics, "nonfinite_steps": self.nonfinite.count, **sampled},
            compiled=self.compiles.grew(), rows_per_device=k, train_compiled=result.compiled,
            drawn=drawn)
        self.reporter.host_step(record)

    def _evaluate_after(self, end: StepEnd) -> None:
        """The evaluations due after the step, in its host record, kept out of its wall period
        and compile count."""
        t0 = time.perf_counter()
        self.reporter.pending.eval = self.evaluation.after_step(end.step, self.engine).get("eval")
        self.reporter.exclude(end.step, time.perf_counter() - t0)
        self.compiles.reset()

    def _loop(self) -> StepLoop:
        """The shared loop with this mode's hooks; host 0 also exports the global records."""
        cfg = self.cfg
        loop = StepLoop(cfg.steps, topology.preemption_noticed, self._preempted)
        loop.add_hook(self._evaluate_after)  # first: the step's record waits for it
        self.profiler = StepProfiler(cfg, self.topo.host, self.start_step)
        state = functools.partial(recovery.train_state, self.trainer, self.history, self.nonfinite)
        add_host_hooks(loop, cfg, lambda step: self.state.save(step, state), self.profiler,
                       gc_freeze=cfg.rl_gc_freeze_after_warmup)
        self.export = reporting.StepExport(cfg, self.start_step) if self.topo.is_leader else None
        if self.export is not None:
            loop.add_record_hook(self.export)
        return loop

    def _preempted(self, step: int) -> recovery.Preempted:
        self.reporter.flush(self.watchdog)  # the step's record before the end
        return recovery.preempted(self.topo.host, step, self.state)

    def run(self) -> dict | None:
        """All steps, then host 0 writes and returns summary.json.

        Raises `Preempted` (after every host saved) when a host got a preemption notice, and
        `NonFiniteError` when non-finite steps pass max_nonfinite_steps (nothing saved).
        """
        try:
            self.evaluation.before_training(self.engine, self.start_step)
            self.loop.run(self.start_step, self.step)
            self.reporter.flush(self.watchdog)
            self.state.close()
        finally:
            self.profiler.close()
            self.reporter.close()
            if self.export is not None:
                self.export.close()
        if self.export is None:
            return None
        return reporting.write_summary(self.cfg, self.export.records, self.topo.num_hosts,
                                       len(self.topo.local_devices), self.nonfinite.count)


def run(cfg: Config, topo: topology.Topology | None = None) -> dict | None:
    return ColocatedRuntime(cfg, topo or topology.current()).run()
