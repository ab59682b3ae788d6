"""Phase 7: each host's step record, host 0's global record, the run summary.

A step's host record is written when the step ends; its numbers reach host 0 with the next
step's exchange (`exchange.py`), or with a metrics-only exchange at the end of the run or on
preemption, so no step ends in a metrics barrier. Host 0 then builds the global record and
hands it to the step loop's record hooks; `StepExport` (either mode's) writes it: inline (as
Tunix's loop does) or, with O1 (`rl_async_metrics_export`), on a background thread. One summary
writer (`write_summary`) serves both modes.
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
from tunix_mcjax.runtime.records import HostRecord, StepRecord

# Keys of the host record that host 0's global record repeats (its own host's values).
GLOBAL_FROM_HOST = ("loss", "grad_norm", "kl", "kl_loss", "finite", "nonfinite_steps", "eval",
                    *metrics.MISMATCH_FIELDS)


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


class StepExport:
    """The leader's record hook: steps.jsonl, TensorBoard and the progress line, inline or (O1,
    `rl_async_metrics_export`) on a background thread. `records`: the run's global records,
    resumed segments included (what the summary covers); a resume's re-run steps appear once."""

    def __init__(self, cfg: Config, start_step: int, note: Callable[[dict], str] = lambda _: ""):
        self.cfg, self.note = cfg, note
        self.step_log = metrics.JsonlSink(cfg.run_dir / "steps.jsonl", start_step)
        self.tensorboard = metrics.TensorBoard(cfg.run_dir / "tensorboard", cfg.log_period) \
            if cfg.enable_tensorboard else None
        self.records: list[dict] = list(self.step_log.kept)
        self.exporter = metrics.Exporter(self._write, cfg.rl_async_metrics_export,
                                         cfg.rl_metrics_queue_size)

    def __call__(self, rec: StepRecord) -> None:
        self.records.append(rec.values)
        self.exporter.export(rec.values)

    def _write(self, record: dict) -> None:
        self.step_log(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if record["step"] % self.cfg.log_period == 0 or "eval" in record:
            print(metrics.progress_line(record, self.note(record)), flush=True)

    def close(self) -> None:
        self.exporter.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.step_log.close()


class Reporter:
    """Writes this host's records (through O1's exporter when it is on); host 0 forms each
    step's global record when every host's numbers arrive and hands it to `on_record`."""

    def __init__(self, cfg: Config, topo: topology.Topology, start_step: int,
                 on_record: Callable[[StepRecord], None]):
        self.cfg, self.topo, self.on_record = cfg, topo, on_record
        self.host_log = metrics.JsonlSink(cfg.run_dir / f"host_{topo.host}.jsonl", start_step)
        self.exporter = metrics.Exporter(self.host_log, cfg.rl_async_metrics_export,
                                         cfg.rl_metrics_queue_size)
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
            self.on_record(StepRecord(step, rec))

    def host_step(self, record: HostRecord) -> None:
        self.exporter.export(record.to_json())
        self.pending = record

    def flush(self, watchdog: topology.Watchdog) -> None:
        """The pending record out now (end of run, preemption): a metrics-only exchange."""
        if self.pending is not None:
            sent = exchange.HostMessage.metrics_only(self.outgoing())
            self.arrived(exchange.exchange(sent, watchdog, "metrics").metrics)

    def close(self) -> None:
        self.exporter.close()
        self.host_log.close()


def write_summary(cfg: Config, records: list[dict], hosts: int, devices_per_host: int,
                  nonfinite_steps: int, **extra) -> dict | None:
    """The leader: writes summary.json (`summarize`, plus a mode's `extra` fields) and prints its
    table; None when no step ran."""
    recs = sorted(records, key=lambda r: r["step"])
    if not recs:
        print(f"nothing to run: the checkpoint already covers steps={cfg.steps}")
        return None
    summary = summarize(recs, cfg, hosts, devices_per_host, nonfinite_steps, **extra)
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(summary_table(summary), flush=True)
    return summary


def summarize(recs: list[dict], cfg: Config, hosts: int, devices_per_host: int,
              nonfinite_steps: int, **extra) -> dict:
    """The run's summary from its global records (step times over steps that compiled nothing)."""
    steady = [r for r in recs if not r["compiled"]] or recs

    def mean(key, part):
        return float(np.mean([r[key] for r in part])) if part else 0.0

    return {
        "run_name": cfg.run_name,
        "hosts": hosts,
        "devices_per_host": devices_per_host,
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
        **extra,
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
