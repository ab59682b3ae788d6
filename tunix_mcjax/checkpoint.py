"""Orbax checkpoints of the run state (params, optimizer state, O3's output-length history),
saved by all hosts together.

A save is atomic (Orbax writes to a temporary directory and renames on success), so a crash
mid-save leaves the previous checkpoint intact. A run that finds a checkpoint in its directory
resumes after its step; data order is a function of the step, so it continues the same stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: Path, max_to_keep: int):
        self.manager = ocp.CheckpointManager(
            directory.absolute(), item_handlers=ocp.StandardCheckpointHandler(),
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.manager.save(step, args=ocp.args.StandardSave(state))
        self.manager.wait_until_finished()

    def restore(self, step: int, like: dict[str, Any]) -> dict[str, Any]:
        """Restores into `like`'s tree structure, shapes and shardings (numpy leaves stay numpy).

        Top-level entries of `like` that the checkpoint does not hold (it predates them) are
        left out of the result.
        """
        saved = self.manager.item_metadata(step).keys()
        like = {k: v for k, v in like.items() if k in saved}
        abstract = jax.tree.map(
            lambda x: x if isinstance(x, np.ndarray) else ocp.utils.to_shape_dtype_struct(x), like)
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        # Orbax returns plain tuples for optax's named tuples: rebuild the original structure.
        return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(restored))

    def close(self) -> None:
        self.manager.close()
