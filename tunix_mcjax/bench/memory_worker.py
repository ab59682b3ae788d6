"""One host of a memory-checked run: `python -m tunix_mcjax.bench.memory_worker RECIPE [k=v]`.

Started by `bench.memory_check` through the launcher. Runs the colocated loop, then writes
`<run_dir>/memory_host<h>.json`: the process's RSS once the libraries are loaded and JAX is
initialised (the runtime's own baseline), its lifetime peak RSS, the peak RSS of each step
(sampled every 10 ms; step 0 includes XLA's compiles, which run in host memory), and how far
the engine's weights are from the trainer's after the last publish (cast to the engine's dtype),
and the pages of the engine's KV pool (paged engines).
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import time

import jax
import numpy as np
import psutil
from jax.experimental import multihost_utils

from tunix_mcjax import topology
from tunix_mcjax.config import load_config
from tunix_mcjax.runtime import colocated


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class RssSampler:
    """The largest RSS seen since the last `take()`, sampled on a background thread."""

    def __init__(self, period_s: float = 0.01):
        self._process, self._peak, self._period = psutil.Process(), 0, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._process.memory_info().rss)
            time.sleep(self._period)

    def take(self) -> int:
        peak, self._peak = max(self._peak, self._process.memory_info().rss), 0
        return peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def per_step_peaks(rt: colocated.ColocatedRuntime, sampler: RssSampler) -> list[int]:
    """Wraps `rt.step` so that each step's peak RSS is recorded."""
    peaks: list[int] = []
    step = rt.step

    def measured(i: int) -> None:
        sampler.take()
        step(i)
        peaks.append(sampler.take())

    rt.step = measured
    return peaks


def engine_vs_trainer(rt: colocated.ColocatedRuntime) -> dict[str, float]:
    """Largest |engine - trainer| over every leaf of every replica, the trainer's params gathered
    from all hosts and cast to the engine's dtype."""
    trainer = {
        tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(rt.trainer.model_params())[0]
    }
    worst, compared = 0.0, 0
    for replica in range(rt.engine.num_replicas):
        flat = jax.tree_util.tree_flatten_with_path(rt.engine.weights(replica))[0]
        for path, value in flat:
            key = tuple(str(getattr(k, "key", k)) for k in path)
            want = np.asarray(multihost_utils.process_allgather(trainer[key], tiled=True))
            got = np.asarray(value)
            diff = np.abs(got.astype(np.float32) - want.astype(got.dtype).astype(np.float32))
            worst, compared = max(worst, float(diff.max())), compared + 1
    return {"engine_vs_trainer_max_abs": worst, "leaves_compared": compared,
            "leaves": len(trainer)}


def main() -> None:
    cfg = load_config(sys.argv[1], sys.argv[2:])
    topo = topology.initialize_from_env()
    baseline = psutil.Process().memory_info().rss
    sampler = RssSampler()
    rt = colocated.ColocatedRuntime(cfg, topo)
    steps = per_step_peaks(rt, sampler)
    summary = rt.run()
    sampler.close()
    out = {"host": topo.host, "hosts": topo.num_hosts,
           "devices_per_host": len(topo.local_devices), "baseline_rss": baseline,
           "peak_rss": peak_rss_bytes(), "step_peak_rss": steps,
           "steady_peak_rss": max(steps[1:] or steps),
           "engine_pool_pages": getattr(rt.engine, "num_pages", None), **engine_vs_trainer(rt)}
    if summary is not None:
        out["summary"] = summary
    (cfg.run_dir / f"memory_host{topo.host}.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
