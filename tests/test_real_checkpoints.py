"""Hugging Face Qwen3 checkpoints at real shapes: loaded by `models.load_model` (Tunix's
safetensors loader), every layer in its own place, and decoded by the engine.

The checkpoints are written here with a distinct random value in every tensor of every layer
(norms included), so a layer loaded into another layer's slot, or a transposed matrix, shows.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from tests.test_models import _flat
from tunix_mcjax import models, topology
from tunix_mcjax.config import load_config
from tunix_mcjax.engine.base import SamplingParams
from tunix_mcjax.engine.jax_engine import JaxEngine
from tunix_mcjax.engine.stops import model_stop_ids

# Qwen3-0.6B's width, heads and MLP; a small vocabulary keeps the files small.
REAL_WIDTH = ["base_emb_dim=1024", "base_mlp_dim=3072", "base_num_query_heads=16",
              "base_num_kv_heads=8", "head_dim=128", "rope_max_timescale=1000000"]
TWELVE_LAYERS = ["base_num_decoder_layers=12", "base_emb_dim=256", "base_mlp_dim=768",
                 "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=64"]
VOCAB = 2048


def hf_checkpoint(mc, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """A Qwen3 state dict under HF names and layouts, every tensor drawn independently."""
    rng = np.random.default_rng(seed)
    d, q, kv, f = mc.embed_dim, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, \
        mc.hidden_dim
    shapes = {"model.embed_tokens.weight": (mc.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(mc.num_layers):
        hf = f"model.layers.{i}."
        shapes |= {f"{hf}self_attn.q_proj.weight": (q, d), f"{hf}self_attn.k_proj.weight": (kv, d),
                   f"{hf}self_attn.v_proj.weight": (kv, d), f"{hf}self_attn.o_proj.weight": (d, q),
                   f"{hf}mlp.gate_proj.weight": (f, d), f"{hf}mlp.up_proj.weight": (f, d),
                   f"{hf}mlp.down_proj.weight": (d, f),
                   f"{hf}self_attn.q_norm.weight": (mc.head_dim,),
                   f"{hf}self_attn.k_norm.weight": (mc.head_dim,),
                   f"{hf}input_layernorm.weight": (d,),
                   f"{hf}post_attention_layernorm.weight": (d,)}
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:  # norms near 1, so activations stay in range
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = value.astype(dtype)
    return out


def write_checkpoint(path, state: dict[str, np.ndarray]) -> None:
    """Two safetensors shards (as large checkpoints come) plus Qwen3's generation config."""
    names = sorted(state)
    half = len(names) // 2
    save_file({k: state[k] for k in names[:half]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[half:]}, str(path / "model-00002-of-00002.safetensors"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))


def load_config_shape(overrides: list[str]):
    cfg = load_config(None, [*overrides, f"vocab_size={VOCAB}"])
    return cfg, models.model_config(cfg, VOCAB), None


def load(path, overrides: list[str]):
    cfg = load_config(None, [*overrides, f"vocab_size={VOCAB}", f"load_parameters_path={path}"])
    mc = models.model_config(cfg, VOCAB)
    mesh = topology.trainer_mesh(topology.current())
    return cfg, mc, models.build_model(cfg, mc, mesh)


def test_twelve_layer_round_trip_restores_every_layer_to_its_own_place(tmp_path):
    _, mc, _ = load_config_shape(TWELVE_LAYERS)
    written = hf_checkpoint(mc, seed=12)
    write_checkpoint(tmp_path, written)
    _, mc, model = load(tmp_path, TWELVE_LAYERS)
    restored = models.hf_state_dict(model, mc)
    assert restored.keys() == written.keys()
    for name in written:
        np.testing.assert_array_equal(restored[name], written[name], err_msg=name)
    # Every layer differs from every other, so the equality above pins each to its own slot.
    q = [written[f"model.layers.{i}.self_attn.q_norm.weight"] for i in range(12)]
    assert len({v.tobytes() for v in q}) == 12


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_real_width_checkpoint_loads_and_decodes(tmp_path, dtype):
    """Qwen3-0.6B's width with 2 layers, in fp32 or bf16 (as Qwen3 ships): the loaded params
    hold the file's values in the run's weight_dtype, and the engine decodes them as Tunix does."""
    overrides = [*REAL_WIDTH, "base_num_decoder_layers=2"]
    _, mc, _ = load_config_shape(overrides)
    written = hf_checkpoint(mc, seed=6, dtype=dtype)
    write_checkpoint(tmp_path, written)
    cfg, mc, model = load(tmp_path, overrides)
    flat = _flat(model)
    assert {v.dtype for v in flat.values()} == {np.dtype(np.float32)}
    restored = models.hf_state_dict(model, mc)
    for name in written:
        np.testing.assert_array_equal(restored[name], written[name].astype(np.float32),
                                      err_msg=name)

    sampling_mc = models.model_config(cfg, VOCAB, for_sampling=True)
    stop_ids = model_stop_ids(type("Tok", (), {"eos_token_id": 5})(), [str(tmp_path)])
    assert stop_ids == (5, 7)
    engine = JaxEngine(sampling_mc, jax.devices()[:1], pad_id=0, eos_ids=stop_ids,
                       max_prompt_length=8, max_new_tokens=4)
    engine.load_weights(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    prompt = [11, 12, 13, 14]
    greedy = SamplingParams(max_new_tokens=4, greedy=True, ignore_eos=True)
    [out] = engine.generate([prompt], greedy, seed=0)
    seq = prompt + out.tokens.tolist()
    n = len(seq)
    logits, _ = model(jnp.asarray([seq]), jnp.arange(n)[None], None,
                      jnp.tril(jnp.ones((1, n, n), bool)))
    logits = np.array(logits[0, len(prompt) - 1:-1])
    want_logprobs = np.asarray(jax.nn.log_softmax(logits))[np.arange(4), out.tokens]
    logits[:, 0] = -np.inf  # pad is not a stop id here, so the engine never samples it
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    np.testing.assert_allclose(out.logprobs, want_logprobs, atol=2e-3)
