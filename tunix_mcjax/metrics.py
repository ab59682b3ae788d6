"""Phase timers, per-step records, JSONL and TensorBoard export, and O1's background exporter.

Files go through etils.epath, the path layer MaxText and Orbax use, so a run directory may be
local or in a bucket (gs://...).
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
from etils import epath

PHASES = ("admit", "generate", "reward", "pack", "train", "publish")

# The per-host numbers every host sends to host 0 for the global step record, in this order.
HOST_FIELDS = (
    "step_s", *(f"{p}_s" for p in PHASES), "reward_sum", "correct_sum", "completions",
    "completion_tokens", "completion_len_max", "truncated", "prompt_tokens", "prompts",
    "compiled", "drawn_reward_sum", "drawn_correct_sum", "drawn_completions",
)


# The trainer's rollout-trainer mismatch metrics (train/loss.py's `mismatch_metrics`), global,
# and those of active corrections: what a step record repeats from the trainer.
MISMATCH_FIELDS = ("mismatch_abs_mean", "mismatch_abs_max", "mismatch_seq_log_ratio",
                   "mismatch_k3", "mismatch_out_frac", "sampler_is_weight_mean",
                   "rollout_rs_rejected_frac")


class PhaseTimer:
    """Wall time per phase of one step (`with timer.phase("train"): ...`)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def total(self) -> float:
        return time.perf_counter() - self._start


def host_vector(record: dict) -> np.ndarray:
    return np.array([float(record[k]) for k in HOST_FIELDS], dtype=np.float64)


def global_record(step: int, per_host: np.ndarray, prompt_indices: list[int]) -> dict:
    """Host 0's view of a step from every host's `host_vector` ([num_hosts, len(HOST_FIELDS)])."""
    h = {k: per_host[:, i] for i, k in enumerate(HOST_FIELDS)}
    completions = max(h["completions"].sum(), 1.0)
    drawn = max(h["drawn_completions"].sum(), 1.0)  # before dynamic sampling dropped any
    return {
        "step": step,
        "step_s": float(h["step_s"].max()),
        "phase_s": {p: float(h[f"{p}_s"][0]) for p in PHASES},
        "generate_max_s": float(h["generate_s"].max()),
        "generate_mean_s": float(h["generate_s"].mean()),
        "reward_mean": float(h["drawn_reward_sum"].sum() / drawn),
        "accuracy": float(h["drawn_correct_sum"].sum() / drawn),
        "prompt_indices": prompt_indices,
        "prompt_tokens_mean": float(h["prompt_tokens"].sum() / max(h["prompts"].sum(), 1.0)),
        "completion_len_mean": float(h["completion_tokens"].sum() / completions),
        "completion_len_max": int(h["completion_len_max"].max()),
        "truncated_frac": float(h["truncated"].sum() / completions),
        "tokens_generated": int(h["completion_tokens"].sum()),
        "compiled": bool(h["compiled"].max() > 0),
    }


def progress_line(rec: dict, extra: str = "") -> str:
    """The step's line (ending with `extra`), then one line per evaluation that ran after it."""
    phases = " ".join(f"{p}={rec['phase_s'][p]:.2f}" for p in PHASES)
    step = (f"step {rec['step']:4d} | reward {rec['reward_mean']:.3f} | acc "
            f"{rec['accuracy']:.3f}{mismatch_field(rec)} | {rec['step_s']:.2f}s | "
            f"{phases}{extra}")
    return "\n".join([step, *eval_lines(rec)])


def mismatch_field(rec: dict) -> str:
    """The progress line's mismatch: mean |log p_trainer - log p_rollout| and the k3 KL
    estimate; empty for a step that did not train."""
    if "mismatch_abs_mean" not in rec:
        return ""
    return f" | mismatch {rec['mismatch_abs_mean']:.1e} k3 {rec['mismatch_k3']:.1e}"


