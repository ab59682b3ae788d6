"""Check for patch 0003: Tunix's `shard_input` under jax.distributed (run as every process).

Each process passes its own rows. A batch that mixes process-local leaves with a global array
(what the trainer gets when beta > 0: the reference logps come from the mesh) must come out all
global; rows that split evenly over this process's devices must be sharded, and rows that do
not must be refused. On a mesh of this process's own devices nothing spans processes, so rows
that do not divide are replicated, as in one process. Prints one "REPORT <json>" line per
process.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tunix.sft import sharding_utils

from tunix_mcjax import topology

topo = topology.initialize_from_env()
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
local_mesh = Mesh(np.array(jax.local_devices()), ("fsdp",))
rows = 2 * len(topo.local_devices)


def local_rows(n: int) -> np.ndarray:
    """This process's n rows: row r of process h holds 100*h + r."""
    return (100 * topo.host + np.arange(n, dtype=np.int32))[:, None].repeat(3, axis=1)


def summary(x) -> dict:
    if not isinstance(x, jax.Array):
        return {"type": type(x).__name__}
    return {"type": "jax.Array", "global_shape": list(x.shape),
            "fully_addressable": x.is_fully_addressable,
            "spec": str(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else None,
            "local_rows": sorted({int(v) for s in x.addressable_shards
                                  for v in np.asarray(s.data)[:, 0]})}


def attempt(batch: dict, on: Mesh = mesh) -> dict:
    try:
        with on:
            out = sharding_utils.shard_input(batch, ("fsdp",))
    except ValueError as e:
        return {"error": str(e)}
    return {key: summary(value) for key, value in out.items()}


global_logps = jax.make_array_from_process_local_data(
    NamedSharding(mesh, PartitionSpec("fsdp")), local_rows(rows).astype(np.float32))
report = {
    "host": topo.host,
    "sharding_utils": sharding_utils.__file__,
    "expected_local_rows": local_rows(rows)[:, 0].tolist(),
    "mixed": attempt({"completion_ids": local_rows(rows), "ref_per_token_logps": global_logps}),
    "local_only": attempt({"completion_ids": local_rows(len(topo.local_devices))}),
    "uneven": attempt({"completion_ids": local_rows(len(topo.local_devices) + 1)}),
    "uneven_local_mesh": attempt({"completion_ids": local_rows(len(topo.local_devices) + 1)},
                                 on=local_mesh),
}
print("REPORT " + json.dumps(report), flush=True)
