"""Preemption-safe checkpoints on 2 real JAX processes: a host killed mid-save, SIGTERM to one
host. Either way the rerun's step records equal an unbroken run's, each step once."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from tests.mp import REPO, TINY, launch, launch_worker, read_jsonl

# Long enough that the agreed preemption step comes before the last one, even on an idle machine
# (JAX agrees on it some seconds after the notice: a dozen fast steps here).
STEPS = 40
RUN = [*TINY, "batch_size=2", "num_generations=4", "max_target_length=10",
       "enable_checkpointing=true", "checkpoint_period=2", f"steps={STEPS}"]
SAME = ("step", "prompt_indices", "loss", "grad_norm", "reward_mean", "tokens_generated")


def _args(tmp_path, name):
    return ["--hosts", "2", "--devices-per-host", "1", "recipes/cpu/demo.yml", *RUN,
            f"base_output_directory={tmp_path}", f"run_name={name}"]


def _algorithmic(run_dir):
    steps = read_jsonl(run_dir / "steps.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == len(steps)  # the summary covers the whole run, not a segment
    for host in (0, 1):
        assert [r["step"] for r in read_jsonl(run_dir / f"host_{host}.jsonl")] == \
            [r["step"] for r in steps]
    return [{k: r[k] for k in SAME} for r in steps]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unbroken")
    proc = launch(_args(tmp, "straight"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _algorithmic(tmp / "straight")


@pytest.mark.slow  # two launches and the unbroken run's
def test_host_killed_mid_save_resumes_from_previous_checkpoint(tmp_path, unbroken):
    args = _args(tmp_path, "killed")
    t0 = time.monotonic()
    proc = launch_worker("tests.workers.killed_save", args[4], args[5:], hosts=2, devices=1)
    assert proc.returncode != 0
    assert "host 1 exited with code -9" in proc.stderr + proc.stdout
    assert time.monotonic() - t0 < 200
    run = tmp_path / "killed"
    finished = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert finished == ["1"]  # step 3's save never completed; step 1's is intact
    rerun = launch(args)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "resumed from" in rerun.stdout and "step 1" in rerun.stdout
    assert _algorithmic(run) == unbroken  # steps 2-5 re-run; every step once


@pytest.mark.slow  # two launches and the unbroken run's
def test_sigterm_to_one_host_saves_everywhere_and_exits_143(tmp_path, unbroken):
    args = _args(tmp_path, "preempted")
    cmd = [sys.executable, "-m", "tunix_mcjax.launch", *args]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        for line in launcher.stdout:
            if "step    1 |" in line:
                break
        host1 = next(h for h in psutil.Process(launcher.pid).children()
                     if h.environ().get("TUNIX_MCJAX_PROCESS_ID") == "1")
        host1.terminate()  # SIGTERM: a preemption notice to this host only
        t0 = time.monotonic()
        out, _ = launcher.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 143, out[-3000:]
    assert elapsed < 60
    for host in (0, 1):
        assert f"[host {host}] host {host}: preemption notice (SIGTERM) at step" in out
    run = tmp_path / "preempted"
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    stopped_at = saved[-1]
    assert stopped_at < STEPS - 1  # the run was cut short, and saved where it stopped
    assert f"the last good checkpoint is step {stopped_at}" in out
    rerun = launch(args)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"step {stopped_at}" in rerun.stdout and "resumed from" in rerun.stdout
    assert _algorithmic(run) == unbroken


def test_jsonl_sink_drops_replayed_steps(tmp_path):
    """A resume at step 2 drops the records of steps 2+ that an interrupted run left."""
    from tunix_mcjax.metrics import JsonlSink
    from tunix_mcjax.metrics import read_jsonl as read

    path = tmp_path / "steps.jsonl"
    first = JsonlSink(path)
    for step in range(4):
        first({"step": step, "run": 1})
    first.close()
    sink = JsonlSink(path, first_step=2)
    assert sink.kept == [{"step": 0, "run": 1}, {"step": 1, "run": 1}]
    sink({"step": 2, "run": 2})
    sink.close()
    assert read(path) == [{"step": 0, "run": 1}, {"step": 1, "run": 1}, {"step": 2, "run": 2}]