def eval_lines(record: dict) -> list[str]:
    """Progress lines for the evaluations in a step record."""
    return [f"eval {label:<12} after {r['steps_done']:4d} steps | {r['mode']} accuracy "
            f"{r['accuracy']:.2f}% | partial {r['partial_accuracy']:.2f}% | format "
            f"{r['format_accuracy']:.2f}% | reward {r['mean_reward']:.3f} | {r['total']} prompts"
            f" | {r['eval_s']:.2f}s"
            for label, r in record.get("eval", {}).items()]


def read_jsonl(path: epath.PathLike) -> list[dict]:
    path = epath.Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def is_url(path: epath.PathLike) -> bool:
    """An object-store path (gs://...): written whole, since objects cannot be appended to."""
    return "://" in str(path)


class JsonlSink:
    """Appends records as JSON lines to one file; safe to call from several threads (O1's
    drain thread and the step thread, when the queue is full).

    `first_step`: the run starts (or resumes) at this step, so records of this step and later
    left by an earlier, interrupted run are dropped first: every step appears once.
    """

    def __init__(self, path: epath.PathLike, first_step: int = 0):
        self.path = epath.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_jsonl(self.path) if r["step"] < first_step]
        self._lines = [json.dumps(r) + "\n" for r in kept]
        self.path.write_text("".join(self._lines))
        self.kept = kept
        self._lock = threading.Lock()
        self._file = None if is_url(self.path) else self.path.open("a")

    def __call__(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        with self._lock:
            if self._file is None:
                self._lines.append(line)
                self.path.write_text("".join(self._lines))
            else:
                self._file.write(line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()


# Step-record scalars -> TensorBoard tags.
TB_SCALARS = {"reward_mean": "rl/reward", "accuracy": "rl/accuracy", "loss": "rl/loss",
              "kl": "rl/kl", "grad_norm": "rl/grad_norm", "step_s": "perf/step_s",
              "completion_len_mean": "rl/completion_len_mean",
              "tokens_generated": "perf/tokens_generated",
              **{k: f"mismatch/{k.removeprefix('mismatch_')}" for k in MISMATCH_FIELDS}}
TB_EVAL = ("accuracy", "partial_accuracy", "format_accuracy", "mean_reward")


class TensorBoard:
    """Host 0's TensorBoard scalars under `<run dir>/tensorboard` (tensorboardX, the writer
    MaxText uses), flushed every `flush_every` steps and at close."""

    def __init__(self, directory: epath.PathLike, flush_every: int):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(directory))
        self.flush_every = flush_every

    def write(self, rec: dict[str, Any]) -> None:
        step = rec["step"]
        for key, tag in TB_SCALARS.items():
            if key in rec:
                self.writer.add_scalar(tag, float(rec[key]), step)
        for phase, seconds in rec["phase_s"].items():
            self.writer.add_scalar(f"phase/{phase}_s", seconds, step)
        for label, result in rec.get("eval", {}).items():
            for key in TB_EVAL:
                self.writer.add_scalar(f"eval/{label}/{key}", result[key], result["steps_done"])
        if step % self.flush_every == 0:
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Exporter:
    """Sends records to a sink: inline, or (O1) through a bounded queue and one thread.

    A full queue is reported on stderr and the record is then written inline: never dropped,
    never a silent stall. `close()` flushes everything queued, also after an error.
    """

    def __init__(self, sink: Callable[[dict], None], background: bool, queue_size: int = 1024):
        self.sink = sink
        self.background = background
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._drain, daemon=True, name="metrics")
            self._thread.start()

    def export(self, record: dict) -> None:
        if self._error is not None:
            raise RuntimeError("metrics exporter thread failed") from self._error
        if not self.background:
            self.sink(record)
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            print(f"metrics queue full ({self._queue.maxsize} records): writing inline; "
                  "raise rl_metrics_queue_size or use a faster sink", file=sys.stderr, flush=True)
            self.sink(record)

    def _drain(self) -> None:
        while True:
            record = self._queue.get()
            try:
                if record is None:
                    return
                self.sink(record)
            except BaseException as e:  # surfaced to the step thread on its next export
                self._error = e
            finally:
                self._queue.task_done()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise RuntimeError("metrics exporter thread failed") from self._error
