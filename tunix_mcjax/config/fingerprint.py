"""What a checkpoint's state depends on: every key not marked `runtime_only`."""

from __future__ import annotations

import dataclasses
from typing import Any

from tunix_mcjax.config.core import FIELDS, Config

# Keys that change how a run executes or reports, not what it computes: a resume may change
# them. Every other key is part of a checkpoint's fingerprint (`algorithm_fingerprint`).
RUNTIME_ONLY_KEYS = frozenset(k for k, f in FIELDS.items() if f.metadata["runtime_only"])


def _plain(value: Any) -> Any:
    """A key's value as JSON keeps it (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value


def warmup_updates(cfg: Config) -> int:
    """Optimizer updates of the learning-rate warm-up: a fraction of all updates (steps x
    num_iterations), as MaxText's RL optimizer counts them."""
    return int(cfg.warmup_steps_fraction * cfg.steps * cfg.num_iterations)


def algorithm_fingerprint(cfg: Config) -> dict[str, Any]:
    """The keys a checkpoint's state depends on, with their values (JSON-safe). `steps` may
    change on resume, but not the warm-up length it implies."""
    keys = {k: _plain(v) for k, v in dataclasses.asdict(cfg).items()
            if k not in RUNTIME_ONLY_KEYS}
    keys["warmup_steps"] = warmup_updates(cfg)
    return keys


def fingerprint_mismatch(saved: dict[str, Any], cfg: Config) -> list[str]:
    """'key: saved -> now' for each fingerprinted key whose value differs from `saved`. A key
    added since the checkpoint was saved counts at its default (what the saving run did)."""
    now = algorithm_fingerprint(cfg)
    saved = {**{k: _plain(FIELDS[k].default) for k in now.keys() - saved.keys() if k in FIELDS},
             **saved}
    return [f"{k}: {saved.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}"
            for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
