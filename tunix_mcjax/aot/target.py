"""The TPU slice a program is compiled for: its devices (libtpu's topology, no TPU needed), its
hosts, and what the plan and the roofline need of its chip."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from tunix_mcjax import plan
from tunix_mcjax.bench.plan_tables import V7X_DEVICE_BYTES

GB = 10**9


@dataclasses.dataclass(frozen=True)
class Chip:
    """One JAX device of a TPU generation: its HBM and HBM bandwidth."""

    generation: str
    hbm_bytes: int
    hbm_bytes_per_s: float


# By device kind. TPU7x: two devices a chip, each 94.7 GiB (the planner's tables) at the
# paper's effective 3.32 TB/s; the others one device a chip, at their published HBM figures.
CHIPS = {
    "TPU v5 lite": Chip("v5e", 16 * plan.GIB, 819 * GB),
    "TPU v6 lite": Chip("v6e", 32 * plan.GIB, 1640 * GB),
    "TPU v5": Chip("v5p", 95 * GB, 2765 * GB),
    "TPU7x": Chip("TPU7x", V7X_DEVICE_BYTES, 3320 * GB),
}


@dataclasses.dataclass(frozen=True)
class Target:
    topology: str  # libtpu's name, e.g. tpu7x:4x4x4
    devices: tuple  # every device of the slice, host by host
    chip: Chip

    @property
    def hosts(self) -> int:
        return len({d.process_index for d in self.devices})

    @property
    def devices_per_host(self) -> int:
        return len(self.devices) // self.hosts

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind

    def cluster(self) -> plan.Cluster:
        """The planner's view of the slice."""
        return plan.Cluster(self.hosts, self.devices_per_host, self.chip.hbm_bytes, tpu=True)

    def trainer_mesh(self) -> Mesh:
        """Every device on one FSDP axis, as `topology.trainer_mesh` lays out a run's."""
        return Mesh(np.array(self.devices).reshape(-1, 1), ("fsdp", "tp"),
                    axis_types=(AxisType.Auto, AxisType.Auto))

    def replica_mesh(self, tensor_parallelism: int) -> Mesh:
        """One engine replica's mesh [data=1, tp] on the first host's first devices."""
        if self.devices_per_host % tensor_parallelism:
            raise ValueError(f"rollout_tensor_parallelism={tensor_parallelism} does not divide "
                             f"the {self.devices_per_host} devices of a {self.topology} host")
        return Mesh(np.array(self.devices[:tensor_parallelism]).reshape(1, -1), ("data", "tp"))


def target(topology: str) -> Target:
    """The devices of `topology` from libtpu (`aot.libtpu.activate` first)."""
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # libtpu's own error names the accepted forms
        raise ValueError(f"libtpu does not know the topology {topology!r} (e.g. v5e:2x2, "
                         f"v6e:2x2, v5p:2x2x1, tpu7x:2x2x1 .. tpu7x:4x4x4): {e}") from e
    devices = tuple(sorted(desc.devices, key=lambda d: (d.process_index, d.id)))
    kind = devices[0].device_kind
    if kind not in CHIPS:
        raise ValueError(f"no HBM figures for device kind {kind!r} ({topology}); known: "
                         f"{', '.join(CHIPS)}")
    return Target(topology, devices, CHIPS[kind])


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding else leaf.shape
        total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return total
