"""The shared step loop's hook schedule: every=n, the last step, a stop, and the two call points."""

from __future__ import annotations

import threading

import pytest

from tunix_mcjax.runtime.loop import StepLoop
from tunix_mcjax.runtime.records import StepRecord


class Stopped(Exception):
    pass


def loop_with_log(steps: int, stop_at: int | None = None) -> tuple[StepLoop, list]:
    log: list = []
    loop = StepLoop(steps, lambda step: step == stop_at, lambda step: Stopped(step))
    loop.add_start_hook(lambda step: log.append(("start", step)))
    loop.add_hook(lambda end: log.append(("every3", end.step, end.last, end.stopping)), every=3)
    loop.add_hook(lambda end: log.append(("first", end.step)) if end.step == end.first else None)
    loop.add_record_hook(lambda rec: log.append(("record", rec.step)))
    return loop, log


def test_every_n_and_the_last_step():
    loop, log = loop_with_log(8)
    loop.run(2, lambda step: log.append(("step", step)))
    assert [e for e in log if e[0] == "every3"] == [
        ("every3", 2, False, False), ("every3", 5, False, False), ("every3", 7, True, False)]
    assert [e for e in log if e[0] == "first"] == [("first", 2)]
    # Start hooks before each step, step hooks after it; no record arrives by itself.
    assert log[:3] == [("start", 2), ("step", 2), ("every3", 2, False, False)]
    assert [e[1] for e in log if e[0] == "step"] == list(range(2, 8))
    assert not [e for e in log if e[0] == "record"]


def test_a_stop_runs_every_hook_at_its_step_then_raises():
    loop, log = loop_with_log(10, stop_at=3)
    with pytest.raises(Stopped, match="3"):
        loop.run(0, lambda step: log.append(("step", step)))
    assert [e for e in log if e[0] == "every3"] == [
        ("every3", 2, False, False), ("every3", 3, False, True)]
    assert [e[1] for e in log if e[0] == "step"] == [0, 1, 2, 3]


def test_follow_runs_record_hooks_then_step_hooks_then_yields():
    loop, log = loop_with_log(4)
    records = (StepRecord(t, {"step": t, "compiled": t == 0}) for t in range(4))
    for rec in loop.follow(0, records):
        log.append(("yield", rec.step))
    at_2 = [e for e in log if e[1] == 2]
    assert at_2 == [("record", 2), ("every3", 2, False, False), ("yield", 2)]
    assert [e[1] for e in log if e[0] == "every3"] == [2, 3]


def test_every_must_be_positive():
    loop, _ = loop_with_log(4)
    with pytest.raises(ValueError, match="every=0"):
        loop.add_hook(lambda end: None, every=0)


@pytest.mark.parametrize("background", [False, True])
def test_the_export_hook_writes_on_o1s_thread_only_when_it_is_on(tmp_path, background):
    from tests.mp import TINY
    from tunix_mcjax.config import load_config
    from tunix_mcjax.runtime.reporting import StepExport

    cfg = load_config(None, [*TINY, f"base_output_directory={tmp_path}", "log_period=100",
                             f"rl_async_metrics_export={str(background).lower()}"])
    export = StepExport(cfg, 0)
    threads = []

    class Watched:  # the steps.jsonl sink, noting which thread writes to it
        def __init__(self, sink):
            self.sink = sink

        def __call__(self, rec):
            threads.append(threading.current_thread().name)
            self.sink(rec)

        def close(self):
            self.sink.close()

    export.step_log = Watched(export.step_log)
    export(StepRecord(1, {"step": 1, "compiled": False}))
    export.close()
    assert threads == (["metrics"] if background else ["MainThread"])
    assert export.records == [{"step": 1, "compiled": False}]
    assert (cfg.run_dir / "steps.jsonl").read_text().count("\n") == 1
