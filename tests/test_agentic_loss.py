"""The agentic update against Tunix's own agentic GRPO loss, in one process.

Multi-turn trajectories (model turn, tool observation, model turn) are packed into our rows with
their loss masks and updated by our trainer; Tunix's agentic learner's loss (its registered
"grpo" policy loss, under its agentic GRPOConfig) runs on the same trajectories in its padded
layout, conversation masks zero on tool tokens. Gradients agree within 1e-5 for epsilon_high
unset and set, on- and off-policy.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tunix.rl import common, function_registry
from tunix.rl.agentic import agentic_grpo_learner

from tests.mp import REPO, TINY
from tests.test_phases import assert_applied
from tunix_mcjax import models, topology
from tunix_mcjax.config import ConfigError, load_config
from tunix_mcjax.rewards import group_advantages
from tunix_mcjax.runtime import phases
from tunix_mcjax.train import layer_runs, loss, packing
from tunix_mcjax.train.trainer import Trainer, qwen3_policy

VOCAB = 40
G = 4
LR = 1e6  # (initial - final) / LR is the applied gradient, kept precise
SHAPE = [*TINY, "batch_size=2", f"num_generations={G}", "max_prefill_predict_length=4",
         "max_target_length=16", "grpo_beta=0.0"]


def trajectories(seed: int = 11):
    """Prompts and, per trajectory, its conversation tokens and model mask: a model turn, then
    (for most) a tool observation and a second model turn; no pad (0) or EOS (2) tokens."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, VOCAB, rng.integers(2, 5)).astype(np.int32) for _ in range(2)]
    convs, masks = [], []
    for j in range(2 * G):
        parts = [(rng.integers(3, VOCAB, rng.integers(1, 4)), 1.0)]
        if j % 3:
            parts += [(rng.integers(3, VOCAB, rng.integers(2, 4)), 0.0),
                      (rng.integers(3, VOCAB, rng.integers(1, 4)), 1.0)]
        convs.append(np.concatenate([p for p, _ in parts]).astype(np.int32))
        masks.append(np.concatenate([np.full(len(p), m, np.float32) for p, m in parts]))
    rewards = rng.integers(0, 2, 2 * G).astype(np.float32)
    return prompts, convs, masks, rewards


def _flat(tree) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(layer_runs.unstack(tree))}


