"""LoCoJAX-DA: trainer hosts and rollout hosts apart, on Ray, up to k steps stale (paper §2,
§4.4; k = off_policy_steps, 1 by default, the paper's).

The driver (this process; `python -m tunix_mcjax.launch ... rl_runtime=mcjax_da`) joins a Ray
cluster (rl_ray_address or RAY_ADDRESS; else it starts a local one), places one actor per host
(`ray_cluster.Placement`), H x rl_trainer_hosts_fraction trainer actors (one jax.distributed
group, the colocated mode's FSDP train step) and the rest as rollout actors (one engine each).
Schedule, with k batches in flight:

    publish v0; rollouts make batches 0 .. k-1 with v0
    step t: trainers apply batch t to v_t (-> v_t+1, published)  ||  rollouts make batch t+k
            with v_t, the last published version (queued behind the batches in flight)

so batch t is generated with v_max(t-k, 0) and applied to v_t: staleness is exactly k from
step k on (batches 0 .. k-1, the pipeline fill, are 0 .. k-1 stale). k = 1 is the paper's
schedule; k = 0 is on-policy, with no overlap: batch t is generated with v_t once update t-1 is
published. Each batch carries its version and the trainer weights it by the engine's behaviour
logprobs (off-policy loss), whatever the lag. With in_flight_weight_updates, batch t+k
takes v_t+1 after its first slice (`runtime.in_flight`): its rollout hosts wait for update t,
and each token records its version. The step period is Eq. 4's max(rollout + weight
load, train + publish). Evaluation keeps the colocated schedule (`evaluation.EvalSchedule`):
the rollout actors score their shares with the last published version, after the batches they
are generating, and the driver sums them.

Faults: a dead trainer actor ends the run at once, named; a dead rollout actor too, unless
`rl_rollout_restarts` allows a new one, which regenerates its share of every batch in flight,
each with its own version and seed. A step's update is recorded only once every trainer
finished it. A skipped (non-finite) update publishes nothing: the version and its object stay
the last applied one. A checkpoint keeps the batches in flight, so a resumed run trains on what
the stopped one would have: its records equal an uninterrupted run's.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import ray

from tunix_mcjax import metrics
from tunix_mcjax.config import Config
from tunix_mcjax.runtime import evaluation, ray_cluster, reporting
from tunix_mcjax.runtime.da_cluster import Cluster
from tunix_mcjax.runtime.loop import StepLoop, add_host_hooks
from tunix_mcjax.runtime.records import StepRecord
from tunix_mcjax.runtime.recovery import NonFinitePolicy

# What a step record repeats from the trainer leader's result.
TRAIN_FIELDS = ("trained_on", "version", "batch_versions", "trainer_processes", "puts",
                "publish_bytes", "rows_per_device", "loss", "grad_norm", "kl", "kl_loss",
                "finite", "trainer_nodes", "token_staleness", "mixed_completions",
                *metrics.MISMATCH_FIELDS)


def training_steps(cfg: Config, cluster: Cluster, stop: threading.Event | None = None,
                   record_hooks: tuple = ()) -> Iterator[StepRecord]:
    """The schedule under the shared loop (`loop.StepLoop`): yields each applied step's record
    once its hooks ran: `record_hooks` (the driver's export), then a checkpoint every
    checkpoint_period steps and at the last; once `stop` is set (the driver's SIGTERM), a save
    at the step just applied, then `Preempted`."""
    nonfinite = NonFinitePolicy(cfg.max_nonfinite_steps)
    nonfinite.count = cluster.resumed()["nonfinite_steps"]
    loop = StepLoop(cfg.steps, lambda _: stop is not None and stop.is_set(), cluster.stopped)
    for hook in record_hooks:
        loop.add_record_hook(hook)
    add_host_hooks(loop, cfg, lambda step: cluster.save(step, nonfinite.count))
    yield from loop.follow(cluster.first_step, schedule(cfg, cluster, nonfinite))
    cluster.close_checkpoints()


def schedule(cfg: Config, cluster: Cluster, nonfinite: NonFinitePolicy
             ) -> Iterator[StepRecord]:
    """The k-stale schedule (k = off_policy_steps) from the trainers' resume step: each step's
    global record once every trainer applied it, with the evaluations due after it."""
    k = cfg.off_policy_steps
    published = cluster.publish_first()
    version, weights = published["version"], published["weights"]  # the last published
    # The colocated schedule; the rollout actors evaluate the last published policy.
    evals = evaluation.EvalSchedule(
        cfg, evaluation.TaskEvaluator.mode if cfg.num_test_batches > 0 else None,
        cluster.eval_sums)
    evals.before_training((version, weights), cluster.first_step)
    # A resumed run trains first on the batches its checkpoint kept, as the stopped run would
    # have; the pipeline fill (up to k batches) is generated with the first published version.
    cluster.restore_queue()
    for step in range(cluster.first_step + len(cluster.queue),
                      min(cluster.first_step + k, cfg.steps)):
        cluster.enqueue(step, version, weights)
    for step in range(cluster.first_step, cfg.steps):
        start = time.perf_counter()
        if k == 0:  # on-policy: batch t is generated with v_t, after update t - 1
            cluster.enqueue(step, version, weights)
        batches, rollouts = cluster.next_batch(step)
        training = cluster.train(step, batches)  # update t: v_t -> v_t+1 ...
        if 0 < k and step + k < cfg.steps:  # ... while the rollouts make batch t+k with v_t
            update = [training["trainer-0"]] if cfg.in_flight_weight_updates else None
            cluster.enqueue(step + k, version, weights, update)  # (then v_t+1, in flight)
        train = cluster.finish_train(step, training)
        nonfinite.applied(step, train, cluster.last_checkpoint)
        version, weights = train["version"], train["weights"]
        record = step_record(step, rollouts, train, sum(cluster.restarts), nonfinite.count,
                             time.perf_counter() - start)
        record.update(evals.after_step(step, (version, weights)))
        yield StepRecord(step, record)


def step_record(step: int, rollouts: list[dict], train: dict, restarts: int,
                nonfinite_steps: int, wall_s: float) -> dict:
    """The colocated mode's global step record (rollout hosts as its hosts, the trainer's pack,
    train and publish phases), plus the versions and objects behind the step."""
    per_host = np.stack([metrics.host_vector({**r, **{k: train[k] for k in (
        "pack_s", "train_s", "publish_s")}}) for r in rollouts])
    rec = metrics.global_record(step, per_host, rollouts[0]["global_prompt_indices"])
    rec.update(
        step_s=wall_s, compiled=bool(rec["compiled"] or train["compiled"]),
        staleness=[train["trained_on"] - v for v in train["batch_versions"]],
        weights_objects=[r["weights_object"] for r in rollouts],
        weight_load_s=max(r["load_s"] for r in rollouts), rollout_restarts=restarts,
        in_flight_wait_s=max(r.get("in_flight_wait_s", 0.0) for r in rollouts),
        rollout_nodes=[r["node_id"] for r in rollouts],
        nonfinite_steps=nonfinite_steps,
        gc_frozen=train["gc_frozen"] and all(r["gc_frozen"] for r in rollouts),
        **{k: train[k] for k in TRAIN_FIELDS if k in train})
    return rec


def run(cfg: Config, hosts: int | None, devices_per_host: int) -> dict | None:
    """The whole run from this driver on `hosts` hosts (None: every host the cluster offers);
    writes steps.jsonl and summary.json, returns the summary. Raises `ray_cluster.ActorFailed`
    naming the actor that ended it, ConfigError when the cluster cannot hold the run."""
    connected = ray_cluster.connect(cfg, hosts or 2)
    try:
        hosts = hosts or ray_cluster.cluster_hosts()
        cfg.validate_topology(hosts, devices_per_host)
        return _run(cfg, hosts, devices_per_host)
    finally:
        if connected:
            ray.shutdown()


def _run(cfg: Config, hosts: int, devices_per_host: int) -> dict | None:
    cluster = Cluster.start(cfg, hosts, devices_per_host)
    stop, export = threading.Event(), None
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set()) if on_main else None
    try:
        cluster.resumed()  # where the run starts, so the export keeps the steps before it
        export = reporting.StepExport(cfg, cluster.first_step,
                                      lambda rec: f" | staleness {rec['staleness']}")
        for _ in training_steps(cfg, cluster, stop, (export,)):
            pass
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)
        cluster.close()
        if export is not None:
            export.close()
    return cluster.summary(export.records)
