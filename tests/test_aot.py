"""Compiling for TPU without a TPU (`tunix_mcjax.aot`): libtpu stays out of CPU processes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from tunix_mcjax.aot import libtpu

ROOT = Path(__file__).resolve().parents[1]
HAVE_LIBTPU = (libtpu.libtpu_dir() / "libtpu" / "libtpu.so").is_file()
needs_libtpu = pytest.mark.skipif(
    not HAVE_LIBTPU, reason=f"libtpu is not installed under {libtpu.libtpu_dir()}: "
    f"`{libtpu.MAKE_TARGET}` installs it (make test does)")


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    environ.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=environ, capture_output=True,
                          text=True, timeout=300)


@needs_libtpu
def test_cpu_processes_do_not_see_libtpu():
    probe = ("import importlib.util, jax; "
             "print(importlib.util.find_spec('libtpu'), [d.platform for d in jax.devices()])")
    for out in (run(["-c", probe]).stdout, run(["-c", probe], JAX_PLATFORMS="").stdout):
        assert out.split() == ["None", "['cpu']"], out
    assert importlib.util.find_spec("libtpu") is None  # nor this (the suite's) process
    assert {d.platform for d in jax.devices()} == {"cpu"}


def test_without_libtpu_activate_names_the_make_target(monkeypatch, tmp_path):
    monkeypatch.setenv(libtpu.ENV_DIR, str(tmp_path))
    with pytest.raises(libtpu.LibtpuMissing, match="make setup-tpu-compiler"):
        libtpu.activate()
