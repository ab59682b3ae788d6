"""The pure step math of one host: sequences from scored rollouts, rows padded to the agreed K
with global loss weights, and O3's completion-length history.

Numpy in, numpy out: no devices and no other hosts. What the hosts must agree on (K, global
sequence and token counts) arrives as arguments, from the step's one exchange (`exchange.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tunix_mcjax.engine import Completion
from tunix_mcjax.train import packing
from tunix_mcjax.train.loss import loss_weights

# The packed rows' fields the train step reads, beside the loss weights.
ROW_FIELDS = ("tokens", "positions", "segment_ids", "targets", "loss_mask", "advantages",
              "old_logps")


def sequences(prompts: Sequence[np.ndarray], completions: Sequence[Completion],
              advantages: np.ndarray, masks: Sequence[np.ndarray] | None = None
              ) -> list[packing.Sequence]:
    """Completion j with its prompt `prompts[j]`, its advantage and its behaviour logprobs (the
    engine's logprobs of the sampled tokens: the old policy of the importance ratio); `masks`:
    each completion's model mask (agentic trajectories), None: every token is the model's."""
    masks = masks if masks is not None else [None] * len(completions)
    return [packing.Sequence(p, c.tokens, float(a), c.logprobs, m, c.routing)
            for p, c, a, m in zip(prompts, completions, advantages, masks, strict=True)]


def completion_tokens(seqs: Sequence[packing.Sequence]) -> int:
    """Completion tokens that carry loss (the model's; not an agentic run's tool tokens)."""
    return int(sum(s.model_mask().sum() for s in seqs))


def loss_sequences(seqs: Sequence[packing.Sequence]) -> int:
    """Sequences with at least one token that carries loss (Tunix's non-empty rows)."""
    return sum(1 for s in seqs if s.model_mask().any())


def local_batch(rows: packing.Rows, rows_per_device: int, num_local_devices: int, pad_id: int,
                loss_agg_mode: str, global_sequences: int, global_tokens: int
                ) -> dict[str, np.ndarray]:
    """This host's rows padded to K per local device, with the per-token weights whose
    weighted sum is Tunix's loss aggregate over the global batch."""
    rows = packing.pad_rows(rows, rows_per_device * num_local_devices, pad_id)
    local = {f: getattr(rows, f) for f in ROW_FIELDS}
    if rows.routing is not None:  # the engine's experts, for the trainer to replay
        local["routing"] = rows.routing
    local["weights"] = loss_weights(rows, loss_agg_mode, global_sequences,
                                    global_tokens).astype(np.float32)
    return local


def mean_length_by_prompt(completions: Sequence[Completion], num_prompts: int) -> np.ndarray:
    """Mean completion length of each prompt's group (completions are grouped by prompt)."""
    if not num_prompts:
        return np.zeros(0)
    lens = np.array([len(c.tokens) for c in completions])
    return lens.reshape(num_prompts, -1).mean(1)


class LengthHistory:
    """O3's expected output: the mean completion length each dataset prompt decoded to, over
    every step that admitted it (every host's prompts, so all hosts admit alike)."""

    def __init__(self, num_prompts: int):
        self.total = np.zeros(num_prompts)
        self.count = np.zeros(num_prompts)

    def expected(self, indices: np.ndarray, default: float) -> np.ndarray:
        """Mean observed length of each prompt in `indices`; `default` for one never seen."""
        seen = self.count[indices]
        return np.where(seen > 0, self.total[indices] / np.maximum(seen, 1), default)

    def add(self, pairs: np.ndarray) -> None:
        """`pairs` [n, 2]: (dataset prompt index, mean completion length of its group)."""
        idx = pairs[:, 0].astype(int)
        np.add.at(self.total, idx, pairs[:, 1])
        np.add.at(self.count, idx, 1)

    def state(self) -> np.ndarray:
        """[2, num_prompts] (sums, counts): what a checkpoint keeps."""
        return np.stack([self.total, self.count])

    def load(self, state: np.ndarray) -> None:
        self.total, self.count = np.array(state)
