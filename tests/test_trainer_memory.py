"""Trainer memory: blockwise segment attention, chunked logprobs, the gather-once choice,
micro-batch accumulation, the non-finite gate and Tunix's kl metrics (one process, one device).
Multi-device layouts (sharded compute, accumulation across devices) are in
tests/test_trainer_layouts.py."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh
from tunix.rl import algo_core, common

from tunix_mcjax import memory, models
from tunix_mcjax.config import ConfigError, load_config
from tunix_mcjax.train import layer_runs, packing
from tunix_mcjax.train.loss import chunked_token_logps, token_logps
from tunix_mcjax.train.qwen3_layer import attention as dense_attention
from tunix_mcjax.train.segment_attention import segment_attention
from tunix_mcjax.train.trainer import Trainer, loss_weights, packed_attention_mask, qwen3_policy

DEMO = "recipes/cpu/demo.yml"
SEGMENTS = [[1] * 5 + [2] * 6 + [0] * 2, [1] * 3 + [2] * 3 + [3] * 7]


def one_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"),
                axis_types=(AxisType.Auto, AxisType.Auto))


def qkv(b=2, t=13, n=4, kv=2, h=8):
    key = jax.random.key(0)
    return tuple(jax.random.normal(jax.random.fold_in(key, i), (b, t, heads, h))
                 for i, heads in enumerate((n, kv, kv)))


# --- attention ---------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [4, 13, 512])  # padded last block, exact, one block
def test_segment_attention_equals_masked_path(block):
    q, k, v = qkv()
    seg = jnp.array(SEGMENTS)
    cotangent = jax.random.normal(jax.random.key(1), q.shape)

    def blockwise(q, k, v):
        return jnp.sum(segment_attention(q, k, v, seg, block) * cotangent)

    def masked(q, k, v):
        return jnp.sum(dense_attention(q, k, v, packed_attention_mask(seg)) * cotangent)

    np.testing.assert_allclose(segment_attention(q, k, v, seg, block),
                               dense_attention(q, k, v, packed_attention_mask(seg)), atol=1e-5)
    got = jax.grad(blockwise, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(masked, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_segments_do_not_see_each_other():
    q, k, v = qkv()
    seg = jnp.array(SEGMENTS)
    out = segment_attention(q, k, v, seg, 4)
    # Changing segment 2's keys and values of row 0 leaves segment 1's outputs as they were.
    k2, v2 = k.at[0, 5:11].set(9.0), v.at[0, 5:11].set(9.0)
    out2 = segment_attention(q, k2, v2, seg, 4)
    np.testing.assert_array_equal(out[0, :5], out2[0, :5])
    assert not np.allclose(out[0, 5:11], out2[0, 5:11])


def test_policy_forward_equals_tunix_qwen3_with_dense_mask():
    cfg = load_config(DEMO)
    model = models.create_model(models.model_config(cfg, 40), 0)
    policy, _ = qwen3_policy(model)
    tokens = jax.random.randint(jax.random.key(2), (2, 13), 0, 40)
    seg = jnp.array(SEGMENTS)
    positions = jnp.array([[*range(5), *range(6), 0, 0], [*range(3), *range(3), *range(7)]])
    want, _ = model(tokens, positions, None, packed_attention_mask(seg))
    got = policy.forward(model, tokens, positions, seg)
    valid = np.asarray(seg) > 0
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5)


def temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_attention_memory_is_below_the_dense_scores():
    b, t, n, h = 1, 1024, 4, 16
    q, k, v = qkv(b, t, n, n, h)
    seg = jnp.ones((b, t), jnp.int32)

    def blockwise(q, k, v):
        return jax.grad(lambda *a: jnp.sum(segment_attention(*a, seg, 128)))(q, k, v)

    def masked(q, k, v):
        return jax.grad(lambda *a: jnp.sum(dense_attention(*a, packed_attention_mask(seg))))(
            q, k, v)

    dense_scores = b * n * t * t * 4
    assert temp_bytes(masked, q, k, v) >= dense_scores
    assert temp_bytes(blockwise, q, k, v) < dense_scores / 2


@pytest.mark.slow  # two train steps compiled and measured
def test_remat_keeps_gradients_and_drops_activation_memory():
    cfg = load_config(DEMO, ["base_num_decoder_layers=4"])
    model = models.create_model(models.model_config(cfg, 40), 0)
    policy, params = qwen3_policy(model)
    b, t = 2, 256
    tokens = jax.random.randint(jax.random.key(4), (b, t), 0, 40)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    seg = jnp.ones((b, t), jnp.int32)

    def grads(remat):
        def loss(params):
            m = policy.model(params)
            return jnp.sum(policy.hidden(m, tokens, positions, seg, remat=remat) ** 2)
        return jax.grad(loss)

    jax.tree.map(lambda a, w: np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6),
                 grads(True)(params), grads(False)(params))
    # Without remat the scanned layers keep their projections' outputs only
    # (packed_qwen3.SAVED_WITHOUT_REMAT), so remat saves less than it did unrolled (measured:
    # 10.6 MB against 14.3; unrolled it halved them).
    assert temp_bytes(grads(True), params) < 0.8 * temp_bytes(grads(False), params)


# --- chunked logprobs --------------------------------------------------------------------------

def logps_problem(b=3, t=37, d=16, vocab=50):
    key = jax.random.key(3)
    hidden = jax.random.normal(key, (b, t, d))
    w = jax.random.normal(jax.random.fold_in(key, 1), (vocab, d))
    targets = jax.random.randint(jax.random.fold_in(key, 2), (b, t), 0, vocab)
    weights = jax.random.normal(jax.random.fold_in(key, 3), (b, t))
    return hidden, w, targets, weights


@pytest.mark.parametrize("chunk_tokens", [3, 16, 40])  # 1 position per chunk; padded; exact
def test_chunked_logps_equal_unchunked_with_gradients(chunk_tokens):
    hidden, w, targets, weights = logps_problem()

    def score(hidden, w, chunk):
        logps = chunked_token_logps(hidden, targets, lambda h: h @ w.T, 0.7,
                                    chunk_tokens=chunk, rows_per_device=3)
        return jnp.sum(logps * weights), logps

    (_, got), got_grads = jax.value_and_grad(score, argnums=(0, 1), has_aux=True)(
        hidden, w, chunk_tokens)
    (_, want), want_grads = jax.value_and_grad(score, argnums=(0, 1), has_aux=True)(hidden, w, 0)
    np.testing.assert_allclose(want, token_logps(hidden @ w.T, targets, 0.7), atol=1e-6)
    np.testing.assert_allclose(got, want, atol=1e-6)
    # Gradients sum chunks' contributions in another fp32 order: 1e-6 of the leaf's scale.
    for g, wnt in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, wnt, rtol=1e-5, atol=1e-6 * float(jnp.abs(wnt).max()))


def test_chunked_logps_never_hold_the_whole_logits():
    b, t, d, vocab = 4, 256, 32, 16384
    hidden, w, targets, weights = logps_problem(b, t, d, vocab)

    def grads(chunk):
        def loss(hidden, w):
            logps = chunked_token_logps(hidden, targets, lambda h: h @ w.T, 1.0,
                                        chunk_tokens=chunk, rows_per_device=b)
            return jnp.sum(logps * weights)
        return lambda hidden, w: jax.grad(loss, argnums=(0, 1))(hidden, w)

    whole_logits = b * t * vocab * 4
    assert temp_bytes(grads(0), hidden, w) >= whole_logits
    assert temp_bytes(grads(64), hidden, w) < whole_logits / 3


# --- the gather-once choice and micro-batch layout ---------------------------------------------

GIB = 1 << 30


@pytest.mark.parametrize("setting,count,devices,hbm,want", [
    ("true", 8e9, 8, 95 * GIB, True),  # overrides decide
    ("false", 1e6, 8, 95 * GIB, False),
    ("auto", 1e6, 1, 95 * GIB, False),  # one device: nothing to gather
    ("auto", 0.6e9, 8, 95 * GIB, True),  # Qwen3-0.6B fp32: 4.8 GB of 95 GiB
    ("auto", 8e9, 8, 95 * GIB, False),  # Qwen3-8B fp32: 64 GB replica + grads
    ("auto", 0.6e9, 2, 8 * GIB, False),  # 0.6B on 8 GiB devices
])
def test_gather_params_once_choice(setting, count, devices, hbm, want):
    assert memory.gather_params_once(setting, param_count=int(count), bytes_per_param=4,
                                     num_devices=devices, device_memory_bytes=hbm) is want


def test_device_memory_bytes():
    accelerator = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 95 * GIB})
    cpu = types.SimpleNamespace(memory_stats=lambda: None)
    assert memory.device_memory_bytes(accelerator, 4) == 95 * GIB
    assert 0 < memory.device_memory_bytes(cpu, 4) * 4 <= memory.device_memory_bytes(cpu, 1)


def test_micro_batch_layout():
    assert memory.num_micro_batches(8, -1) == memory.num_micro_batches(8, 8) == 1
    assert memory.num_micro_batches(8, 2) == 4
    assert memory.micro_batch_rows(8, 4) == (4, 2)
    assert memory.micro_batch_rows(8, 3) == (3, 3)  # K padded to 9
    assert memory.micro_batch_rows(2, 8) == (2, 1)  # no micro-batch of padding only
    with pytest.raises(ValueError, match="must divide"):
        memory.num_micro_batches(8, 3)


@pytest.mark.parametrize("override,match", [
    ("train_micro_batch_size=3", "must divide batch_size=16"),
    ("train_micro_batch_size=32", "must divide batch_size=16"),
    ("train_logits_chunk_tokens=-1", "train_logits_chunk_tokens must be >= 0"),
    ("fsdp_gather_params_once=maybe", "is not one of auto, true, false"),
    ("remat_policy=minimal", "is not one of none, full"),
])
def test_bad_memory_keys_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(DEMO, [override])


def test_gather_key_takes_yaml_booleans():
    assert load_config(DEMO).fsdp_gather_params_once == "auto"
    assert load_config(DEMO, ["fsdp_gather_params_once=true"]).fsdp_gather_params_once == "true"
    assert load_config(DEMO, {"fsdp_gather_params_once": False}).fsdp_gather_params_once == "false"


# --- the update: finite gate and Tunix's metrics -----------------------------------------------

def fixed_rows(cfg, seed=7):
    from tests.workers.fixed_update import fixed_batch

    g = cfg.num_generations
    prompts, completions, rewards = fixed_batch(cfg.batch_size, g, seed)
    adv = np.asarray(algo_core.compute_advantages(rewards, g))
    seqs = [packing.Sequence(prompts[j // g], c, float(adv[j]), np.zeros(len(c), np.float32))
            for j, c in enumerate(completions)]
    rows = packing.pack(seqs, cfg.max_target_length, pad_id=0)
    local = {f: getattr(rows, f) for f in ("tokens", "positions", "segment_ids", "targets",
                                           "loss_mask", "advantages", "old_logps")}
    local["weights"] = loss_weights(rows, cfg.loss_agg_mode, len(seqs),
                                    sum(len(c) for c in completions)).astype(np.float32)
    return local, (prompts, completions, adv)


def small_cfg(*extra):
    return load_config(DEMO, ["batch_size=4", "num_generations=4", "max_prefill_predict_length=4",
                              "max_target_length=10", *extra])


def test_nonfinite_step_changes_nothing():
    cfg = small_cfg()
    mesh = one_device_mesh()
    policy, params = qwen3_policy(models.create_model(models.model_config(cfg, 40), 0, mesh))
    trainer = Trainer(cfg, policy, params, mesh)
    before = jax.tree.map(np.asarray, (trainer.params, trainer.opt_state))
    local, _ = fixed_rows(cfg)
    bad = {**local, "advantages": np.where(local["loss_mask"] > 0, np.nan, 0).astype(np.float32)}
    metrics = trainer.step(bad)
    assert metrics["finite"] == 0.0 and not np.isfinite(metrics["loss"])
    after = jax.tree.map(np.asarray, (trainer.params, trainer.opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)
    metrics = trainer.step(local)
    assert metrics["finite"] == 1.0
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b),
                         jax.tree.map(np.asarray, trainer.params), before[0])
    assert all(jax.tree.leaves(moved))


@pytest.mark.parametrize("mode", ["sequence-mean-token-mean", "token-mean"])
def test_metrics_are_tunix_loss_kl_and_kl_loss(mode):
    cfg = small_cfg("grpo_beta=0.1", f"loss_agg_mode={mode}")
    mesh = one_device_mesh()
    model = models.create_model(models.model_config(cfg, 40), 0, mesh)
    ref_model = models.create_model(models.model_config(cfg, 40), 1, mesh)
    policy, params = qwen3_policy(model)
    trainer = Trainer(cfg, policy, params, mesh)
    trainer.ref_params = layer_runs.stack(nnx.state(ref_model, nnx.Param))
    local, (prompts, completions, adv) = fixed_rows(cfg)
    metrics = trainer.step(local)

    g = cfg.num_generations
    pl, cl = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = np.zeros((len(completions), pl), np.int32)
    completion_ids = np.zeros((len(completions), cl), np.int32)
    for j, c in enumerate(completions):
        prompt_ids[j, pl - len(prompts[j // g]):] = prompts[j // g]
        completion_ids[j, :len(c)] = c
    graphdef, state = nnx.split(ref_model)
    ref = common.compute_per_token_logps(graphdef, state, jnp.asarray(prompt_ids),
                                         jnp.asarray(completion_ids), 0, 2)
    example = common.TrainExample(
        prompt_ids=jnp.asarray(prompt_ids), prompt_mask=jnp.asarray(prompt_ids != 0),
        completion_ids=jnp.asarray(completion_ids),
        completion_mask=jnp.asarray(completion_ids != 0).astype(np.float32),
        advantages=jnp.asarray(adv), ref_per_token_logps=ref, old_per_token_logps=None)
    algo = types.SimpleNamespace(beta=0.1, epsilon=cfg.grpo_epsilon, loss_algo="grpo",
                                 loss_agg_mode=mode, kl_loss_mode="kl", kl_clamp_value=None,
                                 temperature=1.0)
    start = models.create_model(models.model_config(cfg, 40), 0)
    loss, aux = algo_core.grpo_loss_fn(start, example, algo, pad_id=0, eos_id=2)
    assert abs(float(aux["kl"])) > 1e-3  # the policies differ, so the check has teeth
    for key, want in (("loss", loss), ("kl", aux["kl"]), ("kl_loss", aux["kl_loss"])):
        assert metrics[key] == pytest.approx(float(want), rel=1e-5, abs=1e-7), key
