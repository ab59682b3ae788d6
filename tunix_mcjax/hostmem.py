"""Host memory that freed arrays leave behind on the CPU backend.

XLA's CPU client allocates buffers with malloc. glibc serves a buffer below its mmap threshold
(which rises to the largest chunk freed so far, up to 32 MiB) from the heap, and a freed heap
chunk stays resident: a page pool of per-layer arrays, given back after a rollout, would still
count in the train step's resident set. `trim` returns such free heap memory to the system. On
accelerators the pool lives in device memory and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def trim(devices) -> bool:
    """Return free heap memory to the system when `devices` are CPU devices; whether it ran."""
    trim_heap = _malloc_trim()
    if trim_heap is None or not any(d.platform == "cpu" for d in devices):
        return False
    trim_heap(0)
    return True
