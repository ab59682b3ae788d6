"""Fixed-cost numbers of a traced launch, from a trace whose answer is known."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tunix_mcjax.bench import trace


def _write_trace(path: Path) -> None:
    """Two steps of 10 ms. Step 3: device threads busy 2-6 ms and 4-8 ms (union 6 ms), two
    dispatches (one from an unnamed Python thread), two syncs. Step 4: busy 1 ms, with an event
    running past the step's end."""
    def x(tid, name, ts_ms, dur_ms):
        return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts_ms * 1e3,
                "dur": dur_ms * 1e3}
    events = [{"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": n}}
              for t, n in ((1, "python"), (2, "tf_XLAExecute/1"), (3, "tf_XLAEigen/2"),
                           (4, "tf_other"))]
    events += [x(1, f"{trace.STEP_EVENT}3", 0, 10), x(1, f"{trace.STEP_EVENT}4", 10, 10),
               x(2, "ThunkExecutor::Execute", 2, 4), x(3, "fusion", 4, 4),
               x(4, "not a device thread", 0, 10), x(3, trace.SYNC, 6, 1),
               x(1, "PjitFunction(_flat_update)", 1, 1), x(5, "PjitFunction(_train_step)", 3, 1),
               x(1, trace.SYNC, 5, 3), x(3, "PjitFunction(on a device thread)", 5, 1),
               x(5, "$api.py:3095 block_until_ready", 8, 1),
               x(1, "$trainer.py:337 step", 5, 5),  # device busy 5-8 ms inside it
               x(2, "fusion", 19, 5)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_step_costs_union_device_time_and_count_python_events(tmp_path):
    _write_trace(tmp_path / "t.trace.json.gz")
    three, four = trace.step_costs(tmp_path / "t.trace.json.gz")
    assert three == {"step": 3, "wall_s": pytest.approx(0.01),
                     "device_busy": pytest.approx(0.6), "dispatches": 2, "host_syncs": 2,
                     "phases": {"train": {"wall_s": pytest.approx(0.005),
                                          "device_s": pytest.approx(0.003)}}}
    assert four["device_busy"] == pytest.approx(0.1)  # clipped at the step's end
    assert (four["dispatches"], four["host_syncs"]) == (0, 0)


def test_summarize_pools_hosts_and_reads_the_train_step_hlo(tmp_path):
    for host in (0, 1):
        _write_trace(tmp_path / f"host_{host}" / "plugins" / "profile" / "x" / "h.trace.json.gz")
    hlo = tmp_path / "hlo" / "host_0"
    hlo.mkdir(parents=True)
    (hlo / "module_1.jit__flat_update.cpu_after_optimizations.txt").write_text(
        "  %a = f32[8]{0} all-gather(%p), channel_id=1\n"
        "  %r = f32[2]{0} reduce-scatter(%g), channel_id=2\n")
    (hlo / "module_1.jit__flat_update.obj-file.fusion.o").write_bytes(b"\0")
    trace.prune_hlo_dump(tmp_path / "hlo")
    assert [p.name for p in hlo.iterdir()] == [
        "module_1.jit__flat_update.cpu_after_optimizations.txt"]
    got = trace.summarize(tmp_path)
    assert (got["hosts"], got["traced_steps"]) == (2, 4)
    assert got["device_busy"] == pytest.approx(0.35)  # median of 0.6, 0.1, 0.6, 0.1
    assert got["host_share"] == pytest.approx(0.65)
    assert got["train_step_collectives"]["total"] == {"count": 2, "bytes": 40}


def test_window_round_trips_through_the_environment(monkeypatch, tmp_path):
    window = trace.Window(21, 5, tmp_path / "traces" / "mcjax-h2")
    monkeypatch.setenv(trace.TRACE_ENV, window.encode())
    assert trace.Window.from_env() == window
    assert f"--xla_dump_to={tmp_path}/traces/mcjax-h2/hlo/host_1" in window.xla_flags(1)
    monkeypatch.delenv(trace.TRACE_ENV)
    assert trace.Window.from_env() is None


def test_summarize_without_traces_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no traced steps"):
        trace.summarize(tmp_path)
