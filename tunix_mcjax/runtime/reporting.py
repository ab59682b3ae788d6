"""Phase 7: each host's step record, host 0's global record, the run summary.

A step's host record is written when the step ends; its numbers reach host 0 with the next
step's exchange (`exchange.py`), or with a metrics-only exchange at the end of the run or on
preemption, so no step ends in a metrics barrier. Host 0 then builds the global record and
exports it: inline (as Tunix's loop does) or, with O1 (`rl_async_metrics_export`), on a
background thread.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from tunix_mcjax import metrics, topology
from tunix_mcjax.config import Config
from tunix_mcjax.runtime import evaluation, exchange
from tunix_mcjax.runtime.records import HostRecord

# Keys of the host record that host 0's global record repeats (its own host's values).
GLOBAL_FROM_HOST = ("loss", "grad_norm", "kl", "kl_loss", "finite", "nonfinite_steps", "eval")


class CompileWatch:
    """Whether a count of compiled programs grew since the last look."""

    def __init__(self, count: Callable[[], int]):
        self._count = count
        self._seen = count()

    def grew(self) -> bool:
        now = self._count()
        grew, self._seen = now > self._seen, now
        return grew

    def reset(self) -> None:
        self._seen = self._count()


class Reporter:
    """Writes this host's records; on host 0 also the global records, TensorBoard and the
    progress lines. Records of steps a resume re-runs are dropped: every step appears once."""

    def __init__(self, cfg: Config, topo: topology.Topology, start_step: int):
        self.cfg, self.topo = cfg, topo
        run_dir = cfg.run_dir
        self.host_log = metrics.JsonlSink(run_dir / f"host_{topo.host}.jsonl", start_step)
        self.step_log = metrics.JsonlSink(run_dir / "steps.jsonl", start_step) \
            if topo.is_leader else None
        self.tensorboard = metrics.TensorBoard(run_dir / "tensorboard", cfg.log_period) \
            if topo.is_leader and cfg.enable_tensorboard else None
        self.exporter = metrics.Exporter(self._export, cfg.rl_async_metrics_export,
                                         cfg.rl_metrics_queue_size)
        # The summary covers the whole run, resumed segments included.
        self.step_records: list[dict] = list(self.step_log.kept) if self.step_log else []
        self.pending: HostRecord | None = None  # the last step's record, not yet global
        self._step_start: dict[int, float] = {}

    def begin(self, step: int) -> None:
        self._step_start[step] = time.perf_counter()

    def exclude(self, step: int, seconds: float) -> None:
        """Keeps `seconds` (an evaluation after the step) out of the step's wall period."""
        self._step_start[step] += seconds

    def outgoing(self) -> np.ndarray:
        """What this host sends with the next exchange: the pending record's numbers."""
        if self.pending is None:
            return np.zeros(len(metrics.HOST_FIELDS))
        return self.pending.vector()

    def arrived(self, per_host: np.ndarray) -> None:
        """Every host's numbers of the pending step ([hosts, HOST_FIELDS]) are here."""
        if self.pending is None:
            return
        record, self.pending = self.pending, None
        step = record.step
        # The step's wall period: to the next step's start, or to now (the run's end).
        period = self._step_start.get(step + 1, time.perf_counter()) - self._step_start.pop(step)
        if self.topo.is_leader:
            rec = metrics.global_record(step, per_host, record.global_prompt_indices)
            rec["step_s"] = period
            host = record.to_json()
            rec.update({k: host[k] for k in GLOBAL_FROM_HOST if k in host})
            self.step_records.append(rec)
            self.exporter.export({"kind": "global", **rec})

    def host_step(self, record: HostRecord) -> None:
        self.exporter.export({"kind": "host", **record.to_json()})
        self.pending = record

    def flush(self, watchdog: topology.Watchdog) -> None:
        """The pending record out now (end of run, preemption): a metrics-only exchange."""
        if self.pending is not None:
            sent = exchange.HostMessage.metrics_only(self.outgoing())
            self.arrived(exchange.exchange(sent, watchdog, "metrics").metrics)

    def _export(self, record: dict) -> None:
        kind = record.pop("kind")
        if kind == "host":
            self.host_log(record)
            return
        self.step_log(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if record["step"] % self.cfg.log_period == 0 or "eval" in record:
            print(metrics.progress_line(record), flush=True)

    def close(self) -> None:
        self.exporter.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.host_log.close()
        if self.step_log:
            self.step_log.close()

    def summary(self, nonfinite_steps: int) -> dict | None:
        """Host 0: writes summary.json and prints its table; None when no step ran."""
        recs = sorted(self.step_records, key=lambda r: r["step"])
        if not recs:
            print(f"nothing to run: the checkpoint already covers steps={self.cfg.steps}")
            return None
        summary = summarize(recs, self.cfg, self.topo, nonfinite_steps)
        (self.cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(summary_table(summary), flush=True)
        return summary


def summarize(recs: list[dict], cfg: Config, topo: topology.Topology,
              nonfinite_steps: int) -> dict:
    """The run's summary from its global records (step times over steps that compiled nothing)."""
    steady = [r for r in recs if not r["compiled"]] or recs

    def mean(key, part):
        return float(np.mean([r[key] for r in part])) if part else 0.0

    return {
        "run_name": cfg.run_name,
        "hosts": topo.num_hosts,
        "devices_per_host": len(topo.local_devices),
        "steps": len(recs),
        "accuracy_first10": mean("accuracy", recs[:10]),
        "accuracy_last10": mean("accuracy", recs[-10:]),
        "reward_first10": mean("reward_mean", recs[:10]),
        "reward_last10": mean("reward_mean", recs[-10:]),
        "median_step_s": statistics.median(r["step_s"] for r in steady),
        "phase_median_s": {p: statistics.median(r["phase_s"][p] for r in steady)
                           for p in metrics.PHASES},
        "tokens_generated": int(sum(r["tokens_generated"] for r in recs)),
        "compiled_steps": int(sum(r["compiled"] for r in recs)),
        "nonfinite_steps": nonfinite_steps,
        **evaluation.summary_fields(recs),
    }


def summary_table(s: dict) -> str:
    rows = [("hosts x devices", f"{s['hosts']} x {s['devices_per_host']}"),
            ("steps", s["steps"]),
            ("accuracy first10 -> last10", f"{s['accuracy_first10']:.3f} -> "
                                          f"{s['accuracy_last10']:.3f}"),
            ("reward first10 -> last10", f"{s['reward_first10']:.3f} -> {s['reward_last10']:.3f}"),
            ("median step", f"{s['median_step_s']:.3f} s"),
            *((f"  {p}", f"{v:.3f} s") for p, v in s["phase_median_s"].items()),
            ("tokens generated", s["tokens_generated"]),
            *((f"eval {e['when']} ({e['mode']})", f"{e['accuracy']:.2f}% of {e['total']}")
              for e in s.get("eval", ()))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["summary"] + [f"  {k:<{width}}  {v}" for k, v in rows])
