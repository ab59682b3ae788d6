"""The rollout-trainer corrections (TIS and MIS, token and sequence level): each against a plain
NumPy reference of its formula on random packed rows (several segments per row, masked tokens
inside segments as an agentic trajectory's tool tokens, padding), composed with DA's staleness
ratio and epsilon_high; and the trainer's update with each one, over micro-batches, against
Tunix's own grpo_loss_fn given the same weights as its `sampler_is_weights`."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tunix.rl import algo_core, common, function_registry
from tunix.rl.agentic import agentic_grpo_learner

from tests.mp import REPO
from tests.test_agentic_loss import LR, SHAPE, G, agentic_batch, agentic_setup
from tests.test_phases import _cfg, _flat, _setup, assert_applied
from tunix_mcjax.config import ConfigError, load_config
from tunix_mcjax.config.rules import check_rules
from tunix_mcjax.train import loss

CASES = {
    "tis-token": dict(sampler_is="token"),
    "tis-sequence": dict(sampler_is="sequence", sampler_is_threshold=1.5),
    "mis-token": dict(rollout_rs="token", rollout_rs_threshold=1.3),
    "mis-sequence": dict(rollout_rs="sequence", rollout_rs_threshold=2.5,
                         rollout_rs_threshold_lower=0.6),
    "tis-token+mis-sequence": dict(sampler_is="token", rollout_rs="sequence",
                                   rollout_rs_threshold=3.0),
}


def corrections(**keys) -> loss.Corrections:
    cfg = types.SimpleNamespace(**{**dict(sampler_is="none", sampler_is_threshold=2.0,
                                          rollout_rs="none", rollout_rs_threshold=2.0,
                                          rollout_rs_threshold_lower=-1.0), **keys})
    return loss.Corrections.of(cfg)


def random_rows(seed: int, rows: int = 3, length: int = 24) -> dict[str, np.ndarray]:
    """Packed rows: segments of 3-9 positions, the first 1-2 of each unmasked (the prompt), a
    few masked tokens inside, padding at each row's end; logps, behaviour logps and advantages
    random (log-ratios up to ~±1.5, so some ratios leave every bound)."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), np.float32)
    adv = np.zeros((rows, length), np.float32)
    for r in range(rows):
        t, s = 0, 1
        while t + 9 <= length - 2:
            n = int(rng.integers(3, 10))
            seg[r, t:t + n] = s
            completion = rng.random(n) < 0.8
            completion[:rng.integers(1, 3)] = False
            mask[r, t:t + n] = completion
            adv[r, t:t + n] = rng.normal()
            t, s = t + n, s + 1
    logps = np.log(rng.uniform(0.05, 0.95, (rows, length))).astype(np.float32)
    old = ((logps + rng.normal(0, 0.6, (rows, length))) * mask).astype(np.float32)
    weights = (mask * rng.uniform(0.01, 0.1, (rows, length))).astype(np.float32)
    return dict(segment_ids=seg, loss_mask=mask, advantages=adv * mask, logps=logps,
                old_logps=old, weights=weights)


