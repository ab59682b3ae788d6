"""MaxText recipes under rl_runtime=mcjax: micro-batching on MaxText's model, evaluation scored
by MaxText's functions, the profiler and TensorBoard, paths through etils.epath, the vLLM-key
mapping and the CPU recipe's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

pytest.importorskip("maxtext")

from tests.mp import REPO  # noqa: E402
from tests.test_maxtext_adapter import maxtext_argv  # noqa: E402
from tests.workers_memory.updates import flat, local_rows  # noqa: E402
from tunix_mcjax.config import ConfigError  # noqa: E402
from tunix_mcjax.maxtext import checked_config, config_map, policy  # noqa: E402
from tunix_mcjax.train.trainer import Trainer  # noqa: E402

# Untied logits: with logits_via_embedding MaxText multiplies by a bf16 copy of the embedding
# table, whose rounding differs between a batch and its micro-batches beyond fp32's 1e-5.
GRPO = ["batch_size=4", "rl.num_generations=4", "max_prefill_predict_length=4",
        "max_target_length=10", "rl.grpo_beta=0.04", "vocab_size=64", "num_test_batches=0",
        "logits_via_embedding=false", "rl_runtime=mcjax"]


def maxtext_update(micro: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(initial params, params after one SGD update, metrics) of MaxText's tiny Qwen3 on one
    fixed batch, the update split into batch_size / `micro` micro-batches."""
    config, cfg, _ = checked_config(maxtext_argv(*GRPO, f"train_micro_batch_size={micro}"), {},
                                    num_hosts=1)
    model, mesh = policy.build_model(config, pad_id=0)
    trainer_policy, params = policy.maxtext_policy(model, config)
    initial = flat(params)
    trainer = Trainer(cfg, trainer_policy, params, mesh, tx=optax.sgd(1e4))
    local = local_rows(cfg, len(jax.devices()))
    assert trainer.micro_batch_layout(len(local["tokens"]))[0] == 4 // micro
    metrics = trainer.step(local)
    return initial, flat(trainer.params), metrics


@pytest.mark.slow  # two MaxText train steps compiled
def test_micro_batched_update_equals_one_batch_on_maxtext_model():
    initial, whole, whole_metrics = maxtext_update(4)
    _, split, split_metrics = maxtext_update(1)
    moved = 0
    for key, want in whole.items():
        np.testing.assert_allclose(split[key], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=key)
        moved += int(not np.array_equal(want, initial[key]))
    assert moved == len(whole)  # every leaf moved, so the comparison has teeth
    for metric in ("loss", "grad_norm", "kl"):
        assert split_metrics[metric] == pytest.approx(whole_metrics[metric], rel=1e-5, abs=1e-7)


# --- config keys ------------------------------------------------------------------------------

def test_recipe_keys_land_in_config(tmp_path):
    _, cfg, not_applied = checked_config(maxtext_argv(
        "rl_runtime=mcjax", "num_test_batches=3", "eval_interval=2", "eval_mode=pass_at_1",
        "num_eval_passes=4", "profiler=xplane", "skip_first_n_steps_for_profiler=0",
        "profiler_steps=2", "max_num_seqs=7", "hbm_utilization_vllm=0.5",
        "base_output_directory=gs://bucket/out", "run_name=r"), {}, num_hosts=2)
    assert (cfg.num_test_batches, cfg.eval_interval) == (3, 2)
    assert (cfg.profiler, cfg.skip_first_n_steps_for_profiler, cfg.profiler_steps) == \
        ("xplane", 0, 2)
    assert cfg.enable_tensorboard  # MaxText's default
    assert cfg.rollout_max_batch_size == 7  # max_num_seqs has an equivalent
    assert not_applied == {}  # the jax engine's page pool takes hbm_utilization_vllm
    assert cfg.hbm_utilization_vllm == 0.5
    assert str(cfg.run_dir) == "gs://bucket/out/r"  # no longer refused


def test_every_vllm_key_is_mapped_or_reported():
    for key, target in config_map.VLLM_KEYS.items():
        if target is None:
            assert key in config_map.NOT_APPLICABLE and key not in config_map.HONOURED
        else:
            assert key in config_map.HONOURED and key not in config_map.NOT_APPLICABLE


@pytest.mark.parametrize("overrides,match", [
    (["profiler=nsys"], "nsys"),
    (["profiler=xplane", "skip_first_n_steps_for_profiler=9"], "past the last"),
])
def test_profiler_settings_the_runtime_cannot_run_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        checked_config(maxtext_argv("rl_runtime=mcjax", "num_batches=3", *overrides), {},
                       num_hosts=1)


def test_jsonl_sink_reads_back_through_epath(tmp_path):
    from etils import epath

    from tunix_mcjax import metrics

    path = epath.Path(tmp_path) / "d" / "steps.jsonl"
    sink = metrics.JsonlSink(path)
    sink({"step": 0, "x": 1})
    sink({"step": 1, "x": 2})
    sink.close()
    resumed = metrics.JsonlSink(path, first_step=1)
    assert resumed.kept == [{"step": 0, "x": 1}]
    resumed.close()
    assert json.loads(path.read_text()) == {"step": 0, "x": 1}


# --- evaluation -------------------------------------------------------------------------------

@pytest.mark.slow  # a 2-host MaxText launch
def test_evaluation_equals_maxtext_evaluate_and_sums_over_hosts(tmp_path):
    """Two hosts' shares scored by our evaluator, summed, against MaxText's `evaluate` on the
    same responses (tests/workers/maxtext_eval.py; a subprocess, since MaxText's math-verify
    pool spawns workers that re-import the main module)."""
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "tests.workers.maxtext_eval", str(out)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    ours, theirs = got["ours"], got["maxtext"]
    assert theirs["total"] == ours["total"] == 4
    assert theirs["corr"] == pytest.approx(ours["corr"]) == 2.0  # pass@1: half right per prompt
    for key in ("accuracy", "partial_accuracy", "format_accuracy", "mean_reward"):
        assert theirs[key] == pytest.approx(ours[key]), key
    assert ours["format_accuracy"] == pytest.approx(37.5)  # 3 prompts formatted on 1 of 2
    assert ours["mean_reward"] != 0.0
