"""Suite-wide settings for every process the suite starts: one persistent JAX compilation cache,
and CPU programs compiled at LLVM's -O0.

Most tests launch real multi-process runs of the same tiny models, so each launch compiled the
same programs again; with the cache a later launch loads them (the demo's 3-step launch: 23 s
-> 15 s wall on 2 cores). The cache lives in a fresh directory per session, removed at its end,
so no compiled program outlives the code it came from. A JAX_COMPILATION_CACHE_DIR set before
the session is used instead, and kept.

The suite's time is mostly XLA compiling tiny programs that then run for milliseconds, and most
of a CPU compile is LLVM optimising the generated code: `--xla_backend_optimization_level=0`
leaves XLA's HLO passes (fusion, buffer assignment: what the memory and collective checks
read) as they are and cut the wall time of test_kept_pages + test_stops from 114 to 91 s.
XLA_FLAGS that name a level already keep theirs; `SUITE_XLA_FLAG` is left out of the processes
that compile for TPU (tests/test_aot.py), whose verdicts must be those of a user's compile.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="mcjax-test-jax-cache-")
# MaxText's runs take it as their jax_cache_dir (whose default is ~/jax_cache).
os.environ.setdefault("M_JAX_CACHE_DIR", os.environ["JAX_COMPILATION_CACHE_DIR"])
# Every program, however small or quick to compile (JAX's defaults skip those under 1 s).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

SUITE_XLA_FLAG = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SUITE_XLA_FLAG}".strip()


def pytest_sessionfinish(session, exitstatus) -> None:
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
