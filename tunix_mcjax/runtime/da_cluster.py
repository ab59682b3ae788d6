"""LoCoJAX-DA's actors: trainer and rollout actors on a Ray placement, and the driver's calls
to them, each waited on under the collective or compile timeout (`ray_cluster.wait_all`)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import ray

from tunix_mcjax.config import Config
from tunix_mcjax.runtime import ray_cluster, reporting
from tunix_mcjax.runtime.ray_actors import RolloutWorker, TrainerWorker
from tunix_mcjax.runtime.recovery import Preempted


@dataclasses.dataclass
class InFlight:
    """A batch the rollouts are making (or made, not yet trained on): its step, {rollout:
    (batch ref, record ref)}, and the version and weights it is generated with (weights None:
    restored from a checkpoint, so nothing can lose it); with in-flight updates, `update`:
    [the trainer leader's result whose version the batch takes after its first slice]."""

    step: int
    calls: dict[int, tuple]
    version: int
    weights: list | None
    update: list | None = None


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
    # The batches in flight, oldest first: at most off_policy_steps of them (one at k = 0).
    queue: collections.deque[InFlight] = dataclasses.field(default_factory=collections.deque)

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
        """Every trainer saves the state after update `step` with the batches in flight for
        steps step + 1 .. step + k (waited for: a resume trains on them, as the run would
        have); sets `last_checkpoint`."""
        kept = [self.collect(b) for b in self.queue if b.step > step]
        records = [batch_records for _, batch_records in kept]
        rollouts = [ref for batch_refs, _ in kept for ref in batch_refs]
        self.last_checkpoint = self.wait(
            {f"trainer-{r}": t.save.remote(step, nonfinite_steps, records, *rollouts)
             for r, t in enumerate(self.trainers)},
            f"checkpoint step {step}", compiles=False)["trainer-0"]

    def restore_queue(self) -> None:
        """Queues the batches in flight when the resumed checkpoint was saved (for the steps
        from `first_step` on; at most off_policy_steps of them); none when there are none (a
        fresh run, a colocated checkpoint) or they were made by another number of rollout
        hosts."""
        saved = self.resumed()["in_flight"] or []
        if saved and len(saved[0][0]) != len(self.rollouts):
            print(f"mcjax_da: the checkpoint's batches from step {self.first_step} were made by "
                  f"{len(saved[0][0])} rollout hosts, this run has {len(self.rollouts)}; "
                  "regenerating them with the restored policy", flush=True)
            saved = []
        k = self.cfg.off_policy_steps
        if len(saved) > k:
            print(f"mcjax_da: the checkpoint kept {len(saved)} batches in flight, "
                  f"off_policy_steps={k} allows {k}; regenerating the later ones with the "
                  "restored policy", flush=True)
        for i, (rollouts, records) in enumerate(saved[:k]):
            self.queue.append(InFlight(
                self.first_step + i,
                {r: (ray.put(batch), ray.put(record))
                 for r, (batch, record) in enumerate(zip(rollouts, records, strict=True))},
                rollouts[0].policy_version, None))

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

    def generate(self, step: int, version: int, weights: list, only: int | None = None,
                 update: list | None = None) -> dict[int, tuple]:
        """{rollout: (batch ref, record ref)} of step `step` with policy `version` (and, after
        the first slice, `update`'s: `InFlight`), from every rollout actor (`only` None) or
        one."""
        return {r: a.generate.options(num_returns=2).remote(step, version, weights, update)
                for r, a in enumerate(self.rollouts) if only in (None, r)}

    def enqueue(self, step: int, version: int, weights: list, update: list | None = None
                ) -> None:
        """Puts batch `step`, generated with `version` (then `update`'s), in flight."""
        self.queue.append(InFlight(step, self.generate(step, version, weights, update=update),
                                   version, weights, update))

    def next_batch(self, step: int) -> tuple[list, list[dict]]:
        """(batch refs, records) of step `step`, the oldest batch in flight, taken off the
        queue."""
        batch = self.queue.popleft()
        if batch.step != step:
            raise RuntimeError(f"mcjax_da: step {step} found batch {batch.step} first in flight")
        return self.collect(batch)

    def collect(self, batch: InFlight) -> tuple[list, list[dict]]:
        """(batch refs, records) of `batch`; a dead rollout actor is replaced while restarts
        last, and its share of every batch in flight regenerated with that batch's version and
        seed."""
        compiles = batch.step <= self.first_step + max(self.cfg.off_policy_steps, 1)
        while True:
            try:
                records = self.wait({f"rollout-{r}": refs[1] for r, refs in batch.calls.items()},
                                    f"generate step {batch.step}", compiles=compiles)
                return [batch.calls[r][0] for r in sorted(batch.calls)], [
                    records[f"rollout-{r}"] for r in sorted(batch.calls)]
            except ray_cluster.ActorFailed as e:
                self._restart(e, batch)
                compiles = True  # the new actor builds and compiles its engine first

    def _restart(self, failure: ray_cluster.ActorFailed, batch: InFlight) -> None:
        """Replaces the dead rollout actor `failure` names and reissues its share of `batch`
        and of every later batch in flight, in step order, each with its own version; re-raises
        `failure` when it is not a rollout actor's death or that actor's restarts are spent."""
        name = failure.name
        index = int(name.removeprefix("rollout-")) if name.startswith(
            "rollout-") and "," not in name else None
        if not failure.died or index is None or \
                self.restarts[index] >= self.cfg.rl_rollout_restarts:
            raise failure
        self.restarts[index] += 1
        later = [b for b in self.queue if b.step > batch.step]
        print(f"mcjax_da: {failure}; restarting it ({self.restarts[index]} of "
              f"rl_rollout_restarts={self.cfg.rl_rollout_restarts}) to regenerate step "
              f"{batch.step} and the {len(later)} later batches in flight", flush=True)
        ray_cluster.kill([self.rollouts[index]])
        self.rollouts[index] = self._rollout(index, len(self.rollouts))
        for lost in [batch, *later]:
            if lost.weights is not None:  # a restored batch is the driver's own object
                lost.calls.update(self.generate(lost.step, lost.version, lost.weights,
                                                only=index, update=lost.update))

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
        tokens = in_flight_totals([out[f"trainer-{r}"] for r in ranks])
        return {**out["trainer-0"], **tokens, "batch_versions": versions,
                "trainer_nodes": [out[f"trainer-{r}"]["node_id"] for r in ranks]}


def in_flight_totals(results: list[dict]) -> dict:
    """Every trainer's `in_flight.token_staleness` counts summed (none without in-flight
    updates)."""
    if "token_staleness" not in results[0]:
        return {}
    width = max(len(r["token_staleness"]) for r in results)
    counts = sum(np.pad(r["token_staleness"], (0, width - len(r["token_staleness"])))
                 for r in results)
    return {"token_staleness": counts.tolist(),
            "mixed_completions": sum(r["mixed_completions"] for r in results)}
