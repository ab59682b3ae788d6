"""One layer's decode attention over pages: the GPU layout's Pallas kernel against the XLA path.

Random queries, keys and values at Qwen3-0.6B's attention shape (16 query heads, 8 KV heads of
128), `--rows` decode rows of random lengths up to 24 pages of 16 tokens over a shuffled pool,
the last 3 rows padding. `GpuPages` (JAX's Pallas GPU `paged_attention`) and `SplitPages` (XLA)
each in float32 and bfloat16: relative error ||out - ref|| / ||ref|| against SplitPages in
float32 on the host CPU, padding rows zero, and the median time of 20 jitted calls (host clock
around `block_until_ready`, after one warm-up) with the live KV bytes it read per second. First,
a copy's bandwidth: `x + 1` over `--copy-elems` bf16 elements (bytes read plus written).
`--interpret` runs the kernel in Pallas' interpreter (CPU).

    python -m tunix_mcjax.bench.decode_attention [--rows N] [--interpret] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunix_mcjax.engine import paged_attention as pa

WIDTH, PAGE, KV_HEADS, HEADS, HEAD_DIM = 24, 16, 8, 16, 128


def median_seconds(fn, *args, reps: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth(elements: int) -> dict[str, float]:
    """`x + 1` over bf16: the faster of two arrays' medians."""
    add = jax.jit(lambda x: x + 1)
    seconds = min(median_seconds(add, jax.random.normal(jax.random.key(i), (elements,),
                                                        jnp.bfloat16), reps=10)
                  for i in range(2))
    return {"bytes_read_plus_written": 4 * elements, "seconds": seconds,
            "bytes_per_s": 4 * elements / seconds}


def decode_attention(rows: int, interpret: bool) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    pool_pages = rows * WIDTH + 17
    tables = rng.permutation(pool_pages)[: rows * WIDTH].reshape(rows, WIDTH).astype(np.int32)
    kv_lens = rng.integers(1, WIDTH * PAGE + 1, rows).astype(np.int32)
    q_lens = np.ones(rows, np.int32)
    q_lens[-3:] = 0  # padding rows
    q = rng.standard_normal((rows, 1, HEADS, HEAD_DIM), dtype=np.float32)
    k = rng.standard_normal((KV_HEADS, pool_pages, PAGE, HEAD_DIM), dtype=np.float32)
    v = rng.standard_normal((KV_HEADS, pool_pages, PAGE, HEAD_DIM), dtype=np.float32)
    cpu = jax.devices("cpu")[0]
    ref = np.asarray(jax.jit(pa.SplitPages().attend)(
        *jax.device_put((q, (k, v), tables, kv_lens, q_lens), cpu)), np.float64)
    rows_args = [jnp.asarray(tables), jnp.asarray(kv_lens), jnp.asarray(q_lens)]
    out: dict[str, Any] = {"rows": rows, "table_pages": WIDTH, "page_size": PAGE,
                           "kv_heads": KV_HEADS, "heads": HEADS, "head_dim": HEAD_DIM,
                           "mean_kv_len": float(kv_lens.mean()),
                           "reference": "SplitPages in float32 on the host CPU"}
    for dtype in (jnp.float32, jnp.bfloat16):
        qd, layer = jnp.asarray(q, dtype), (jnp.asarray(k, dtype), jnp.asarray(v, dtype))
        live = float(np.sum(kv_lens[q_lens > 0])) * 2 * KV_HEADS * HEAD_DIM * \
            np.dtype(dtype).itemsize
        for name, layout in (("gpu_kernel", pa.GpuPages(interpret=interpret)),
                             ("xla", pa.SplitPages())):
            fn = jax.jit(layout.attend)
            got = np.asarray(fn(qd, layer, *rows_args), np.float64)
            seconds = median_seconds(fn, qd, layer, *rows_args)
            out[f"{name}_{np.dtype(dtype).name}"] = {
                "rel_err": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
                "finite": bool(np.isfinite(got).all()),
                "padding_rows_zero": bool(np.all(got[q_lens == 0] == 0)),
                "ms": seconds * 1e3, "live_kv_bytes": live, "live_kv_bytes_per_s": live / seconds}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--copy-elems", type=int, default=1 << 30)
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
              "copy": copy_bandwidth(args.copy_elems),
              "decode_attention_one_layer": decode_attention(args.rows, args.interpret)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
