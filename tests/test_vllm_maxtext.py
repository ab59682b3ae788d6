"""rollout_engine=vllm under the MaxText adapter: MaxText's vLLM keys are honoured there; its
page-pool keys size every engine's pool."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("maxtext")

from tests.test_maxtext_adapter import maxtext_argv  # noqa: E402
from tunix_mcjax.config import ConfigError, json_object  # noqa: E402
from tunix_mcjax.maxtext import checked_config, config_map  # noqa: E402

VLLM_SETTINGS = ("hbm_utilization_vllm=0.5", "max_num_seqs=32", "max_num_batched_tokens=512",
                 "enable_dp_attention=true", "async_scheduling=false")


def test_maxtext_vllm_keys_are_honoured_under_rollout_engine_vllm():
    argv = maxtext_argv("rollout_engine=vllm", "rl_publish_weights_single_call=true",
                        "rollout_data_parallelism=4", *VLLM_SETTINGS)
    kwargs = {"vllm_additional_config": {"skip_warmup": True},
              "vllm_hf_overrides": {"rms_norm_eps": 1e-5}}
    _, cfg, not_applied = checked_config(argv, kwargs, num_hosts=2)
    assert not_applied == {}
    assert cfg.rollout_engine == "vllm"
    assert (cfg.hbm_utilization_vllm, cfg.rollout_max_batch_size, cfg.max_num_batched_tokens,
            cfg.enable_dp_attention, cfg.async_scheduling) == (0.5, 32, 512, True, False)
    assert json_object(cfg, "vllm_additional_config") == {"skip_warmup": True}
    assert json_object(cfg, "vllm_hf_overrides") == {"rms_norm_eps": 1e-5}
    assert cfg.rollout_data_parallelism == 2  # MaxText counts replicas over all hosts


def test_maxtext_pool_keys_size_the_jax_engine_and_vllm_only_keys_do_not_apply():
    _, cfg, not_applied = checked_config(
        maxtext_argv(*VLLM_SETTINGS, "vllm_block_size=32", "enable_prefix_caching=true"), {}, 1)
    assert cfg.rollout_engine == "jax"
    assert set(not_applied) == {"enable_dp_attention", "async_scheduling"}
    assert cfg.rollout_max_batch_size == 32  # max_num_seqs has an equivalent in every engine
    assert (cfg.hbm_utilization_vllm, cfg.max_num_batched_tokens, cfg.vllm_block_size,
            cfg.enable_prefix_caching) == (0.5, 512, 32, True)
    # MaxText's defaults, as they are: no prefix caching, the engine's own chunk and page size.
    _, cfg, _ = checked_config(maxtext_argv(), {}, 1)
    assert (cfg.hbm_utilization_vllm, cfg.max_num_batched_tokens, cfg.vllm_block_size,
            cfg.enable_prefix_caching) == (0.72, 0, 0, False)


def test_maxtext_pool_keys_reach_the_maxtext_engines_pool():
    """The maxtext engine decodes over our page pool: MaxText's pool keys size it."""
    import jax

    from tunix_mcjax.runtime import phases

    pool = ("rollout_engine=maxtext", "vllm_block_size=8", "max_num_batched_tokens=32",
            "enable_prefix_caching=true", "free_kv_cache_during_weight_sync=false",
            "max_prefill_predict_length=16", "max_target_length=32")
    config, cfg, not_applied = checked_config(maxtext_argv(*pool), {}, 1)
    assert cfg.rollout_engine == "maxtext" and not_applied == {}
    engine = phases.default_engine(cfg, config, jax.local_devices()[:1], 0, ())
    options = engine.options
    assert (options.page_size, options.max_num_batched_tokens, options.prefix_caching,
            options.free_pool_after_generate) == (8, 32, True, False)
    _, small, _ = checked_config(maxtext_argv(*pool, "hbm_utilization_vllm=1e-9"), {}, 1)
    with pytest.raises(ValueError, match="raise hbm_utilization_vllm"):
        phases.default_engine(small, config, jax.local_devices()[:1], 0, ())


def test_rollout_engine_vllm_needs_the_single_call_publish():
    with pytest.raises(ConfigError, match="rl_publish_weights_single_call=true"):
        checked_config(maxtext_argv("rollout_engine=vllm"), {}, 1)


def test_one_table_holds_the_vllm_keys():
    assert set(config_map.VLLM_ENGINE_KEYS) <= config_map.NOT_APPLICABLE
    assert set(config_map.VLLM_ENGINE_KEYS) <= set(config_map.VLLM_KEYS)
    argv, kwargs, engine = config_map.pop_rollout_engine(
        ["", "rl.yml", "rollout_engine=vllm", "batch_size=2"], {"x": 1})
    assert (argv, kwargs, engine) == (["", "rl.yml", "batch_size=2"], {"x": 1}, "vllm")
    assert json.dumps(config_map.vllm_values(type("C", (), {
        "enable_dp_attention": False, "async_scheduling": True, "vllm_additional_config": {},
        "vllm_hf_overrides": {}})()), sort_keys=True) == json.dumps(
        {"async_scheduling": True, "enable_dp_attention": False})
