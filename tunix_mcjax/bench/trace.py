"""Traced benchmark launches: a JAX profiler trace of N scored steps per host, the optimized HLO
of the train step, and what they say about a step's fixed cost.

`bench.step --trace-steps N` adds one traced launch per arm after the timed ones (tracing slows
the steps it covers, so no timed statistic uses them). The launch finds its window in
`TRACE_ENV`; each host (`bench.traced_run`, or the Tunix arm) traces steps first..first+N-1 into
`<dir>/host_<h>/`, one annotation per step, and XLA dumps the train step's HLO to
`<dir>/hlo/host_<h>/`.

Per traced step, from the trace (CPU backend):
* device busy: the union of XLA's execution-thread events (threads `tf_XLA*`: the programs'
  compute and the collectives inside them) over the step's wall time. Tiny programs that XLA's
  CPU client runs inline on the calling Python thread (the cross-host all-gathers of packing
  and metrics) count as host time: they are the step's coordination cost;
* dispatches: jitted-program calls from Python (`PjitFunction(...)` events);
* host syncs: device values read back into Python (`np.asarray(jax.Array)`, one per array,
  and `block_until_ready` calls): each waits until the value is computed.
Python events count on every thread but XLA's (Tunix trains on a thread of its own). For our
runtime each phase function's wall time and the device-busy time inside it are kept too
(`phases`: where a step's host time goes).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from tunix_mcjax.bench.hlo import collectives

TRACE_ENV = "TUNIX_MCJAX_BENCH_TRACE"  # "<first step>:<steps>:<dir>"
STEP_EVENT = "bench_step_"
# XLA programs of the train step: ours (Trainer._update / _flat_update), Tunix's PeftTrainer.
TRAIN_MODULES = r".*(_update|train_step).*"
DEVICE_THREADS = "tf_XLA"
# Our runtime's phase functions (Python tracer events), for where a step's host time goes.
PHASE_EVENT = re.compile(r"\$(?:phases\.py:\d+ (admit|generate|score|pack|publish)|"
                         r"trainer\.py:\d+ (step))$")
DISPATCH = "PjitFunction("
SYNC = "np.asarray(jax.Array)"
WAIT = " block_until_ready"


@dataclasses.dataclass(frozen=True)
class Window:
    first: int
    steps: int
    out: Path

    def encode(self) -> str:
        return f"{self.first}:{self.steps}:{self.out}"

    @classmethod
    def from_env(cls) -> Window | None:
        value = os.environ.get(TRACE_ENV)
        if not value:
            return None
        first, steps, out = value.split(":", 2)
        return cls(int(first), int(steps), Path(out))

    def xla_flags(self, host: int) -> str:
        """Flags that make XLA write the train step's optimized HLO (one directory per host)."""
        return (f"--xla_dump_to={self.out / 'hlo' / f'host_{host}'} --xla_dump_hlo_as_text "
                f"--xla_dump_hlo_module_re={TRAIN_MODULES} --xla_dump_hlo_pass_re=^$")


class StepTracer:
    """Starts the profiler at the window's first step and stops it after its last one."""

    def __init__(self, window: Window, host: int):
        self.window, self.host = window, host

    @contextmanager
    def step(self, step: int):
        import jax

        w = self.window
        if not w.first <= step < w.first + w.steps:
            yield
            return
        if step == w.first:
            jax.profiler.start_trace(str(w.out / f"host_{self.host}"))
        with jax.profiler.TraceAnnotation(f"{STEP_EVENT}{step}"):
            yield
        if step == w.first + w.steps - 1:
            jax.profiler.stop_trace()


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e6


def step_costs(trace_file: Path) -> list[dict]:
    """Per annotated step of one host's trace: wall s, device-busy share, dispatches, syncs."""
    with gzip.open(trace_file) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in spans if e["name"].startswith(STEP_EVENT)), key=lambda e: e["ts"])
    out = []
    for s in steps:
        a, b = s["ts"], s["ts"] + s["dur"]
        inside = [e for e in spans if a <= e["ts"] < b]
        busy = [(e["ts"], min(e["ts"] + e["dur"], b)) for e in inside
                if threads.get((e["pid"], e["tid"]), "").startswith(DEVICE_THREADS)]
        python = [e for e in inside
                  if not threads.get((e["pid"], e["tid"]), "").startswith("tf_")]
        phases = {}
        for e in python:
            m = PHASE_EVENT.match(e["name"])
            if m:
                lo, hi = e["ts"], e["ts"] + e["dur"]
                device = _union_seconds([(max(x, lo), min(y, hi)) for x, y in busy
                                         if y > lo and x < hi])
                name = "train" if m.group(2) else m.group(1).lstrip("_")
                phases[name] = {"wall_s": e["dur"] / 1e6, "device_s": device}
        out.append({"step": int(s["name"][len(STEP_EVENT):]), "wall_s": s["dur"] / 1e6,
                    "phases": phases, "device_busy": _union_seconds(busy) / (s["dur"] / 1e6),
                    "dispatches": sum(e["name"].startswith(DISPATCH) for e in python),
                    "host_syncs": sum(e["name"] == SYNC or e["name"].endswith(WAIT)
                                      for e in python)})
    return out


def train_step_collectives(hlo_dir: Path) -> dict[str, dict[str, int]] | None:
    """Collectives of the train step's optimized HLO (the largest matching module)."""
    files = sorted(hlo_dir.rglob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    return collectives(files[-1].read_text()) if files else None


def summarize(trace_dir: Path) -> dict:
    """Medians over the traced steps of every host, and the train step's collectives."""
    per_host = {}
    for host_dir in sorted(trace_dir.glob("host_*")):
        files = sorted(host_dir.rglob("*.trace.json.gz"))
        if files:
            per_host[host_dir.name] = step_costs(files[-1])
    steps = [s for costs in per_host.values() for s in costs]
    if not steps:
        raise ValueError(f"{trace_dir}: no traced steps (no host_*/**/*.trace.json.gz)")
    summary = {k: float(np.median([s[k] for s in steps]))
               for k in ("wall_s", "device_busy", "dispatches", "host_syncs")}
    names = dict.fromkeys(p for s in steps for p in s["phases"])
    summary["phases"] = {p: {k: float(np.median([s["phases"][p][k] for s in steps
                                                 if p in s["phases"]]))
                             for k in ("wall_s", "device_s")} for p in names}
    return {**summary, "host_share": 1 - summary["device_busy"], "traced_steps": len(steps),
            "hosts": len(per_host),
            "train_step_collectives": train_step_collectives(trace_dir / "hlo")}


def prune_hlo_dump(hlo_dir: Path) -> None:
    """Keeps only the optimized HLO text of the dump (XLA also writes object files)."""
    for path in hlo_dir.rglob("*"):
        if path.is_file() and not path.name.endswith("after_optimizations.txt"):
            path.unlink()
