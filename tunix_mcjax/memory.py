"""Pure decisions about the train step's memory layout, shared by the trainer and the planner.

Both import these functions, so what the planner reports is what the trainer does.
"""

from __future__ import annotations

import os
from typing import Any

# Gather-once holds a full replica of the params and of their gradient on every device through
# the forward and backward; it is chosen only while those two take at most this share of a
# device's memory, leaving the rest to optimizer state, activations, logits and the engine.
GATHER_ONCE_MEMORY_FRACTION = 0.25


def gather_params_once(setting: str, *, param_count: int, bytes_per_param: int,
                       num_devices: int, device_memory_bytes: int) -> bool:
    """Whether the train step gathers the FSDP params once (data-parallel compute) or keeps them
    sharded through compute (XLA gathers per layer; less peak memory).

    `setting` is the `fsdp_gather_params_once` key: "true"/"false" decide; "auto" gathers when
    there is more than one device (one device has nothing to gather) and a full replica of
    params plus gradients (2 * param_count * bytes_per_param) fits in
    GATHER_ONCE_MEMORY_FRACTION of `device_memory_bytes`.
    """
    if setting in ("true", "false"):
        return setting == "true"
    if setting != "auto":
        raise ValueError(f"fsdp_gather_params_once={setting!r} is not one of auto, true, false")
    if num_devices <= 1:
        return False
    replica = 2 * param_count * bytes_per_param
    return replica <= GATHER_ONCE_MEMORY_FRACTION * device_memory_bytes


def device_memory_bytes(device: Any, local_device_count: int) -> int:
    """A device's memory: its allocator limit (TPU/GPU), else the host's RAM shared by its local
    devices (CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(local_device_count, 1)


def num_micro_batches(batch_size: int, train_micro_batch_size: int) -> int:
    """MaxText's `train_micro_batch_size` (prompts per micro-batch, the unit of `batch_size`) as
    a count of micro-batches per step; <= 0 or equal to the batch is one."""
    if train_micro_batch_size <= 0 or train_micro_batch_size == batch_size:
        return 1
    if train_micro_batch_size > batch_size or batch_size % train_micro_batch_size:
        raise ValueError(f"train_micro_batch_size={train_micro_batch_size} must divide "
                         f"batch_size={batch_size}")
    return batch_size // train_micro_batch_size


def micro_batch_rows(rows_per_device: int, micro_batches: int) -> tuple[int, int]:
    """(micro-batches run, rows per device in each) for K = `rows_per_device` packed rows.

    Each micro-batch takes ceil(K / micro_batches) rows per device; micro-batches that would hold
    only padding are not run, so at most `micro_batches` run. Every host has the same K, so every
    host runs the same number.
    """
    per = -(-rows_per_device // max(micro_batches, 1))
    return -(-rows_per_device // per), per
