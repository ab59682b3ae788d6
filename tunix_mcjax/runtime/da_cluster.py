"""LoCoJAX-DA's actors: trainer and rollout actors on a Ray placement, and the driver's calls
to them, each waited on under the collective or compile timeout (`ray_cluster.wait_all`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import ray

from tunix_mcjax.config import Config
from tunix_mcjax.runtime import ray_cluster, reporting
from tunix_mcjax.runtime.ray_actors import RolloutWorker, TrainerWorker
from tunix_mcjax.runtime.recovery import Preempted


@dataclasses.dataclass
class Cluster:
    """The run's actors and what the driver knows about them."""

    cfg: Config
    devices_per_host: int
    placement: ray_cluster.Placement
    trainers: list
    rollouts: list
    restarts: list[int] = dataclasses.field(default_factory=list)  # per rollout actor
    first_step: int = 0  # 0, or the step after the checkpoint the trainers resumed from
    resume: dict | None = None  # `resumed()`'s answer, once asked
    last_checkpoint: str = ""  # what the trainers last saved, in words
    # The batch the rollouts are making: (its step, {rollout: refs}, its version and weights).
    in_flight: tuple[int, dict[int, tuple], int, list] | None = None

    @classmethod
    def start(cls, cfg: Config, hosts: int, devices_per_host: int) -> Cluster:
        """Trainers on bundles 0..T-1 (one jax.distributed group, coordinator on bundle 0's
        node), rollouts on the rest: one host each."""
        num_trainers, num_rollouts = cfg.disaggregated_split(hosts)
        placement = ray_cluster.Placement.create(hosts, cfg.collective_timeout_s)
        try:
            coordinator = placement.coordinator(cfg.compile_timeout_s)
        except BaseException:
            placement.remove()
            raise
        print(f"mcjax_da: {num_trainers} trainer and {num_rollouts} rollout hosts on "
              f"{'one node per host' if placement.spread else 'this node'}; trainers' "
              f"jax.distributed coordinator {coordinator[0]}:{coordinator[1]}", flush=True)
        trainers = [ray_cluster.spawn(TrainerWorker, placement, rank, ray_cluster.actor_env(
            devices_per_host, rank, num_trainers, coordinator), cfg, rank)
            for rank in range(num_trainers)]
        cluster = cls(cfg, devices_per_host, placement, trainers, [])
        cluster.rollouts = [cluster._rollout(r, num_rollouts) for r in range(num_rollouts)]
        cluster.restarts = [0] * num_rollouts
        return cluster

    def _rollout(self, index: int, num_rollouts: int):
        env = ray_cluster.actor_env(self.devices_per_host)
        return ray_cluster.spawn(RolloutWorker, self.placement, len(self.trainers) + index, env,
                                 self.cfg, index, num_rollouts)

    def close(self) -> None:
        ray_cluster.kill(self.trainers + self.rollouts)
        self.placement.remove()

    def wait(self, calls: dict, what: str, compiles: bool) -> dict:
        cfg = self.cfg
        timeout = cfg.compile_timeout_s if compiles else cfg.collective_timeout_s
        return ray_cluster.wait_all(calls, timeout, what, self.placement.actor_nodes)

    def resumed(self) -> dict:
        """Where the trainers start (`TrainerWorker.resumed`, asked once); sets `first_step`."""
        if self.resume is None:
            self.resume = self.wait({f"trainer-{r}": t.resumed.remote()
                                     for r, t in enumerate(self.trainers)},
                                    "restore", compiles=True)["trainer-0"]
            self.first_step = self.resume["start_step"]
            self.last_checkpoint = self.resume["checkpoint"]
        return self.resume

    def save(self, step: int, nonfinite_steps: int) -> None:
        """Every trainer saves the state after update `step` with the batch in flight for step
        + 1 (waited for: a resume trains on it, as the run would have); sets
        `last_checkpoint`."""
        batch, records = [], []
        if self.in_flight is not None and self.in_flight[0] == step + 1:
            batch, records = self.collect(*self.in_flight)
        self.last_checkpoint = self.wait(
            {f"trainer-{r}": t.save.remote(step, nonfinite_steps, records, *batch)
             for r, t in enumerate(self.trainers)},
            f"checkpoint step {step}", compiles=False)["trainer-0"]

    def restored_batch(self) -> dict[int, tuple] | None:
        """The batch in flight for the first step when the resumed checkpoint was saved, as
        `generate`'s refs; None when there is none (a fresh run, a colocated checkpoint) or it
        was made by another number of rollout hosts."""
        saved = self.resumed()["in_flight"]
        if saved is None:
            return None
        rollouts, records = saved
        if len(rollouts) != len(self.rollouts):
            print(f"mcjax_da: the checkpoint's batch for step {self.first_step} was made by "
                  f"{len(rollouts)} rollout hosts, this run has {len(self.rollouts)}; "
                  "regenerating it with the restored policy", flush=True)
            return None
        return {r: (ray.put(batch), ray.put(record))
                for r, (batch, record) in enumerate(zip(rollouts, records, strict=True))}

    def close_checkpoints(self) -> None:
        if self.cfg.enable_checkpointing:
            self.wait({f"trainer-{r}": t.close_checkpoints.remote()
                       for r, t in enumerate(self.trainers)}, "checkpoint close", compiles=False)

    def stopped(self, step: int) -> Preempted:
        """The driver's SIGTERM: the saves closed, what ends the run after `step`."""
        self.close_checkpoints()
        return Preempted(f"mcjax_da: SIGTERM to the driver; stopped after step {step}; "
                         f"{self.last_checkpoint}. Rerun the same command to resume.")

    def summary(self, records: list[dict]) -> dict | None:
        """The colocated summary (`reporting.write_summary`) plus the split, the restarts and
        the node of each actor."""
        hosts = len(self.trainers) + len(self.rollouts)
        if not records:
            return reporting.write_summary(self.cfg, records, hosts, self.devices_per_host, 0)
        last = records[-1]
        nodes = {**{f"trainer-{r}": n for r, n in enumerate(last["trainer_nodes"])},
                 **{f"rollout-{r}": n for r, n in enumerate(last["rollout_nodes"])}}
        return reporting.write_summary(
            self.cfg, records, hosts, self.devices_per_host, last["nonfinite_steps"],
            runtime="mcjax_da", trainer_hosts=len(self.trainers),
            rollout_hosts=len(self.rollouts), rollout_restarts=last["rollout_restarts"],
            actor_nodes=nodes)

    def publish_first(self) -> dict:
        out = self.wait({f"trainer-{r}": t.publish.remote() for r, t in enumerate(self.trainers)},
                        "publish", compiles=True)
        return out["trainer-0"]

    def generate(self, step: int, version: int, weights: list, only: int | None = None
                 ) -> dict[int, tuple]:
        """{rollout: (batch ref, record ref)} of step `step` with policy `version`; the whole
        batch (`only` None) is the one in flight."""
        calls = {r: a.generate.options(num_returns=2).remote(step, version, weights)
                 for r, a in enumerate(self.rollouts) if only in (None, r)}
        if only is None:
            self.in_flight = (step, calls, version, weights)
        return calls

    def collect(self, step: int, pending: dict[int, tuple], version: int, weights: list
                ) -> tuple[list, list[dict]]:
        """(batch refs, records) of step `step`; a dead rollout actor is replaced while restarts
        last, and its batch regenerated with the same version and seed."""
        compiles = step <= self.first_step + 1
        while True:
            try:
                records = self.wait({f"rollout-{r}": refs[1] for r, refs in pending.items()},
                                    f"generate step {step}", compiles=compiles)
                return [pending[r][0] for r in sorted(pending)], [
                    records[f"rollout-{r}"] for r in sorted(pending)]
            except ray_cluster.ActorFailed as e:
                index = int(e.name.removeprefix("rollout-")) if e.name.startswith(
                    "rollout-") and "," not in e.name else None
                if not e.died or index is None or \
                        self.restarts[index] >= self.cfg.rl_rollout_restarts:
                    raise
                self.restarts[index] += 1
                print(f"mcjax_da: {e}; restarting it ({self.restarts[index]} of "
                      f"rl_rollout_restarts={self.cfg.rl_rollout_restarts}) to regenerate step "
                      f"{step}", flush=True)
                ray_cluster.kill([self.rollouts[index]])
                self.rollouts[index] = self._rollout(index, len(self.rollouts))
                pending.update(self.generate(step, version, weights, only=index))
                compiles = True  # the new actor builds and compiles its engine first

    def eval_sums(self, policy: tuple[int, list], steps_done: int, compiles: bool
                  ) -> np.ndarray:
        """[rollouts, SUM_FIELDS]: every rollout actor's evaluation sums with `policy`
        ((version, weights)), after the calls queued before it."""
        calls = {f"rollout-{r}": a.evaluate.remote(steps_done, *policy)
                 for r, a in enumerate(self.rollouts)}
        out = self.wait(calls, f"evaluation after {steps_done} steps", compiles=compiles)
        return np.stack([out[f"rollout-{r}"] for r in range(len(self.rollouts))])

    def train(self, step: int, batches: list) -> dict:
        """Starts update `step` on every trainer (trainer r gets its contiguous share of the
        batches); `finish_train` waits for it."""
        share = len(batches) // len(self.trainers)
        return {f"trainer-{r}": t.train.remote(step, *batches[r * share:(r + 1) * share])
                for r, t in enumerate(self.trainers)}

    def finish_train(self, step: int, calls: dict) -> dict:
        """The leader's result with every trainer's batch versions, once all applied the
        update."""
        out = self.wait(calls, f"train step {step}", compiles=step <= self.first_step + 1)
        ranks = range(len(self.trainers))
        versions = [v for r in ranks for v in out[f"trainer-{r}"]["batch_versions"]]
        return {**out["trainer-0"], "batch_versions": versions,
                "trainer_nodes": [out[f"trainer-{r}"]["node_id"] for r in ranks]}
