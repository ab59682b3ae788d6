"""O1-O4 (paper Appendix B): each flag does what it says, with behaviour asserted."""

from __future__ import annotations

import json
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from tests.mp import TINY, launch_worker
from tunix_mcjax import models, topology
from tunix_mcjax.config import load_config
from tunix_mcjax.engine.jax_engine import JaxEngine
from tunix_mcjax.metrics import Exporter
from tunix_mcjax.publish import Publisher


class SlowSink:
    def __init__(self, delay: float):
        self.delay, self.records, self.lock = delay, [], threading.Lock()

    def __call__(self, record):
        time.sleep(self.delay)
        with self.lock:
            self.records.append(record)


def test_o1_slow_exporter_does_not_slow_the_step():
    delay, steps = 0.05, 20
    sink = SlowSink(delay)
    exporter = Exporter(sink, background=True, queue_size=64)
    t0 = time.perf_counter()
    for step in range(steps):
        exporter.export({"step": step})
    step_loop_s = time.perf_counter() - t0
    exporter.close()
    assert step_loop_s < 0.2 * delay * steps  # the loop never waited on the sink
    assert [r["step"] for r in sink.records] == list(range(steps))  # all flushed, in order

    inline_sink = SlowSink(delay)
    inline = Exporter(inline_sink, background=False)
    t0 = time.perf_counter()
    for step in range(5):
        inline.export({"step": step})
    assert time.perf_counter() - t0 >= 5 * delay  # the base path does pay for the sink


def test_o1_full_queue_is_reported_not_dropped(capsys):
    sink = SlowSink(0.02)
    exporter = Exporter(sink, background=True, queue_size=2)
    for step in range(10):
        exporter.export({"step": step})
    exporter.close()
    assert "metrics queue full" in capsys.readouterr().err
    assert sorted(r["step"] for r in sink.records) == list(range(10))


def test_o1_sink_error_surfaces():
    def broken(record):
        raise OSError("disk full")

    exporter = Exporter(broken, background=True)
    exporter.export({"step": 0})
    with pytest.raises(RuntimeError, match="metrics exporter thread failed"):
        exporter.close()


@pytest.mark.slow  # a 2-host launch
def test_o2_gc_frozen_after_warmup(tmp_path):
    overrides = [*TINY, "steps=2", "batch_size=2", "num_generations=2",
                 "rl_gc_freeze_after_warmup=true", f"base_output_directory={tmp_path}",
                 "run_name=gc"]
    proc = launch_worker("tests.workers.gc_check", "recipes/cpu/demo.yml", overrides,
                         hosts=1, devices=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads((tmp_path / "gc" / "gc.json").read_text())
    assert state["enabled_before"] is True
    assert state["enabled_after"] is False and state["freeze_count"] > 0


def _engine_weights(single_call: bool):
    cfg = load_config(None, TINY)
    mc = models.model_config(cfg, vocab_size=40)
    topo = topology.current()
    mesh = topology.trainer_mesh(topo)
    params = nnx.to_pure_dict(nnx.state(models.create_model(mc, 0, mesh), nnx.Param))
    engine = JaxEngine(models.model_config(cfg, 40, for_sampling=True), topo.local_devices,
                       pad_id=0, eos_ids=(2,), max_prompt_length=4, max_new_tokens=2)
    publisher = Publisher(mesh, single_call=single_call)
    publisher.publish(params, engine)
    weights = {k: np.asarray(v) for k, v in engine._params[0].items()}
    return publisher, weights, len(jax.tree.leaves(params))


def test_o4_single_call_publish():
    one, w_one, leaves = _engine_weights(single_call=True)
    per_leaf, w_leaf, _ = _engine_weights(single_call=False)
    assert (one.gather_calls, one.load_calls) == (1, 1)
    assert per_leaf.gather_calls == per_leaf.load_calls == leaves > 1
    assert w_one.keys() == w_leaf.keys() and len(w_one) == leaves
    for key in w_one:
        np.testing.assert_array_equal(w_one[key], w_leaf[key])
