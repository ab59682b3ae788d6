"""The colocated demo on vLLM rollouts: 2 hosts x 1 device, 20 steps, reward rises; with reward
workers, streamed from the vLLM session, it trains as with `generate` (make test-vllm).
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


@pytest.mark.vllm
@pytest.mark.slow
def test_streamed_rewards_on_a_vllm_session_train_as_generate(tmp_path):
    """With reward workers the host decodes on the vLLM session, each group scored as soon as
    it is whole: the same completions, rewards and losses as `generate` without workers."""
    records = {}
    for workers in (0, 2):
        out = tmp_path / f"workers{workers}"
        proc = launch(["--hosts", "2", "--devices-per-host", "1", "recipes/cpu/demo_vllm.yml",
                       "steps=3", f"reward_num_workers={workers}",
                       f"base_output_directory={out}"], timeout=DEMO_BUDGET_S)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        records[workers] = [json.loads(line) for host in (0, 1) for line in
                            (out / "demo_vllm" / f"host_{host}.jsonl").read_text().splitlines()]
    keys = ("step", "host", "reward_sum", "completion_tokens", "completion_len_max", "loss")
    assert [[r[k] for k in keys] for r in records[2]] == [[r[k] for k in keys]
                                                           for r in records[0]]
    assert all(r["reward_hidden_s"] > 0 for r in records[2])  # streamed: scored while decoding
    assert all(r["reward_hidden_s"] == 0 for r in records[0])
