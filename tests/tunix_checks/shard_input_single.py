"""Check for patch 0003 in one process: Tunix's `shard_input` without jax.distributed.

Run with a tunix copy first on PYTHONPATH; it asks for 4 CPU devices. Rows that divide the
4-way `fsdp` axis are sharded; rows that do not (fewer than the devices, or not a multiple) are
replicated, as Tunix does on purpose in one process. Prints one "REPORT <json>" line.
"""

from __future__ import annotations

import json
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from tunix.sft import sharding_utils  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("fsdp",))


def outcome(rows: int) -> dict:
    """The sharding `shard_input` gives `rows` rows, or the error it raises."""
    try:
        with mesh:
            out = sharding_utils.shard_input({"ids": np.zeros((rows, 3), np.int32)}, ("fsdp",))
    except ValueError as e:
        return {"error": str(e)}
    return {"spec": str(out["ids"].sharding.spec), "shape": list(out["ids"].shape)}


report = {"sharding_utils": sharding_utils.__file__, "devices": jax.device_count(),
          "rows": {rows: outcome(rows) for rows in (2, 7, 8, 9)}}
print("REPORT " + json.dumps(report), flush=True)
