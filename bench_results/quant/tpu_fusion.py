"""Does XLA's TPU compiler fuse the engine's dequantize into the matmul? Compiles one decode
projection (x [64, 1024] bf16 @ int8 [1024, 3072] with float32 per-channel scales, dequantized
as `engine.quantize.dequantize` does) for TPU targets on a host without one (libtpu, `make
setup-tpu-compiler`), and prints per target the entry computation's root instruction (which
operands its fusion reads) and XLA's temporary bytes: a dequantized bf16 copy of the weight
would be 6 MiB of temporaries.

    PYTHONPATH=. JAX_PLATFORMS=cpu python bench_results/quant/tpu_fusion.py
"""

from __future__ import annotations

import json

from tunix_mcjax.aot import libtpu

libtpu.activate()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import qwix  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tunix_mcjax.engine.quantize import dequantize  # noqa: E402

TARGETS = ("v5e:2x2", "v6e:2x2", "tpu7x:2x2x1")


def projection(x, qvalue, scale):
    return x @ dequantize(qwix.QArray(qvalue=qvalue, scale=scale, qtype=jnp.int8), jnp.bfloat16)


def compiled(target: str):
    device = topologies.get_topology_desc(platform="tpu", topology_name=target).devices[0]
    replicated = NamedSharding(Mesh(np.array([device]), ("x",)), P())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in
            (((64, 1024), jnp.bfloat16), ((1024, 3072), jnp.int8), ((1, 3072), jnp.float32))]
    return jax.jit(projection).lower(*args).compile()


def main() -> dict:
    out = {}
    for target in TARGETS:
        program = compiled(target)
        entry = program.as_text().split("ENTRY", 1)[1]
        root = next(line.strip() for line in entry.splitlines() if "ROOT" in line)
        out[target] = {"root": root.split(", metadata")[0],
                       "temp_bytes": program.memory_analysis().temp_size_in_bytes}
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
