"""Stops come from the model: Qwen3's real tokenizer, whose pad `<|endoftext|>` is also an EOS.

A tiny Qwen3 over the real 151,669-token vocabulary is biased so that greedy decoding picks a
given EOS id at a known step. The completion must stop there, and packing and the trainer's loss
must count that final token even though it has the pad id, while real padding slots (same id)
stay out of the loss.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from transformers import AutoTokenizer

from tunix_mcjax import models, topology
from tunix_mcjax.config import load_config
from tunix_mcjax.engine.base import SamplingParams
from tunix_mcjax.engine.jax_engine import JaxEngine
from tunix_mcjax.engine.stops import generation_config_eos_ids, model_stop_ids
from tunix_mcjax.tokenizer import resolve_tokenizer_path
from tunix_mcjax.train import layer_runs, packing
from tunix_mcjax.train.trainer import Trainer, qwen3_policy

ENDOFTEXT, IM_END = 151643, 151645
QWEN3_GENERATION_CONFIG = {"bos_token_id": 151643, "eos_token_id": [151645, 151643],
                           "pad_token_id": 151643}
TINY = ["base_num_decoder_layers=1", "base_emb_dim=32", "base_mlp_dim=64",
        "base_num_query_heads=2", "base_num_kv_heads=1", "head_dim=16"]
PROMPT_TEXT = "Question: what is 2 + 2? Answer:"
MAX_NEW = 6


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_tokenizer_path("qwen3-tokenizer"))


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """What a Qwen3 checkpoint dir carries besides weights: its generation config."""
    path = tmp_path_factory.mktemp("qwen3")
    (path / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION_CONFIG))
    return path


def test_stop_ids_are_tokenizer_eos_and_generation_config(tokenizer, checkpoint_dir, tmp_path):
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (ENDOFTEXT, IM_END)
    assert model_stop_ids(tokenizer, [str(checkpoint_dir), ""]) == (IM_END, ENDOFTEXT)
    assert model_stop_ids(tokenizer, [str(tmp_path), ""]) == (IM_END,)  # no generation config
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 151643}')
    assert generation_config_eos_ids(tmp_path) == (ENDOFTEXT,)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        generation_config_eos_ids(tmp_path)


def _params(model) -> dict:
    return jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _biased(params: dict, target: int, like: int, scale: float) -> dict:
    """Params whose (tied) embedding of `target` is `scale` x that of `like`: where `like` leads
    by enough, `target` now leads."""
    biased = jax.tree.map(np.copy, params)
    embedding = biased["embedder"]["input_embedding"]
    embedding[target] = embedding[like] * scale
    return biased


def _stop_later(engine: JaxEngine, params: dict, prompt: list[int], reference: list[int],
                stop_id: int) -> tuple[dict, list[int]]:
    """Biased params under which greedy decoding (stops ignored) first emits `stop_id` at a
    step > 0, and that free run."""
    free_run = SamplingParams(max_new_tokens=MAX_NEW, greedy=True, ignore_eos=True)
    for like in reference[1:]:
        for scale in (2.0, 4.0, 8.0, 20.0):
            biased = _biased(params, stop_id, like, scale)
            engine.load_weights(biased)
            tokens = engine.generate([prompt], free_run, seed=0)[0].tokens.tolist()
            if stop_id in tokens[1:] and tokens[0] != stop_id:
                return biased, tokens
    raise AssertionError("no bias makes greedy decoding emit the stop id after step 0")


def _engine(mc, params, eos_ids) -> JaxEngine:
    engine = JaxEngine(mc, jax.devices()[:1], pad_id=ENDOFTEXT, eos_ids=eos_ids,
                       max_prompt_length=16, max_new_tokens=MAX_NEW)
    engine.load_weights(params)
    return engine


@pytest.fixture(scope="module")
def setup(tokenizer):
    cfg = load_config(None, TINY)
    mc = models.model_config(cfg, len(tokenizer), for_sampling=True)
    params = _params(models.create_model(mc, seed=3))
    prompt = tokenizer.encode(PROMPT_TEXT)
    free_run = SamplingParams(max_new_tokens=MAX_NEW, greedy=True, ignore_eos=True)
    reference = _engine(mc, params, ()).generate([prompt], free_run, seed=0)[0].tokens.tolist()
    return cfg, mc, params, reference, prompt


@pytest.mark.parametrize("stop_id", [ENDOFTEXT, IM_END])
def test_a_sampled_eos_ends_the_completion_and_is_its_trained_final_token(
        setup, tokenizer, checkpoint_dir, stop_id):
    cfg, mc, params, reference, prompt = setup
    eos_ids = model_stop_ids(tokenizer, [str(checkpoint_dir)])
    engine = _engine(mc, params, eos_ids)
    biased, free_run = _stop_later(engine, params, prompt, reference, stop_id)
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, greedy=True), seed=0)
    assert out.tokens.tolist() == free_run[:free_run.index(stop_id) + 1]  # ends at the EOS
    assert out.finish_reason == "eos" and len(out.tokens) > 1

    # Packing: the final token keeps its loss slot; the padding after it (the same id when the
    # stop is <|endoftext|>) has none.
    seq = packing.Sequence(np.asarray(prompt, np.int32), out.tokens, 1.0, out.logprobs)
    row_len = 24
    rows = packing.pack([seq], row_len, tokenizer.pad_token_id)
    n = len(prompt) + len(out.tokens)
    assert rows.loss_mask.sum() == len(out.tokens)
    assert rows.targets[0, n - 2] == stop_id and rows.loss_mask[0, n - 2] == 1.0
    assert (rows.tokens[0, n:] == ENDOFTEXT).all() and not rows.segment_ids[0, n:].any()
    assert not rows.loss_mask[0, n - 1:].any()

    # The loss: the trainer's gradient is that of every completion token, the final one included.
    loss_grad_norm = _trainer_grad_norm(cfg, mc, biased, rows)
    with_final = _reference_grad_norm(mc, biased, prompt, out.tokens.tolist())
    without_final = _reference_grad_norm(mc, biased, prompt, out.tokens.tolist()[:-1])
    np.testing.assert_allclose(loss_grad_norm, with_final, rtol=1e-4)
    assert abs(with_final - without_final) > 1e-3 * with_final


def test_pad_is_masked_only_when_it_is_not_a_stop(setup):
    """With only the tokenizer's EOS (<|im_end|>), <|endoftext|> is padding and never sampled."""
    _, mc, params, reference, prompt = setup
    biased = _biased(params, ENDOFTEXT, like=reference[0], scale=20.0)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    [masked] = _engine(mc, biased, (IM_END,)).generate([prompt], greedy, seed=0)
    assert ENDOFTEXT not in masked.tokens.tolist() and len(masked.tokens) == MAX_NEW
    [stops] = _engine(mc, biased, (IM_END, ENDOFTEXT)).generate([prompt], greedy, seed=0)
    assert stops.tokens.tolist() == [ENDOFTEXT] and stops.finish_reason == "eos"


