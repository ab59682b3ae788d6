"""Model construction: random init trains every leaf; HF safetensors checkpoints load exactly."""

from __future__ import annotations

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from tunix_mcjax import models, topology
from tunix_mcjax.config import load_config

TINY = ["base_num_decoder_layers=2", "base_emb_dim=32", "base_mlp_dim=64",
        "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=8"]


def _flat(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def hf_state_dict(model, mc) -> dict[str, np.ndarray]:
    """The model's params under Hugging Face Qwen3 names and layouts ([out, in] matrices)."""
    flat = _flat(model)
    out = {"model.embed_tokens.weight": flat["embedder/input_embedding"],
           "model.norm.weight": flat["final_norm/w"]}
    for i in range(mc.num_layers):
        p, hf = f"layers/{i}/", f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj"):
            w = flat[f"{p}attn/{name}/w"]
            out[f"{hf}self_attn.{name}.weight"] = w.reshape(w.shape[0], -1).T
        o = flat[f"{p}attn/o_proj/w"]
        out[f"{hf}self_attn.o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{hf}mlp.{name}.weight"] = flat[f"{p}mlp/{name}/kernel"].T
        out[f"{hf}self_attn.q_norm.weight"] = flat[f"{p}attn/q_norm/w"]
        out[f"{hf}self_attn.k_norm.weight"] = flat[f"{p}attn/k_norm/w"]
        out[f"{hf}input_layernorm.weight"] = flat[f"{p}input_layernorm/w"]
        out[f"{hf}post_attention_layernorm.weight"] = flat[f"{p}post_attention_layernorm/w"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def test_random_init_mlp_is_not_dead():
    mc = models.model_config(load_config(None, TINY), vocab_size=40)
    flat = _flat(models.create_model(mc, seed=0))
    for i in range(mc.num_layers):
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert np.abs(flat[f"layers/{i}/mlp/{name}/kernel"]).mean() > 0.01


def test_safetensors_checkpoint_loads_exactly(tmp_path):
    cfg = load_config(None, [*TINY, f"load_parameters_path={tmp_path}"])
    mc = models.model_config(cfg, vocab_size=40)
    source = models.create_model(mc, seed=5)
    save_file(hf_state_dict(source, mc), str(tmp_path / "model.safetensors"))
    mesh = topology.trainer_mesh(topology.current())
    loaded = _flat(models.build_model(cfg, mc, mesh))
    want = _flat(source)
    assert loaded.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(loaded[key], want[key], err_msg=key)


def test_missing_checkpoint_dir_is_a_clear_error(tmp_path):
    import pytest

    from tunix_mcjax.config import ConfigError

    cfg = load_config(None, [*TINY, f"load_parameters_path={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="not a directory with \\*.safetensors"):
        models.build_model(cfg, models.model_config(cfg, 40))
