"""Suite-wide settings: one persistent JAX compilation cache for every process the suite starts.

Most tests launch real multi-process runs of the same tiny models, so each launch compiled the
same programs again; with the cache a later launch loads them (the demo's 3-step launch: 23 s
-> 15 s wall on 2 cores). The cache lives in a fresh directory per session, removed at its end,
so no compiled program outlives the code it came from. A JAX_COMPILATION_CACHE_DIR set before
the session is used instead, and kept.
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


def pytest_sessionfinish(session, exitstatus) -> None:
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
