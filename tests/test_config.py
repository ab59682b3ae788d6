"""Bad configs fail fast, before any process touches a device, with messages that name the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.mp import REPO
from tunix_mcjax.config import ConfigError, algorithm_fingerprint, load_config

DEMO = REPO / "recipes/cpu/demo.yml"


def test_demo_recipe_loads_with_maxtext_names():
    cfg = load_config(DEMO, ["learning_rate=1e-4", "grpo_beta=0.04"])
    assert cfg.learning_rate == 1e-4 and cfg.grpo_beta == 0.04
    assert cfg.max_completion_length == cfg.max_target_length - cfg.max_prefill_predict_length


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'learning_rat'.*learning_rate"):
        load_config(DEMO, ["learning_rat=0.1"])


def test_wrong_value_type_is_named():
    with pytest.raises(ConfigError, match=r"rl_gc_freeze_after_warmup must be bool"):
        load_config(DEMO, ["rl_gc_freeze_after_warmup=maybe"])
    with pytest.raises(ConfigError, match=r"batch_size must be int"):
        load_config(DEMO, ["batch_size=2.5"])


def test_completion_budget_must_be_positive():
    with pytest.raises(ConfigError, match=r"completion budget .* must be > 0"):
        load_config(DEMO, ["max_prefill_predict_length=6", "max_target_length=6"])


def test_indivisible_batch_and_tp():
    cfg = load_config(DEMO, ["batch_size=3"])
    with pytest.raises(ConfigError, match=r"batch_size=3 .* does not divide by 2 hosts"):
        cfg.validate_topology(num_hosts=2, local_devices=2)
    cfg = load_config(DEMO, ["rollout_tensor_parallelism=2"])
    with pytest.raises(ConfigError, match=r"rollout_tensor_parallelism=2 does not divide the 3"):
        cfg.validate_topology(num_hosts=1, local_devices=3)


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunix_mcjax.launch", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_launcher_rejects_bad_configs_before_starting_hosts():
    bad = _launch("--hosts", "2", str(DEMO), "batch_size=5")
    assert bad.returncode == 2
    assert "does not divide by 2 hosts" in bad.stderr
    assert "[host" not in bad.stdout  # no process was started
    unknown = _launch("--hosts", "2", str(DEMO), "num_generation=4")
    assert unknown.returncode == 2 and "num_generations" in unknown.stderr


def test_over_long_prompt_is_rejected_without_filtering():
    from tunix_mcjax.runtime.phases import tokenize_prompts
    from tunix_mcjax.tokenizer import char_tokenizer

    tok = char_tokenizer()
    tokens, kept = tokenize_prompts(tok, ["1=", "12="], 4)
    assert [len(t) for t in tokens] == [3, 4] and kept.tolist() == [0, 1]
    with pytest.raises(ConfigError, match=r"prompt 1 has 5 tokens, over max_prefill_predict"):
        tokenize_prompts(tok, ["1=", "123="], 4)


def test_gspo_token_and_num_iterations_load():
    """Both run off-policy now (tests/test_phases.py); mu counts updates, so warm-up does too."""
    cfg = load_config(DEMO, ["loss_algo=gspo-token", "num_iterations=2"])
    assert (cfg.loss_algo, cfg.num_iterations) == ("gspo-token", 2)
    warm = cfg.replace(warmup_steps_fraction=0.1, steps=100)
    assert algorithm_fingerprint(warm)["warmup_steps"] == 20
    with pytest.raises(ConfigError, match="num_iterations must be >= 1 optimizer updates"):
        load_config(DEMO, ["num_iterations=0"])


def test_a_key_out_of_its_range_is_named_with_its_value_and_an_example():
    with pytest.raises(ConfigError, match=r"hbm_utilization_vllm must be in \(0, 1\] .*, got 1.5"
                                          r"\. Example: hbm_utilization_vllm=0.72"):
        load_config(DEMO, ["hbm_utilization_vllm=1.5"])


def test_every_key_has_a_description():
    from tunix_mcjax.config.core import FIELDS

    missing = [k for k, f in FIELDS.items() if not f.metadata.get("doc")]
    assert not missing, f"keys without a description: {missing}"


def test_key_reference_page_is_what_the_generator_writes():
    from tunix_mcjax.config import reference

    assert reference.PAGE.read_text() == reference.render(), (
        "docs/configuration-reference.md is out of date: "
        "run python -m tunix_mcjax.config.reference")
