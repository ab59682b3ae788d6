"""Helpers for real multi-process tests: H local JAX processes via the launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tunix_mcjax.hostenv import DEVICE_COUNT_FLAG, with_cpu_devices

REPO = Path(__file__).resolve().parents[1]

# A one-layer Qwen3 small enough for multi-process tests to compile in seconds.
TINY = ["base_num_decoder_layers=1", "base_emb_dim=32", "base_mlp_dim=64",
        "base_num_query_heads=2", "base_num_kv_heads=1", "head_dim=16"]


def force_cpu_devices(count: int) -> None:
    """`count` CPU devices for this process, unless XLA_FLAGS names a count already (call it
    before JAX starts its backend; the suite's other XLA_FLAGS stay)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={count}".strip()


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a child process with `devices` CPU devices: this process's other flags."""
    return with_cpu_devices(os.environ.get("XLA_FLAGS", ""), devices)


def launch(args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    """`python -m tunix_mcjax.launch ARGS`, output captured."""
    return subprocess.run([sys.executable, "-m", "tunix_mcjax.launch", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def launch_worker(module: str, recipe: str, overrides: list[str], hosts: int = 2,
                  devices: int = 2, timeout: float = 400) -> subprocess.CompletedProcess:
    """Runs a test worker module as H processes of one jax.distributed job."""
    code = ("import sys; from tunix_mcjax.launch import launch; "
            f"sys.exit(launch({recipe!r}, {overrides!r}, {hosts}, {devices}, module={module!r}))")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_stopping_at(cmd: list[str], env: dict[str, str], timeout: float,
                    stop_at: str | None = None) -> tuple[int, str]:
    """`cmd` from the repository root with `env`; with `stop_at`, SIGTERM to it once a line
    of its output starts with that. (exit code, output)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if stop_at is not None and line.startswith(stop_at):
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(lines)