class TunixAgentic:
    """Tunix's agentic learner's loss on its padded batch: prompts left-padded, conversations
    right-padded, the conversation mask as completion_mask."""

    def __init__(self, cfg, prompts, convs, masks, advantages, flat: dict[str, np.ndarray]):
        self.cfg, self.model = cfg, models.create_model(models.model_config(cfg, VOCAB), 0)
        params = nnx.state(self.model, nnx.Param)
        for key, var in nnx.to_flat_state(params):
            var.set_value(jnp.asarray(flat["/".join(map(str, key))]))
        nnx.update(self.model, params)
        pl, cl = max(len(p) for p in prompts), max(len(c) for c in convs)
        self.prompt_ids = np.zeros((len(convs), pl), np.int32)
        self.completion_ids = np.zeros((len(convs), cl), np.int32)
        self.mask = np.zeros((len(convs), cl), np.float32)
        for j, (c, m) in enumerate(zip(convs, masks, strict=True)):
            p = prompts[j // G]
            self.prompt_ids[j, pl - len(p):] = p
            self.completion_ids[j, :len(c)], self.mask[j, :len(c)] = c, m
        self.advantages = advantages

    def logps(self) -> np.ndarray:
        graphdef, state = nnx.split(self.model)
        return np.asarray(common.compute_per_token_logps(
            graphdef, state, jnp.asarray(self.prompt_ids), jnp.asarray(self.completion_ids), 0,
            2, temperature=self.cfg.decode_sampling_temperature))

    def grads(self, old: np.ndarray | None, epsilon_high: float | None):
        cfg = self.cfg
        algo = agentic_grpo_learner.GRPOConfig(
            num_generations=G, beta=0.0, epsilon=cfg.grpo_epsilon, epsilon_high=epsilon_high,
            loss_algo=cfg.loss_algo, loss_agg_mode=cfg.loss_agg_mode)
        algo.temperature = cfg.decode_sampling_temperature  # as the learner sets it
        example = common.TrainExample(
            prompt_ids=jnp.asarray(self.prompt_ids), prompt_mask=jnp.asarray(self.prompt_ids != 0),
            completion_ids=jnp.asarray(self.completion_ids),
            completion_mask=jnp.asarray(self.mask), advantages=jnp.asarray(self.advantages),
            ref_per_token_logps=None,
            old_per_token_logps=None if old is None else jnp.asarray(old))
        policy_loss = function_registry.get_policy_loss_fn(algo.policy_loss_fn)

        def loss_fn(m):
            return policy_loss(m, example, algo_config=algo, pad_id=0, eos_id=2)

        (value, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(self.model)
        return float(value), _flat(nnx.state(grads, nnx.Param))


def _cfg(**changes):
    return load_config(REPO / "recipes/cpu/demo.yml", SHAPE).replace(**changes)


def agentic_batch():
    """The trajectories with their group advantages."""
    prompts, convs, masks, rewards = trajectories()
    return prompts, convs, masks, group_advantages(rewards, G)


@pytest.fixture(scope="module")
def batch():
    return agentic_batch()


def agentic_setup(cfg, batch, noise: float):
    """Our trainer and Tunix's agentic reference from the same initial params, and the batch
    packed with behaviour logprobs: Tunix's own plus `noise` x N(0, 1) on model tokens."""
    prompts, convs, masks, adv = batch
    mesh = topology.trainer_mesh(topology.current())
    policy, params = qwen3_policy(models.create_model(models.model_config(cfg, VOCAB), 123, mesh))
    initial = _flat(params)
    ref = TunixAgentic(cfg, prompts, convs, masks, adv, initial)
    draws = np.random.default_rng(5).standard_normal(ref.completion_ids.shape)
    behaviour = ((ref.logps() + noise * draws) * ref.mask).astype(np.float32)
    seqs = [packing.Sequence(prompts[j // G], c, float(adv[j]), behaviour[j, :len(c)], m)
            for j, (c, m) in enumerate(zip(convs, masks, strict=True))]
    local, _ = phases.pack(cfg, seqs, 0, 1, None)
    trainer = Trainer(cfg, policy, params, mesh, tx=optax.sgd(LR))
    return trainer, local, ref, initial, behaviour


def test_packed_rows_carry_loss_only_on_model_tokens(batch):
    prompts, convs, masks, adv = batch
    seqs = [packing.Sequence(prompts[j // G], c, float(adv[j]), np.zeros(len(c), np.float32), m)
            for j, (c, m) in enumerate(zip(convs, masks, strict=True))]
    rows = packing.pack(seqs, 16, pad_id=0)
    assert rows.loss_mask.sum() == sum(m.sum() for m in masks) < sum(len(c) for c in convs)
    for r in range(rows.num_rows):
        for seg in set(rows.segment_ids[r].tolist()) - {0}:
            at = rows.segment_ids[r] == seg
            # The mask at position t is the model mask of the token it predicts (targets[t]).
            conv = next(j for j, c in enumerate(convs)
                        if len(c) <= at.sum() and np.array_equal(rows.tokens[r][at][-len(c):], c))
            assert rows.loss_mask[r][at].tolist()[-len(convs[conv]) - 1:-1] == \
                masks[conv].tolist()
            np.testing.assert_allclose(rows.seq_weight[r][at].sum(), 1.0, rtol=1e-6)


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
@pytest.mark.parametrize("off_policy", [False, True])
def test_agentic_update_equals_tunix(batch, epsilon_high, off_policy):
    cfg = _cfg(epsilon_high=-1.0 if epsilon_high is None else epsilon_high)
    trainer, local, ref, initial, behaviour = agentic_setup(cfg, batch, noise=0.3)
    got = trainer.step(local, off_policy=off_policy)

    ref_loss, want = ref.grads(behaviour if off_policy else None, epsilon_high)
    assert got["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert_applied(initial, trainer.params, want, LR)
    if off_policy:  # the upper clip binds on this batch: epsilon_high changes the update
        _, other = ref.grads(behaviour, 0.2 if epsilon_high else 0.28)
        assert any(not np.allclose(want[k], other[k], rtol=1e-4, atol=1e-7) for k in want)
    # Tool tokens carry nothing: their model mask is 0 in every packed row.
    assert local["loss_mask"].sum() == sum(m.sum() for m in batch[2])


def test_first_update_ratio_follows_maxtext_keys():
    assert loss.first_update_off_policy(True, True, False)  # Tunix agentic: engine logps
    assert not loss.first_update_off_policy(True, False, False)  # trainer's own: ratio 1
    assert not loss.first_update_off_policy(True, True, True)  # force_on_policy_ratio
    assert not loss.first_update_off_policy(False, True, False)  # single-turn GRPO
    assert loss.upper_epsilon(0.2, -1.0) == 0.2 and loss.upper_epsilon(0.2, 0.28) == 0.28


@pytest.mark.parametrize("override,words", [
    ("epsilon_high=0", "epsilon_high must be > 0"),
    ("off_policy_steps=2", "off_policy_steps apply to agentic rollouts only"),
    ("force_on_policy_ratio=true", "set use_agentic_rollout=true"),
])
def test_agentic_keys_refused_with_the_fix(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config(REPO / "recipes/cpu/demo.yml", [override])
