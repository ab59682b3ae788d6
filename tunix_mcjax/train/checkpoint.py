"""Orbax checkpoints of the run state (params, optimizer state, O3's output-length history),
saved by all hosts together, each with the config fingerprint it was trained under.

A save is atomic (Orbax writes to a temporary directory and renames on success), so a host
killed mid-save leaves the previous checkpoint intact, and the next run resumes from that one.
A newest checkpoint that cannot be read (truncated, corrupt) is reported and the one before it
is used. A run that finds a checkpoint in its directory resumes after its step; data order is a
function of the step, so it continues the same stream.

Layout: a checkpoint holds the trainer's state as the trainer holds it, decoder layers stacked
(`layer_runs`: params and optimizer moments alike), so a save copies nothing and a resume
restores straight into the step's arrays. A checkpoint saved with Tunix's per-layer layout (every
one written before the trainer stored its layers stacked) still restores: it is read per layer
and stacked into the trainer's layout, so no checkpoint is lost.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from tunix_mcjax.config import Config, ConfigError, algorithm_fingerprint, fingerprint_mismatch
from tunix_mcjax.train import layer_runs


def holds_per_layer(metadata: Any) -> bool:
    """Whether a checkpoint's tree metadata holds a `layers` node in Tunix's per-layer layout."""
    if isinstance(metadata, dict):
        return any((k == "layers" and layer_runs.is_per_layer(v)) or holds_per_layer(v)
                   for k, v in metadata.items())
    if isinstance(metadata, list | tuple):
        return any(holds_per_layer(v) for v in metadata)
    return False


class Checkpointer:
    def __init__(self, directory: epath.PathLike, max_to_keep: int):
        """`directory`: any path Orbax takes (local, gs://), through etils.epath."""
        path = epath.Path(directory)
        # epath's absolute() would prefix a URL (gs://...) with the working directory.
        self.directory = path if "://" in str(directory) else path.absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, item_handlers=ocp.StandardCheckpointHandler(),
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict[str, Any], cfg: Config | None = None) -> None:
        meta = {"config": algorithm_fingerprint(cfg)} if cfg is not None else None
        self.manager.save(step, args=ocp.args.StandardSave(state), custom_metadata=meta)
        self.manager.wait_until_finished()

    def restore(self, step: int, like: dict[str, Any]) -> dict[str, Any]:
        """Restores into `like`'s tree structure, shapes and shardings (numpy leaves stay numpy).

        Top-level entries of `like` that the checkpoint does not hold (it predates them) are
        left out of the result. A checkpoint with per-layer `layers` restores into `like`'s
        stacked layers (module docstring).
        """
        saved = self.manager.item_metadata(step)
        like = {k: v for k, v in like.items() if k in saved.keys()}
        abstract = jax.tree.map(
            lambda x: x if isinstance(x, np.ndarray) else ocp.utils.to_shape_dtype_struct(x), like)
        per_layer = holds_per_layer(dict(saved.items())) and layer_runs.has_runs(abstract)
        if per_layer:
            abstract = layer_runs.unstack(abstract)
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        # Orbax returns plain tuples for optax's named tuples: rebuild the original structure.
        restored = jax.tree.unflatten(jax.tree.structure(abstract), jax.tree.leaves(restored))
        return layer_runs.stack(restored) if per_layer else restored

    def check_fingerprint(self, step: int, cfg: Config) -> None:
        """Refuses to resume under changed algorithm keys (older checkpoints carry none)."""
        custom = self.manager.metadata(step).custom_metadata or {}
        if "config" not in custom:
            return
        changed = fingerprint_mismatch(custom["config"], cfg)
        if changed:
            raise ConfigError(
                f"checkpoint step {step} in {self.directory} was trained under a different "
                f"config: {'; '.join(changed)}. Resume with the checkpoint's values, or start a "
                "new run (another run_name or base_output_directory).")

    def restore_latest(self, like: dict[str, Any], cfg: Config
                       ) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest readable checkpoint, falling back past unreadable ones
        with a message; None when there is none. A fingerprint mismatch, or checkpoints none
        of which can be read, is an error."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        for i, step in enumerate(steps):
            try:
                self.check_fingerprint(step, cfg)
                return step, self.restore(step, like)
            except ConfigError:
                raise
            except Exception as e:
                problem = (f"checkpoint step {step} in {self.directory} is unreadable "
                           f"({type(e).__name__}: {str(e)[:300]})")
                if i + 1 == len(steps):
                    raise ConfigError(f"{problem}, and no older checkpoint is left. Move the "
                                      "directory away to start the run from step 0.") from e
                print(f"{problem}; falling back to step {steps[i + 1]}", file=sys.stderr,
                      flush=True)
        return None

    def close(self) -> None:
        self.manager.close()
