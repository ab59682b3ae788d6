"""The rollout-trainer corrections' keys under the MaxText and Tunix adapters: Tunix main's
grpo_config.sampler_is keys map onto ours; MaxText has none, so train_rl takes ours by name;
MaxText's rl.log_sampler_trainer_agreement is honoured (the mismatch is measured every step)."""

from __future__ import annotations

import multiprocessing.pool  # noqa: F401  MaxText's math_verify_pool uses it without importing it

import pytest

pytest.importorskip("maxtext")

from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # noqa: E402

from tests.test_tunix_adapter import CPU_RECIPE, pipeline, recipe_argv  # noqa: E402
from tunix_mcjax.config import ConfigError  # noqa: E402
from tunix_mcjax.maxtext import checked_config  # noqa: E402
from tunix_mcjax.tunix import config_map as tunix_map  # noqa: E402
from tunix_mcjax.tunix import make_checkpoint, model  # noqa: E402

TINY_MODEL = ["model_name=qwen3-0.6b", "override_model_config=true", "base_num_decoder_layers=2",
              "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16",
              "base_mlp_dim=128", "weight_dtype=float32", "dtype=float32", "hardware=cpu",
              "convert_checkpoint_if_possible=false", "tokenizer_path=qwen3-tokenizer",
              "log_config=false"]


def maxtext_argv(*overrides: str) -> list[str]:
    return ["", f"{MAXTEXT_CONFIGS_DIR}/post_train/rl.yml", *TINY_MODEL, *overrides]


def test_maxtext_takes_the_correction_keys_by_our_names():
    _, cfg, not_applied = checked_config(maxtext_argv(
        "sampler_is=sequence", "sampler_is_threshold=3.0", "rollout_rs=token",
        "rollout_rs_threshold=1.5", "rollout_rs_threshold_lower=0.4"), {}, num_hosts=1)
    assert not_applied == {}
    assert (cfg.sampler_is, cfg.sampler_is_threshold, cfg.rollout_rs, cfg.rollout_rs_threshold,
            cfg.rollout_rs_threshold_lower) == ("sequence", 3.0, "token", 1.5, 0.4)
    _, default, _ = checked_config(maxtext_argv(), {}, num_hosts=1)
    assert (default.sampler_is, default.rollout_rs) == ("none", "none")


def test_maxtext_bad_correction_values_are_named():
    with pytest.raises(ConfigError, match="sampler_is"):
        checked_config(maxtext_argv("sampler_is=always"), {}, num_hosts=1)
    with pytest.raises(ConfigError, match="set num_iterations=1"):
        checked_config(maxtext_argv("rollout_rs=token", "rl.num_iterations=2"), {}, num_hosts=1)


def test_maxtext_sampler_trainer_agreement_is_honoured_in_agentic_runs():
    _, cfg, not_applied = checked_config(maxtext_argv(
        "rl.use_agentic_rollout=true", "rl.log_sampler_trainer_agreement=true"), {}, num_hosts=1)
    assert cfg.use_agentic_rollout and not_applied == {}


@pytest.mark.parametrize("grpo,want", [
    ({"sampler_is": "token", "sampler_is_threshold": 3.0}, {"sampler_is": "token",
                                                            "sampler_is_threshold": 3.0}),
    ({"sampler_is": None, "sampler_is_threshold": 2.0}, {"sampler_is": "none",
                                                         "sampler_is_threshold": 2.0}),
    ({}, {}),
])
def test_tunix_sampler_is_keys_map(grpo, want):
    """Tunix main's GRPOConfig.sampler_is (null or "token") and its threshold are honoured."""
    assert tunix_map.sampler_is_values(grpo) == want
    assert {"grpo_config.sampler_is", "grpo_config.sampler_is_threshold"} <= set(
        tunix_map.HONOURED)


def test_tunix_cli_sampler_is_reaches_the_config(tmp_path):
    """Tunix's CLI config with grpo_config.sampler_is=token: honoured, not refused, and set."""
    checkpoint = tmp_path / "qwen3-tiny"
    make_checkpoint.main(checkpoint)
    cpu_argv = recipe_argv(CPU_RECIPE, tmp_path, model_dir=str(checkpoint))
    config = tunix_map.plain(pipeline(cpu_argv, "grpo_config.sampler_is=token",
                                      "grpo_config.sampler_is_threshold=3.0").config)
    tunix_map.check(config)
    keys = model.model_keys(config["actor_model_config"], str(checkpoint))
    cfg = tunix_map.to_config(config, keys, steps=3)
    assert (cfg.sampler_is, cfg.sampler_is_threshold) == ("token", 3.0)