def numpy_weights(logps, old, mask, seg, corr: loss.Corrections) -> np.ndarray:
    """The formula: r = clip(log p_trainer - log p_rollout, ±20) per loss-masked token; a
    sequence's log-ratio is clip(sum of its tokens' r, ±20); TIS weight min(exp(r), cap), MIS
    mask 1[lower <= exp(r) <= upper], each on the token's or its sequence's r."""
    r = np.clip(logps.astype(np.float64) - old, -20, 20) * mask
    seq_r = np.zeros_like(r)
    for row in range(r.shape[0]):
        for s in np.unique(seg[row]):
            at = seg[row] == s
            seq_r[row, at] = np.clip(r[row, at].sum(), -20, 20)
    ratio = {"none": np.ones_like(r), "token": np.exp(r), "sequence": np.exp(seq_r)}
    tis = ratio[corr.sampler_is]
    if corr.sampler_is != "none":
        tis = np.minimum(tis, corr.sampler_is_threshold)
    mis = ratio[corr.rollout_rs]
    kept = (corr.rollout_rs == "none") | ((corr.rollout_rs_lower <= mis)
                                          & (mis <= corr.rollout_rs_upper))
    return tis * kept


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_weights_and_terms_equal_numpy(case, seed):
    """Each correction's weights, and the weighted policy term's value and gradient in the
    logprobs, equal the NumPy formula; the rows' behaviour logprobs are stale (DA: off_policy),
    and the clip is asymmetric (epsilon_high): neither changes the corrected term, whose ratio
    is against the trainer's own logprobs (1 in value, the gradient's weight w)."""
    corr = corrections(**CASES[case])
    rows = random_rows(seed)
    batch = {k: jnp.asarray(v) for k, v in rows.items() if k != "logps"}
    logps = jnp.asarray(rows["logps"])
    want_w = numpy_weights(rows["logps"], rows["old_logps"], rows["loss_mask"],
                           rows["segment_ids"], corr)
    mask = rows["loss_mask"] > 0
    got_w = np.asarray(loss.correction_weights(logps, batch, corr))
    np.testing.assert_allclose(got_w[mask], want_w[mask], rtol=1e-5)
    kept = want_w[mask]
    assert 0 < (kept == 0).sum() or (kept < 1).any()  # the correction changes some tokens

    def total(lp):
        terms = loss.grpo_token_terms(lp, batch, None, beta=0.0, epsilon=0.2, off_policy=True,
                                      epsilon_high=0.28, corrections=corr)
        return jnp.sum(terms * batch["weights"] * batch["loss_mask"])

    value, grad = jax.value_and_grad(total)(logps)
    adv, weights = rows["advantages"], rows["weights"]
    assert float(value) == pytest.approx(float(np.sum(-adv * want_w * weights)), rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad), -adv * want_w * weights, rtol=1e-5,
                               atol=1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_token_tis_composes_with_the_staleness_ratio(seed):
    """Untruncated token TIS under DA's stale rows: the ratio against the trainer's own
    logprobs times the weight p_trainer / p_rollout is DA's one ratio p / p_rollout, in value
    and gradient (neither ratio applied twice); with the cap, the NumPy product of the two."""
    rows = random_rows(seed)
    batch = {k: jnp.asarray(v) for k, v in rows.items() if k != "logps"}
    logps = jnp.asarray(rows["logps"])

    def total(lp, corr):
        terms = loss.grpo_token_terms(lp, batch, None, beta=0.0, epsilon=1.0, off_policy=True,
                                      epsilon_high=1e9, corrections=corr)
        return jnp.sum(terms * batch["weights"] * batch["loss_mask"])

    da_value, da_grad = jax.value_and_grad(total)(logps, None)
    untruncated = corrections(sampler_is="token", sampler_is_threshold=1e9)
    value, grad = jax.value_and_grad(total)(logps, untruncated)
    assert float(value) == pytest.approx(float(da_value), rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(da_grad), rtol=1e-5, atol=1e-9)

    ratio = np.exp(np.clip(rows["logps"] - rows["old_logps"], -20, 20)) * rows["loss_mask"]
    capped = jax.grad(total)(logps, corrections(sampler_is="token", sampler_is_threshold=1.2))
    want = -rows["advantages"] * np.minimum(ratio, 1.2) * rows["weights"]
    np.testing.assert_allclose(np.asarray(capped), want, rtol=1e-5, atol=1e-9)
    assert (ratio > 1.2).any()


def test_everything_off_is_todays_term():
    """Corrections off (the default): the term is exactly the uncorrected one, on and off
    policy."""
    rows = random_rows(3)
    batch = {k: jnp.asarray(v) for k, v in rows.items() if k != "logps"}
    logps = jnp.asarray(rows["logps"])
    for off_policy in (False, True):
        want = loss.grpo_token_terms(logps, batch, None, beta=0.0, epsilon=0.2,
                                     off_policy=off_policy)
        got = loss.grpo_token_terms(logps, batch, None, beta=0.0, epsilon=0.2,
                                    off_policy=off_policy, corrections=corrections())
        assert np.array_equal(np.asarray(got), np.asarray(want))


