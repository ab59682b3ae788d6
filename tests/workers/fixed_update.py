"""One mcjax train step on a fixed batch, split over the hosts by whole groups.

Host 0 saves the initial params, the batch, and the params after the update, so a
single-process reference (Tunix's grpo_loss_fn + the same optax optimizer) can be compared.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from tests.workers.common import start
from tunix_mcjax import models, packing, topology
from tunix_mcjax.rewards import group_advantages
from tunix_mcjax.trainer import Trainer, loss_weights, qwen3_policy

VOCAB = 40


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


def flat(tree) -> dict[str, np.ndarray]:
    return {
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path):
            np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(tree))[0]
    }


def main() -> None:
    cfg, topo = start()
    g, p = cfg.num_generations, cfg.batch_size
    prompts, completions, rewards = fixed_batch(p, g)
    adv = group_advantages(rewards, g)

    mesh = topology.trainer_mesh(topo)
    model = models.create_model(models.model_config(cfg, VOCAB), cfg.init_weights_seed, mesh)
    policy, params = qwen3_policy(model)
    initial = flat(params)
    trainer = Trainer(cfg, policy, params, mesh)

    per_host = p // topo.num_hosts
    mine = range(topo.host * per_host * g, (topo.host + 1) * per_host * g)
    seqs = [packing.Sequence(prompts[j // g], completions[j], float(adv[j]),
                             np.zeros(len(completions[j]), np.float32)) for j in mine]
    rows = packing.pack(seqs, cfg.max_target_length, pad_id=0)
    counts = topology.allgather(np.array([rows.num_rows, len(seqs),
                                          sum(len(s.completion) for s in seqs)]))
    k = packing.rows_per_device(counts[:, 0].tolist(), len(topo.local_devices))
    rows = packing.pad_rows(rows, k * len(topo.local_devices), pad_id=0)
    local = {f: getattr(rows, f) for f in ("tokens", "positions", "segment_ids", "targets",
                                           "loss_mask", "advantages", "old_logps")}
    local["weights"] = loss_weights(rows, cfg.loss_agg_mode, int(counts[:, 1].sum()),
                                    int(counts[:, 2].sum())).astype(np.float32)
    metrics = trainer.step(local)
    final = flat(trainer.params)
    if topo.is_leader:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        np.savez(cfg.run_dir / "update.npz", loss=metrics["loss"],
                 **{f"initial/{k}": v for k, v in initial.items()},
                 **{f"final/{k}": v for k, v in final.items()})


if __name__ == "__main__":
    main()
