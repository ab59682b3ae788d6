"""A decode step's projection on CPU four ways: bf16 weights, and int8 weights dequantized in
the program (the jax engine's path, `engine.quantize.dequantize`), through qwix's einsum on a
QArray, and with the scale applied to the output. Prints one JSON object.

    PYTHONPATH=. python bench_results/quant/matmul_paths.py [ROWS D F]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import qwix

from tunix_mcjax.engine.quantize import dequantize


def median_ms(fn, *args, reps: int = 50) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(rows: int, d: int, f: int) -> dict:
    x = jax.random.normal(jax.random.key(0), (rows, d), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (d, f), jnp.float32)
    q = qwix.quantize(w, jnp.int8, channelwise_axes=(1,), scale_dtype=jnp.float32)
    bf16 = w.astype(jnp.bfloat16)
    paths = {
        "bf16 weights": (jax.jit(lambda x, w: x @ w), bf16),
        "int8, dequantized in the program": (
            jax.jit(lambda x, q: x @ dequantize(q, jnp.bfloat16)), q),
        "int8, qwix.einsum on the QArray": (
            jax.jit(lambda x, q: qwix.einsum("bd,df->bf", x, q)), q),
        "int8, scale on the output": (
            jax.jit(lambda x, q: (x @ q.qvalue.astype(jnp.bfloat16)) * q.scale[0]), q),
    }
    return {"shape": [rows, d, f], "backend": jax.default_backend(),
            "loadavg_1m": os.getloadavg()[0],
            "median_ms": {name: round(median_ms(fn, x, arg), 3)
                          for name, (fn, arg) in paths.items()}}


if __name__ == "__main__":
    shape = [int(a) for a in sys.argv[1:]] or [64, 1024, 3072]
    print(json.dumps(main(*shape), indent=1))
