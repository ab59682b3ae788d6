"""Check that Tunix's GRPO learner resumed from a checkpoint matches an uninterrupted run.

Run with a tunix copy first on PYTHONPATH, one process, CHECKPOINT_DIR as the only argument. A
tiny random Qwen3 trains two GRPO steps without a seed in the rollout config (Tunix's default),
sampling at temperature 1 with a reward that depends on the sampled tokens. A second run trains
one step, saving a checkpoint; a third, freshly built, restores it and trains the second step.
Prints one "REPORT <json>" line: the steps each run reached and the largest parameter difference
between the uninterrupted and the resumed run.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import AxisType, Mesh
from tunix.models.qwen3 import model as qwen3
from tunix.rl import rl_cluster as rlc
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from tests.tunix_checks.tiny import VOCAB, IdTokenizer, tiny_config

NEW_TOKENS = 6
STEPS = 2
MESH = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"),
            axis_types=(AxisType.Auto, AxisType.Auto))
BATCHES = [{"prompts": np.array(["5 6 7", "9 10 11"])},
           {"prompts": np.array(["12 13 14", "15 16 17"])}]


def token_sum_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """A reward that differs whenever the sampled tokens do."""
    return [float(sum(int(t) for t in c.split()) % 7) for c in completions]


def build_learner(checkpoint_dir: str | None) -> grpo_learner.GRPOLearner:
    """A fresh actor and learner (beta 0: no reference model), the same weights every time."""
    actor = qwen3.Qwen3(tiny_config(), rngs=nnx.Rngs(0))
    options = ocp.CheckpointManagerOptions(save_interval_steps=1, max_to_keep=4)
    training = rlc.RLTrainingConfig(
        actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=100, max_steps=STEPS,
        checkpoint_root_directory=checkpoint_dir,
        checkpointing_options=options if checkpoint_dir else None)
    cluster = rlc.RLCluster(
        actor=actor, tokenizer=IdTokenizer(),
        cluster_config=rlc.ClusterConfig(
            role_to_mesh={role: MESH for role in (rlc.Role.ACTOR, rlc.Role.REFERENCE,
                                                  rlc.Role.ROLLOUT)},
            rollout_engine="vanilla", offload_to_cpu=False, training_config=training,
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=NEW_TOKENS, max_prompt_length=8,
                kv_cache_size=8 + NEW_TOKENS, temperature=1.0, top_p=1.0,
                eos_tokens=[VOCAB])))  # fmt: skip
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=token_sum_reward,
        algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.0))
    return learner


def params(learner: grpo_learner.GRPOLearner) -> list[np.ndarray]:
    """The trained actor's parameters (RLCluster trains its own copy of the actor)."""
    model = learner.rl_cluster.actor_trainer.model
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def main(checkpoint_dir: str) -> None:
    uninterrupted = build_learner(None)
    initial = params(uninterrupted)
    uninterrupted.train(BATCHES, None)
    interrupted = build_learner(checkpoint_dir)
    interrupted.train(BATCHES[:1], None)
    resumed = build_learner(checkpoint_dir)
    restored_step = resumed.rl_cluster.global_steps
    resumed.train(BATCHES, None)
    print("REPORT " + json.dumps({
        "grpo_learner": grpo_learner.__file__, "restored_step": restored_step,
        "steps": [run.rl_cluster.global_steps for run in (uninterrupted, interrupted, resumed)],
        "max_diff": max_diff(params(uninterrupted), params(resumed)),
        "trained_change": max_diff(params(uninterrupted), initial)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
