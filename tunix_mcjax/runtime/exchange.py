"""The one cross-host exchange of a step, at pack time, in one all-gather.

It carries every host's packed row count (the agreed rows per device K), sequence and token
counts (the global loss weights), the previous step's host metrics (host 0's global record of
that step: deferred to this exchange, so no step ends in a metrics barrier), and this step's
mean completion length per prompt (O3's length history, the same on every host). Counts travel
as exact int64, the rest as float64 (`topology.allgather` keeps 8-byte values bit-exact).
Every host sends the same sizes: `metrics` of one length, `lengths` of one row count.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tunix_mcjax import topology
from tunix_mcjax.train import packing

NUM_COUNTS = 3  # rows, sequences, completion tokens


@dataclasses.dataclass(frozen=True)
class HostMessage:
    """What one host sends."""

    rows: int
    sequences: int
    tokens: int
    metrics: np.ndarray  # float64 [m]: the deferred step's host vector
    lengths: np.ndarray  # float64 [n, 2]: (dataset prompt index, mean completion length)

    @classmethod
    def metrics_only(cls, metrics: np.ndarray) -> HostMessage:
        """No rows: the exchange that delivers the last step's metrics at the end of a run."""
        return cls(0, 0, 0, np.asarray(metrics, np.float64), np.zeros((0, 2)))

    def encode(self) -> np.ndarray:
        counts = np.array([self.rows, self.sequences, self.tokens], np.int64)
        return np.concatenate([counts.view(np.float64), np.asarray(self.metrics, np.float64),
                               np.asarray(self.lengths, np.float64).reshape(-1)])


@dataclasses.dataclass(frozen=True)
class Exchanged:
    """What every host received: each host's message, in host order."""

    rows: np.ndarray  # int64 [hosts]
    sequences: np.ndarray  # int64 [hosts]
    tokens: np.ndarray  # int64 [hosts]
    metrics: np.ndarray  # float64 [hosts, m]
    lengths: np.ndarray  # float64 [hosts * n, 2]

    @classmethod
    def decode(cls, gathered: np.ndarray, num_metrics: int) -> Exchanged:
        """From the all-gathered `HostMessage.encode()`s ([hosts, width])."""
        counts = np.ascontiguousarray(gathered[:, :NUM_COUNTS]).view(np.int64)
        metrics = gathered[:, NUM_COUNTS:NUM_COUNTS + num_metrics]
        lengths = gathered[:, NUM_COUNTS + num_metrics:].reshape(-1, 2)
        return cls(counts[:, 0], counts[:, 1], counts[:, 2], metrics, lengths)

    @property
    def global_sequences(self) -> int:
        return int(self.sequences.sum())

    @property
    def global_tokens(self) -> int:
        return int(self.tokens.sum())

    def rows_per_device(self, num_local_devices: int) -> int:
        """K: every host pads its rows to K per local device (`packing.rows_per_device`)."""
        return packing.rows_per_device(self.rows.tolist(), num_local_devices)


def exchange(message: HostMessage, watchdog: topology.Watchdog | None,
             phase: str = "pack") -> Exchanged:
    """All-gathers `message` from every host (under the watchdog's `phase` deadline)."""
    if watchdog is None:
        gathered = topology.allgather(message.encode())
    else:
        with watchdog.guard(phase):
            gathered = topology.allgather(message.encode())
    return Exchanged.decode(gathered, len(message.metrics))
