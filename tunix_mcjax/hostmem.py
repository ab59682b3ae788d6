"""Host memory that freed arrays leave behind on the CPU backend.

XLA's CPU client allocates buffers with malloc. glibc serves a buffer below its mmap threshold
(which rises to the largest chunk freed so far, up to 32 MiB) from the heap, and a freed heap
chunk stays resident: a page pool of per-layer arrays, given back after a rollout, would still
count in the train step's resident set. `trim` returns such free heap memory to the system
after a large free. A trim walks the whole heap (in one demo run it added about 12 ms to each
0.02 s generate), so a small pool, whose residue is noise beside the process, is left to the
heap. On
accelerators the pool lives in device memory and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# Freed bytes below which a trim costs more than the memory it returns is worth.
TRIM_FROM_BYTES = 64 << 20


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def trim(devices, freed_bytes: int) -> bool:
    """Return free heap memory to the system after `freed_bytes` (at least `TRIM_FROM_BYTES`)
    were freed on CPU `devices`; whether it ran."""
    trim_heap = _malloc_trim()
    if (trim_heap is None or freed_bytes < TRIM_FROM_BYTES
            or not any(d.platform == "cpu" for d in devices)):
        return False
    trim_heap(0)
    return True