def _trainer_grad_norm(cfg, mc, params, rows: packing.Rows) -> float:
    """The trainer's grad norm for one token-mean GRPO step on `rows` (advantage 1)."""
    topo = topology.current()
    mesh = topology.trainer_mesh(topo)
    devices = len(topo.local_devices)
    rows = packing.pad_rows(rows, packing.rows_per_device([rows.num_rows], devices) * devices,
                            ENDOFTEXT)
    train_cfg = cfg.replace(loss_agg_mode="token-mean")
    model = models.create_model(models.model_config(train_cfg, mc.vocab_size), 0, mesh)
    policy, _ = qwen3_policy(model)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    state = layer_runs.stack(jax.tree.map(lambda x, s: jax.device_put(x, s.sharding), state,
                                          nnx.state(model, nnx.Param)))
    local = {f: getattr(rows, f) for f in ("tokens", "positions", "segment_ids", "targets",
                                           "loss_mask", "advantages", "old_logps")}
    local["weights"] = (rows.loss_mask / rows.loss_mask.sum()).astype(np.float32)
    metrics = Trainer(train_cfg, policy, state, mesh).step(local)
    assert np.isfinite(metrics["loss"])
    return metrics["grad_norm"]


def _reference_grad_norm(mc, params, prompt: list[int], completion: list[int]) -> float:
    """Grad norm of -mean(log p(completion token)) from Tunix's causal forward, unpacked."""
    model = models.create_model(models.model_config(load_config(None, TINY), mc.vocab_size), 0)
    graphdef, state = nnx.split(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    tokens = jnp.asarray([prompt + completion])
    n = tokens.shape[1]

    def loss(state):
        causal = jnp.tril(jnp.ones((1, n, n), bool))
        logits, _ = nnx.merge(graphdef, state)(tokens, jnp.arange(n)[None], None, causal)
        logps = jax.nn.log_softmax(logits[0, len(prompt) - 1:-1])
        return -jnp.mean(logps[jnp.arange(len(completion)), jnp.asarray(completion)])

    return float(optax.tree.norm(jax.grad(loss)(state)))
