"""One mcjax train step per loss case on a fixed batch, split over the hosts by whole groups,
packed by the runtime's own `phases.pack_local`, updated with plain SGD; host 0 also saves the
step's metrics (the rollout-trainer mismatch against `behaviour_logps`).

With SGD at learning rate LR, (initial - final) / LR is the gradient the trainer applied, so
the test compares gradients, not an optimizer's normalised step. Host 0 saves, per case, the
initial params, the gradient and the loss; a single-process reference (Tunix's grpo_loss_fn)
is compared with them. Also records an all-gather of 8-byte values that float32 would round.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh

from tests.workers.common import start
from tunix_mcjax import models, topology
from tunix_mcjax.engine import Completion
from tunix_mcjax.rewards import group_advantages
from tunix_mcjax.runtime.phases import pack_local
from tunix_mcjax.train import layer_runs
from tunix_mcjax.train.trainer import Trainer, qwen3_policy

VOCAB = 40
LR = 1e6  # large, so the applied step dwarfs the params and (initial - final) keeps precision

# loss_agg_mode x grpo_beta x temperature, two levels each, in the 4 cases that hold every pair
# of levels (an orthogonal array; the first is the recipes' default), plus gspo-token
# (on-policy GRPO).
CASES = {
    "seq-b0-t1": dict(loss_agg_mode="sequence-mean-token-mean", grpo_beta=0.0,
                      decode_sampling_temperature=1.0),
    "seq-b01-t07": dict(loss_agg_mode="sequence-mean-token-mean", grpo_beta=0.1,
                        decode_sampling_temperature=0.7),
    "tok-b0-t07": dict(loss_agg_mode="token-mean", grpo_beta=0.0,
                       decode_sampling_temperature=0.7),
    "tok-b01-t1": dict(loss_agg_mode="token-mean", grpo_beta=0.1,
                       decode_sampling_temperature=1.0),
    "gspo-seq-b01": dict(loss_algo="gspo-token", loss_agg_mode="sequence-mean-token-mean",
                         grpo_beta=0.1, decode_sampling_temperature=1.0),
    # token-mean, beta 0.1, temperature 0.7 (the pairing the array leaves out), on a mesh that
    # interleaves the hosts along fsdp, as MaxText's TPU meshes do (INTERLEAVED).
    "tok-b01-t07-interleaved": dict(loss_agg_mode="token-mean", grpo_beta=0.1,
                                    decode_sampling_temperature=0.7),
}
INTERLEAVED = {"tok-b01-t07-interleaved"}


def fixed_batch(num_prompts: int, g: int, seed: int = 7):
    """Random prompts (len 2-4) and completions (len 1-5) of non-special tokens, with rewards."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, rng.integers(2, 5)).astype(np.int32)
               for _ in range(num_prompts)]
    completions = [rng.integers(3, VOCAB, rng.integers(1, 6)).astype(np.int32)
                   for _ in range(num_prompts * g)]
    rewards = rng.integers(0, 2, num_prompts * g).astype(np.float32)
    rewards[:g] = 1.0  # one group with zero spread: advantages 0
    return prompts, completions, rewards


def behaviour_logps(completions, seed: int = 11) -> list[np.ndarray]:
    """Stand-in engine logprobs of the completions: a uniform policy's plus noise, so the
    mismatch with the trainer's own logprobs is known and not small (on-policy cases ignore
    them in the loss)."""
    rng = np.random.default_rng(seed)
    return [(-np.log(VOCAB) + 0.5 * rng.standard_normal(len(c))).astype(np.float32)
            for c in completions]


def flat(tree) -> dict[str, np.ndarray]:
    return {
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path):
            np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            nnx.to_pure_dict(layer_runs.unstack(tree)))[0]
    }


def interleaved_mesh(topo) -> Mesh:
    """The trainer's mesh with the hosts' devices alternating along fsdp (h0 d0, h1 d0, ...)."""
    hosts = [[d for d in topo.global_devices if d.process_index == h]
             for h in range(topo.num_hosts)]
    order = [host[i] for i in range(len(topo.local_devices)) for host in hosts]
    return Mesh(np.array(order).reshape(-1, 1), ("fsdp", "tp"),
                axis_types=(AxisType.Auto, AxisType.Auto))


def one_case(base_cfg, topo, name: str, out: dict) -> None:
    cfg = base_cfg.replace(**CASES[name])
    g, p = cfg.num_generations, cfg.batch_size
    prompts, completions, rewards = fixed_batch(p, g)
    adv = group_advantages(rewards, g)
    mesh = interleaved_mesh(topo) if name in INTERLEAVED else topology.trainer_mesh(topo)
    model = models.create_model(models.model_config(cfg, VOCAB), cfg.init_weights_seed, mesh)
    policy, params = qwen3_policy(model)
    initial = flat(params)
    trainer = Trainer(cfg, policy, params, mesh, tx=optax.sgd(LR))

    per_host = p // topo.num_hosts
    mine = range(topo.host * per_host * g, (topo.host + 1) * per_host * g)
    behaviour = behaviour_logps(completions)
    local_completions = [Completion(completions[j], behaviour[j], "stop") for j in mine]
    local, _, _ = pack_local(cfg, [prompts[j // g] for j in mine], local_completions,
                             adv[list(mine)], 0, len(topo.local_devices), np.zeros(0))
    metrics = trainer.step(local)
    final = flat(trainer.params)
    out[f"{name}/loss"] = metrics["loss"]
    for key, value in metrics.items():
        out[f"{name}/metrics/{key}"] = value
    for key, value in initial.items():
        out[f"{name}/initial/{key}"] = value
        out[f"{name}/grad/{key}"] = (value.astype(np.float64) - final[key]) / LR


def main() -> None:
    cfg, topo = start()
    out: dict[str, np.ndarray] = {}
    for name in CASES:
        one_case(cfg, topo, name, out)
    exact = topology.allgather(np.array([2**40 + 1 + topo.host], np.int64))
    near = topology.allgather(np.array([16777217.0 + topo.host], np.float64))
    if topo.is_leader:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        np.savez(cfg.run_dir / "update.npz", allgather_int64=exact, allgather_float64=near,
                 **out)


if __name__ == "__main__":
    main()
