"""The colocated demo on vLLM rollouts: 2 hosts x 1 device, 20 steps, reward rises (make test-vllm).
"""

import importlib.util
import json

import pytest

from tests.mp import launch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed: run `make setup-vllm test-vllm`", allow_module_level=True)

DEMO_BUDGET_S = 900  # two vLLM engines start (about 30 s each) on a loaded 2-core machine


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_on_vllm_rollouts_raises_the_reward(tmp_path):
    proc = launch(["--hosts", "2", "--devices-per-host", "1", "recipes/cpu/demo_vllm.yml",
                   "steps=20", f"base_output_directory={tmp_path}"], timeout=DEMO_BUDGET_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "demo_vllm" / "summary.json").read_text())
    facts = [json.loads(line) for line in
             (tmp_path / "demo_vllm" / "steps.jsonl").read_text().splitlines()]
    print(f"reward {summary['reward_first10']:.3f} -> {summary['reward_last10']:.3f}")
    assert summary["hosts"] == 2 and summary["devices_per_host"] == 1
    assert summary["steps"] == 20 and len(facts) == 20
    assert all(f["finite"] for f in facts)
    assert summary["reward_last10"] > 1.5 * summary["reward_first10"]
