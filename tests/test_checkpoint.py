"""Orbax checkpoints: a resumed run continues exactly where an uninterrupted one would be."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.mp import TINY, launch, read_jsonl
from tunix_mcjax.train.checkpoint import Checkpointer

# Batches repeat every 2 steps and O3 weighs observed output lengths (which vary: up to 36
# tokens, EOS honoured), so steps 2-3 are admitted by what steps 0-1 decoded: a resume must
# bring that history back too.
RUN = [*TINY, "batch_size=4", "num_generations=4", "max_target_length=40",
       "enable_checkpointing=true", "checkpoint_period=2", "data_repeat_period=2",
       "rl_balance_prompts_by_length=true", "rl_balance_by_expected_output=true"]


def _run(tmp_path, name, steps):
    proc = launch(["--hosts", "2", "--devices-per-host", "2", "recipes/cpu/demo.yml", *RUN,
                   f"steps={steps}", f"base_output_directory={tmp_path}", f"run_name={name}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # three 2-host launches
def test_resume_matches_uninterrupted_run(tmp_path):
    _run(tmp_path, "straight", 4)
    _run(tmp_path, "resumed", 2)
    out = _run(tmp_path, "resumed", 4)
    assert "resumed from" in out and "step 1" in out
    straight = read_jsonl(tmp_path / "straight" / "steps.jsonl")
    resumed = read_jsonl(tmp_path / "resumed" / "steps.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(straight, resumed, strict=True):
        assert a["prompt_indices"] == b["prompt_indices"]
        assert a["loss"] == b["loss"] and a["reward_mean"] == b["reward_mean"]
    for host in (0, 1):
        assert [r["local_prompt_indices"] for r in read_jsonl(tmp_path / "straight"
                                                              / f"host_{host}.jsonl")] == \
            [r["local_prompt_indices"] for r in read_jsonl(tmp_path / "resumed"
                                                           / f"host_{host}.jsonl")]
    kept = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert kept == ["1", "3"]


def test_checkpoint_without_newer_entries_restores_the_rest(tmp_path):
    """A checkpoint that predates an entry of the run state restores everything else."""
    ckpt = Checkpointer(tmp_path / "ckpt", max_to_keep=1)
    ckpt.save(0, {"params": {"w": jnp.arange(3.0)}})
    like = {"params": {"w": jnp.zeros(3)}, "output_len": np.zeros((2, 5))}
    restored = ckpt.restore(0, like)
    ckpt.close()
    assert restored.keys() == {"params"}
    np.testing.assert_array_equal(restored["params"]["w"], [0.0, 1.0, 2.0])


def test_numpy_entries_restore_as_numpy(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", max_to_keep=1)
    lengths = np.array([[3.0, 0.0, 7.5], [1.0, 0.0, 2.0]])
    ckpt.save(4, {"params": {"w": jnp.ones(2)}, "output_len": lengths})
    restored = ckpt.restore(4, {"params": {"w": jnp.zeros(2)}, "output_len": np.zeros((2, 3))})
    ckpt.close()
    assert isinstance(restored["output_len"], np.ndarray)
    np.testing.assert_array_equal(restored["output_len"], lengths)


def test_a_per_layer_checkpoint_restores_into_stacked_layers(tmp_path):
    """A checkpoint in Tunix's per-layer layout (params and Adam's moments, as saved before the
    trainer stacked its layers) restores into the trainer's stacked tree, every value exact."""
    import jax
    from flax import nnx

    from tunix_mcjax import models
    from tunix_mcjax.config import load_config
    from tunix_mcjax.train import layer_runs
    from tunix_mcjax.train.trainer import make_optimizer

    cfg = load_config(None, [*TINY, "base_num_decoder_layers=3"])
    mc = models.model_config(cfg, 32)
    _, saved_params = nnx.split(models.create_model(mc, 0), nnx.Param)
    tx = make_optimizer(cfg)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.25), saved_params)
    _, saved_opt = tx.update(grads, tx.init(saved_params), saved_params)
    ckpt = Checkpointer(tmp_path / "ckpt", 2)
    ckpt.save(4, {"params": saved_params, "opt_state": saved_opt})

    _, other = nnx.split(models.create_model(mc, 1), nnx.Param)
    like_params = layer_runs.stack(other)
    like = {"params": like_params, "opt_state": tx.init(like_params)}
    restored = ckpt.restore(4, like)
    ckpt.close()
    assert jax.tree.structure(restored) == jax.tree.structure(like)
    assert list(restored["params"]["layers"]) == ["from_0"]
    want = jax.tree.leaves({"params": saved_params, "opt_state": saved_opt})
    got = jax.tree.leaves(layer_runs.unstack(restored))
    assert len(got) == len(want) > 10
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    moments = [x for x in jax.tree.leaves(restored["opt_state"]) if x.ndim == 4]
    assert moments and all(np.abs(np.asarray(m)).max() > 0 for m in moments)
