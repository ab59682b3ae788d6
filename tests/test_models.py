"""Model construction: random init trains every leaf; HF safetensors checkpoints load exactly."""

from __future__ import annotations

import numpy as np
from flax import nnx

from tunix_mcjax import models, topology
from tunix_mcjax.config import load_config

TINY = ["base_num_decoder_layers=2", "base_emb_dim=32", "base_mlp_dim=64",
        "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=8"]


def _flat(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


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
    models.save_safetensors(source, mc, tmp_path)
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
