"""The real-shape recipe end to end: Qwen3-0.6B (28 x 1024, vocab 151,936) on 2 CPU hosts."""

from __future__ import annotations

import math

import pytest

from tests.mp import read_jsonl
from tunix_mcjax.bench.memory_check import measure

RECIPE = "recipes/cpu/qwen3_0p6b.yml"


@pytest.mark.bench  # the 0.6B model on CPU
def test_qwen3_0p6b_recipe_runs_within_the_plan(tmp_path):
    """3 steps on 2 hosts x 1 device: finite losses, the engine decoding exactly the trainer's
    weights (in its bf16) after the last publish, and each host's peak memory within 25% of the
    planner's estimate."""
    result = measure("test", RECIPE, [f"base_output_directory={tmp_path}"], hosts=2, devices=1)
    steps = read_jsonl(tmp_path / "qwen3-0.6b-cpu" / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps)
    for host in result["hosts_measured"]:
        assert host["leaves_compared"] == 2 + 28 * 11  # embedding, final norm; 11 per layer
        assert host["engine_vs_trainer_max_abs"] == 0.0
        assert abs(host["error_steady"]) <= 0.25, host
