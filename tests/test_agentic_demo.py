"""The agentic tool demo (recipes/cpu/demo_agentic.yml) as 2 hosts x 1 device, through the
launcher: multi-turn trajectories on each host's engine, turn counts per step, and packed rows
whose loss covers the model's tokens only. One launch serves the module's tests."""

from __future__ import annotations

import json
import time

import pytest

from tests.mp import TINY, launch, read_jsonl

STEPS = 3
SHAPE = [*TINY, "batch_size=4", "num_generations=4", f"steps={STEPS}"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("agentic")
    t0 = time.monotonic()
    proc = launch(["--hosts", "2", "--devices-per-host", "1", "recipes/cpu/demo_agentic.yml",
                   *SHAPE, f"base_output_directory={out}"], timeout=600)
    print(f"agentic demo: {time.monotonic() - t0:.0f}s")
    return proc, out / "demo_agentic"


def test_two_hosts_exit_zero_with_multi_turn_steps(demo):
    proc, run = demo
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["hosts"] == 2 and summary["steps"] == STEPS
    for host in (0, 1):
        records = read_jsonl(run / f"host_{host}.jsonl")
        assert [r["step"] for r in records] == list(range(STEPS))
        for r in records:
            turns = r["turns"]
            assert turns["turns/max"] == 2.0 and 1.0 <= turns["turns/mean"] <= 2.0
            assert turns["tool_calls/mean"] > 0 and turns["rounds"] >= 2
            ended = sum(turns[f"status/{s}"] for s in
                        ("done", "max_turns", "context_exceeded", "tool_timeout"))
            assert ended == r["completions"] == 2 * 4  # 2 prompts x 4 per host


def test_packed_loss_covers_only_model_tokens(demo):
    _, run = demo
    for host in (0, 1):
        for r in read_jsonl(run / f"host_{host}.jsonl"):
            turns = r["turns"]
            # One token per model turn (agentic_max_turn_tokens=1): the rows' loss tokens are
            # exactly the turns; the tool observations' tokens carry none.
            assert turns["loss_tokens"] == turns["turns/mean"] * r["completions"]
            assert turns["loss_tokens"] < r["completion_tokens"]


def test_environment_failing_on_one_host_ends_every_host(tmp_path):
    t0 = time.monotonic()
    proc = launch(["--hosts", "2", "--devices-per-host", "1", "recipes/cpu/demo_agentic.yml",
                   *SHAPE, "steps=20", f"base_output_directory={tmp_path}",
                   "agentic_environment=tests.workers.bad_envs:fails_on_host_1"], timeout=300)
    elapsed, out = time.monotonic() - t0, proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert elapsed < 120  # start-up (compiles) plus a few seconds to stop
    assert "host 1: RuntimeError: host 1 cannot build its environment" in out
    # Host 0 learned it from host 1's posted abort (not only from the launcher's SIGTERM).
    assert any(line.startswith("[host 0]") and "because another host failed" in line
               for line in out.splitlines()), out[-3000:]
    assert "step    0 |" not in out


@pytest.mark.bench  # three training runs of the tool demo: a learning check
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tool_demo_learns(tmp_path, seed):
    """From random init (reward ~0.01: a call, then the right digit by chance) to using the
    tool's answer, on 2 hosts x 1 device."""
    t0 = time.monotonic()
    proc = launch(["--hosts", "2", "--devices-per-host", "1", "recipes/cpu/demo_agentic.yml",
                   f"seed={seed}", f"base_output_directory={tmp_path}"], timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "demo_agentic" / "summary.json").read_text())
    print(f"seed {seed}: reward {summary['reward_first10']:.3f} -> "
          f"{summary['reward_last10']:.3f} in {time.monotonic() - t0:.0f}s")
    assert summary["reward_first10"] <= 0.2 and summary["reward_last10"] >= 0.9
