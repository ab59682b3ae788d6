"""Collectives of a compiled XLA program, read from its optimized HLO text."""

from __future__ import annotations

import re

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?\S+\s*=\s*(.*?)\s+(" + "|".join(COLLECTIVES)
                 + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2}


def _shape_bytes(result: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(result):
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * (_BYTES[dtype] if dtype in _BYTES else int(dtype[1:]) // 8)
    return total


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{kind: {"count": n, "bytes": result bytes per device}} for every collective op (an async
    start counts once, its done not at all), plus "total"."""
    out: dict[str, dict[str, int]] = {}
    for line in hlo_text.splitlines():
        m = _OP.match(line)
        if not m:
            continue
        kind = out.setdefault(m.group(2), {"count": 0, "bytes": 0})
        kind["count"] += 1
        kind["bytes"] += _shape_bytes(m.group(1))
    out["total"] = {"count": sum(k["count"] for k in out.values()),
                    "bytes": sum(k["bytes"] for k in out.values())}
    return out