def tunix_grads(ref, cfg, sampler_is_weights: np.ndarray) -> tuple[float, dict]:
    """Tunix's grpo_loss_fn with `sampler_is_weights` (Tunix's TIS hook: detached per-token
    weights of the policy term) and old logps = the trainer's own (None: stop_gradient)."""
    example = common.TrainExample(
        prompt_ids=jnp.asarray(ref.prompt_ids), prompt_mask=jnp.asarray(ref.prompt_ids != 0),
        completion_ids=jnp.asarray(ref.completion_ids),
        completion_mask=jnp.asarray(ref.completion_ids != 0).astype(np.float32),
        advantages=jnp.asarray(ref.advantages), ref_per_token_logps=None,
        old_per_token_logps=None,
        sampler_is_weights=jnp.asarray(sampler_is_weights, jnp.float32))
    algo = types.SimpleNamespace(
        beta=0.0, epsilon=cfg.grpo_epsilon,
        epsilon_high=loss.upper_epsilon(cfg.grpo_epsilon, cfg.epsilon_high),
        loss_algo=cfg.loss_algo, loss_agg_mode=cfg.loss_agg_mode, kl_loss_mode="kl",
        kl_clamp_value=None, temperature=cfg.decode_sampling_temperature)

    def loss_fn(m):
        return algo_core.grpo_loss_fn(m, example, algo, pad_id=0, eos_id=2)

    (value, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(ref.model)
    return float(value), _flat(nnx.state(grads, nnx.Param))


def _tunix_layout_weights(ref, behaviour, corr) -> np.ndarray:
    """The NumPy weights on Tunix's padded layout: one row per completion, one segment."""
    mask = (ref.completion_ids != 0).astype(np.float32)
    seg = mask.astype(np.int32)
    return numpy_weights(ref.logps(), behaviour, mask, seg, corr) * mask


@pytest.mark.parametrize("case,micro,off_policy", [
    ("tis-token", -1, False), ("tis-sequence", 1, True), ("mis-token", 2, False),
    ("mis-sequence", -1, True), ("tis-token+mis-sequence", 1, False)])
def test_update_equals_tunix_with_the_weights(case, micro, off_policy):
    """The trainer's update with a correction (packed rows; `micro` prompts per micro-batch,
    accumulated; a DA-stale trainer where `off_policy`; epsilon_high set) equals Tunix's
    grpo_loss_fn given the NumPy weights of the same formula, from Tunix's own logprobs, as its
    sampler_is_weights: loss and every leaf's gradient to 1e-5."""
    lr = 1e6
    cfg = _cfg(train_micro_batch_size=micro, epsilon_high=0.28, **CASES[case])
    trainer, local, ref, initial, behaviour = _setup(cfg, lr, noise=0.5)
    corr = loss.Corrections.of(cfg)
    weights = _tunix_layout_weights(ref, behaviour, corr)
    assert ((weights != 1) & (ref.completion_ids != 0)).any()
    got = trainer.step(local, off_policy=off_policy)
    want_loss, want_grads = tunix_grads(ref, cfg, weights)
    assert got["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert_applied(initial, trainer.params, want_grads, lr)
    mask = ref.completion_ids != 0
    if corr.sampler_is != "none":
        only_is = corrections(sampler_is=corr.sampler_is,
                              sampler_is_threshold=corr.sampler_is_threshold)
        want_mean = _tunix_layout_weights(ref, behaviour, only_is)[mask].mean()
        assert got["sampler_is_weight_mean"] == pytest.approx(want_mean, rel=1e-5)
    if corr.rollout_rs != "none":
        only_rs = corrections(rollout_rs=corr.rollout_rs,
                              rollout_rs_threshold=corr.rollout_rs_upper,
                              rollout_rs_threshold_lower=corr.rollout_rs_lower)
        rejected = 1 - _tunix_layout_weights(ref, behaviour, only_rs)[mask]
        assert got["rollout_rs_rejected_frac"] == pytest.approx(rejected.mean(), rel=1e-5)


@pytest.mark.parametrize("changes,needle", [
    (dict(sampler_is="token", num_iterations=2), "set num_iterations=1"),
    (dict(rollout_rs="sequence", num_iterations=3), "set num_iterations=1"),
    (dict(sampler_is_threshold=3.0), "sampler_is_threshold bound sampler_is"),
    (dict(sampler_is="token", rollout_rs_threshold_lower=0.2), "bound rollout_rs"),
])
def test_bad_combinations_are_refused_by_name(changes, needle):
    cfg = load_config(REPO / "recipes/cpu/demo.yml", [])
    with pytest.raises(ConfigError, match=needle):
        check_rules(cfg.replace(**changes))


def test_a_checkpoint_saved_before_the_keys_existed_resumes_at_their_defaults():
    """A fingerprint without the correction keys (saved before they existed) matches a config
    that leaves them off, and names them when one is on."""
    from tunix_mcjax.config import algorithm_fingerprint, fingerprint_mismatch

    cfg = load_config(REPO / "recipes/cpu/demo.yml", [])
    new = ("sampler_is", "sampler_is_threshold", "rollout_rs", "rollout_rs_threshold",
           "rollout_rs_threshold_lower")
    saved = {k: v for k, v in algorithm_fingerprint(cfg).items() if k not in new}
    assert fingerprint_mismatch(saved, cfg) == []
    assert fingerprint_mismatch(saved, cfg.replace(sampler_is="token")) == [
        "sampler_is: 'none' -> 'token'"]


def agentic_tunix_grads(ref, cfg, weights: np.ndarray, epsilon_high: float):
    """Tunix's agentic learner's policy loss with `weights` as its sampler_is_weights and the
    trainer's own logprobs as old (what its sampler_is="token" path hands the loss)."""
    algo = agentic_grpo_learner.GRPOConfig(
        num_generations=G, beta=0.0, epsilon=cfg.grpo_epsilon,
        epsilon_high=epsilon_high, loss_algo=cfg.loss_algo, loss_agg_mode=cfg.loss_agg_mode)
    algo.temperature = cfg.decode_sampling_temperature
    example = common.TrainExample(
        prompt_ids=jnp.asarray(ref.prompt_ids), prompt_mask=jnp.asarray(ref.prompt_ids != 0),
        completion_ids=jnp.asarray(ref.completion_ids), completion_mask=jnp.asarray(ref.mask),
        advantages=jnp.asarray(ref.advantages), ref_per_token_logps=None,
        old_per_token_logps=None, sampler_is_weights=jnp.asarray(weights, jnp.float32))
    policy_loss = function_registry.get_policy_loss_fn(algo.policy_loss_fn)

    def loss_fn(m):
        return policy_loss(m, example, algo_config=algo, pad_id=0, eos_id=2)

    (value, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(ref.model)
    return float(value), _flat(nnx.state(grads, nnx.Param))


@pytest.mark.parametrize("case", ["tis-token", "tis-token+mis-sequence"])
def test_agentic_update_with_a_correction_equals_tunix(case):
    """Multi-turn trajectories (tool tokens masked) under use_rollout_logps (off-policy against
    the engine's logprobs) and epsilon_high: the corrected update equals Tunix's agentic loss
    given the NumPy weights, which leave tool tokens out of every sequence's ratio."""
    cfg = load_config(REPO / "recipes/cpu/demo.yml", SHAPE).replace(
        use_agentic_rollout=True, epsilon_high=0.28,
        agentic_environment="tunix_mcjax.agentic.demo:lookup_conversation", **CASES[case])
    trainer, local, ref, initial, behaviour = agentic_setup(cfg, agentic_batch(), noise=0.5)
    assert trainer.off_policy  # use_rollout_logps: the engine's logprobs from the first update
    got = trainer.step(local)
    seg = (ref.completion_ids != 0).astype(np.int32)
    weights = numpy_weights(ref.logps(), behaviour, ref.mask, seg,
                            loss.Corrections.of(cfg)) * ref.mask
    assert ((weights != 1) & (ref.mask > 0)).any()
    want_loss, want = agentic_tunix_grads(ref, cfg, weights, 0.28)
    assert got["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert_applied(initial, trainer.params, want, LR)
