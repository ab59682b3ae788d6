"""The bench's `tunix-cli` arm: Tunix's own `grpo_main` on a profile, timed by the step clock."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.mp import REPO, read_jsonl
from tunix_mcjax.admission import global_prompt_indices
from tunix_mcjax.bench import profiles, step
from tunix_mcjax.bench.tunix_cli_arm import allocate_in_order, cli_argv, cli_config
from tunix_mcjax.config import load_config

STEPS = 2
LORA = ["lora_rank=4", "lora_alpha=8.0", "lora_module_path=.*gate_proj|.*up_proj"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """Two steps of demo-cpu through `tunix.cli.grpo_main` on 2 CPU devices, LoRA on."""
    out = tmp_path_factory.mktemp("tunix_cli")
    recipe = profiles.write_workload(profiles.PROFILES["demo-cpu"], out)
    keys = [f"steps={STEPS}", f"data_repeat_period={STEPS}", "run_name=cli",
            f"base_output_directory={out / 'runs'}", *LORA]
    cmd = step.tunix_cli_command(recipe, 2, "fsdp", keys)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return load_config(recipe, keys), out / "runs" / "cli"


@pytest.mark.bench  # one grpo_main run: ~20 s CPU, 50-60 s at load 10
def test_the_arm_runs_grpo_main_with_the_workload_and_lora_as_tunix_keys(cli_run):
    cfg, run_dir = cli_run
    argv = json.loads((run_dir / "tunix_cli_argv.json").read_text())
    assert argv[0] == "grpo_main" and argv[1].endswith("tunix_cli.yaml")
    assert "actor_model_config.lora_config.rank=4" in argv
    assert "actor_model_config.lora_config.alpha=8.0" in argv
    assert "actor_model_config.lora_config.module_path=.*gate_proj|.*up_proj" in argv
    assert "actor_model_config.mesh.shape=(2,1)" in argv
    counts = json.loads((run_dir / "tunix_cli_model.json").read_text())
    mlp = cfg.base_emb_dim + cfg.base_mlp_dim  # rank-4 adapters on gate and up, per layer
    assert counts["lora_params"] == cfg.base_num_decoder_layers * 2 * 4 * mlp
    tunix_cfg = yaml.safe_load((run_dir / "tunix_cli.yaml").read_text())
    assert tunix_cfg["rl_runtime"] == "default"
    assert tunix_cfg["batch_size"] == cfg.batch_size
    assert tunix_cfg["grpo_config"]["num_generations"] == cfg.num_generations
    assert tunix_cfg["rollout_config"]["total_generation_steps"] == cfg.max_completion_length
    assert tunix_cfg["reward_functions"] == ["tunix_mcjax.bench.tunix_cli_rewards.next_digit"]


@pytest.mark.bench  # one grpo_main run: ~20 s CPU, 50-60 s at load 10
def test_steps_jsonl_has_one_timed_record_per_step_in_the_report_schema(cli_run):
    cfg, run_dir = cli_run
    records = read_jsonl(run_dir / "steps.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    rows = cfg.batch_size * cfg.num_generations
    for s, r in enumerate(records):
        want = global_prompt_indices(1000, cfg.batch_size, cfg.seed, s, cfg.data_repeat_period)
        assert r["prompt_indices"] == want.tolist()  # the other arms' prompts, in their order
        assert r["prompt_tokens_mean"] == 3.0  # BOS + "d="
        assert 1 <= r["completion_len_max"] <= cfg.max_completion_length
        assert r["tokens_generated"] == pytest.approx(rows * r["completion_len_mean"])
        assert 0 <= r["truncated_frac"] <= 1 and 0 <= r["reward_mean"] <= 1
        assert r["phase_s"]["generate"] > 0 and r["phase_s"]["train"] > 0
        assert r["phase_s"]["reward"] > 0
        assert r["step_s"] >= sum(r["phase_s"].values())
    assert records[0]["compiled"]


def test_allocate_in_order_hands_out_devices_in_turn_and_refuses_too_many():
    got = allocate_in_order([("actor", 2), ("rollout", 1)], devices=["d0", "d1", "d2"])
    assert got == {"actor": ["d0", "d1"], "rollout": ["d2"]}
    with pytest.raises(ValueError, match="rollout needs 2 devices; 1 are left"):
        allocate_in_order([("actor", 2), ("rollout", 2)], devices=["d0", "d1", "d2"])


def test_step_plans_every_layout_of_the_tunix_cli_arm():
    runs = step.plan(["tunix-cli", "mcjax"], [2], 1, ["fsdp", "one-device"], 1)
    assert [r.name for r in runs] == ["tunix-cli-fsdp-h2", "tunix-cli-one-device-h2", "mcjax-h2"]
    cmd = runs[0].command(REPO / "recipe.yml", REPO / "out", [])
    assert cmd[:3] == [sys.executable, "-m", "tunix_mcjax.bench.tunix_cli_arm"]
    assert cmd[3:7] == ["--devices", "2", "--layout", "fsdp"]


def test_cli_config_carries_the_profile_workload_and_lora_in_run_qwen3_form(tmp_path):
    recipe = profiles.write_workload(profiles.PROFILES["gsm8k-cpu-lora"], tmp_path)
    cfg = load_config(recipe, ["run_name=r", f"base_output_directory={tmp_path}"])
    got = cli_config(cfg, str(recipe), [], tmp_path / "tok")
    assert got["rl_runtime"] == "default" and got["rollout_engine"] == "vanilla"
    assert (got["batch_size"], got["num_batches"]) == (4, 40)
    assert got["grpo_config"]["num_generations"] == 16
    assert got["rollout_config"] == {"total_generation_steps": 128, "max_prompt_length": 32,
                                     "temperature": 1.0, "top_p": 1.0, "top_k": None,
                                     "eos_tokens": [-1]}  # ignore_eos: every completion is 128
    assert got["reward_functions"] == ["tunix_mcjax.bench.tunix_cli_rewards.gsm8k"]
    assert "mesh" not in got["reference_model_config"]  # shares the actor's mesh
    argv = cli_argv(cfg, tmp_path / "c.yaml", 2)
    assert argv[2:] == [
        "actor_model_config.mesh.shape=(2,1)", "actor_model_config.mesh.axis_names=('fsdp','tp')",
        "actor_model_config.lora_config.rank=64", "actor_model_config.lora_config.alpha=64.0",
        "actor_model_config.lora_config.module_path=.*q_proj|.*k_proj|.*v_proj|.*o_proj"
        "|.*gate_proj|.*down_proj|.*up_proj"]


def test_cli_config_refuses_a_sampling_strategy_tunix_cli_cannot_express(tmp_path):
    cfg = load_config(None, ["dataset_name=next_digit", "decode_sampling_strategy=greedy"])
    with pytest.raises(ValueError, match="decode_sampling_strategy=greedy has no Tunix CLI key"):
        cli_config(cfg, "recipe.yml", [], tmp_path)
