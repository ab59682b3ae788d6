"""Check for patch 0004: RLCluster with a rollout mesh of each process's own devices.

Run as every process of a jax.distributed job, with a tunix copy first on PYTHONPATH. The actor
is a tiny random Qwen3 FSDP-sharded over all devices of all processes; the rollout mesh holds
only this process's devices, so each process decodes its own prompts. Builds the RLCluster,
generates greedily, scales the actor's weights and syncs them to the rollout. Prints one
"REPORT <json>" line per process.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh
from tunix.models.qwen3 import model as qwen3
from tunix.rl import reshard
from tunix.rl import rl_cluster as rlc
from tunix.rl.rollout import base_rollout

from tests.tunix_checks.tiny import VOCAB, IdTokenizer, tiny_config
from tunix_mcjax import topology

NEW_TOKENS = 8
CONFIG = tiny_config()
AXES = ("fsdp", "tp")


topo = topology.initialize_from_env()
auto = (AxisType.Auto, AxisType.Auto)
global_mesh = Mesh(np.array(jax.devices()).reshape(-1, 1), AXES, axis_types=auto)
local_mesh = Mesh(np.array(jax.local_devices()).reshape(-1, 1), AXES, axis_types=auto)


@nnx.jit
def make_actor():
    model = qwen3.Qwen3(CONFIG, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return model


def max_diff(rollout_state, actor_state) -> float:
    """Largest |rollout - actor| over all params; the actor's are gathered from all hosts."""
    diffs = jax.tree.map(
        lambda r, a: float(np.max(np.abs(np.asarray(r) - multihost_utils.process_allgather(
            a, tiled=True)))), rollout_state, actor_state)
    return max(jax.tree.leaves(diffs))


with jax.set_mesh(global_mesh):
    actor = make_actor()
report: dict = {"host": topo.host, "reshard": reshard.__file__}
try:
    cluster = rlc.RLCluster(
        actor=actor, tokenizer=IdTokenizer(),
        cluster_config=rlc.ClusterConfig(
            role_to_mesh={rlc.Role.ACTOR: global_mesh, rlc.Role.REFERENCE: global_mesh,
                          rlc.Role.ROLLOUT: local_mesh},
            rollout_engine="vanilla",
            training_config=rlc.RLTrainingConfig(actor_optimizer=optax.sgd(1e-3),
                                                 eval_every_n_steps=10, max_steps=1),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=NEW_TOKENS, max_prompt_length=8,
                kv_cache_size=8 + NEW_TOKENS, temperature=0.0, top_p=None, eos_tokens=[VOCAB]),
        ),
    )  # fmt: skip
    report["built"] = True
    rollout_params = nnx.state(cluster.rollout.model(), nnx.Param)
    report["rollout_fully_addressable"] = all(
        x.is_fully_addressable for x in jax.tree.leaves(rollout_params))
    prompts = [f"{5 + 20 * topo.host} 6 7", "9 10"]
    out = cluster.generate(prompts=prompts, mode=rlc.Mode.TRAIN)
    report["completions"] = [[int(t) for t in tokens] for tokens in out.tokens]
    actor_model = cluster.actor_trainer.model
    actor_params = nnx.state(actor_model, nnx.Param)
    nnx.update(actor_model, jax.tree.map(lambda x: x * 1.5, actor_params))
    report["unsynced_max_diff"] = max_diff(nnx.state(cluster.rollout.model(), nnx.Param),
                                           nnx.state(actor_model, nnx.Param))
    cluster.sync_weights()
    report["synced_max_diff"] = max_diff(nnx.state(cluster.rollout.model(), nnx.Param),
                                         nnx.state(actor_model, nnx.Param))
except ValueError as e:
    report["error"] = str(e)
print("REPORT " + json.dumps(report), flush=True)
