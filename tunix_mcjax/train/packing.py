"""Pack (prompt, completion, advantage, behaviour logprobs) into fixed-length training rows.

Several sequences share a row, kept apart by segment ids (attention never crosses segments) and
per-segment positions. Position t of a row holds the loss terms for predicting token t+1 of the
same segment, so `targets[t]` is that token and `loss_mask[t]` is 1 only where it is a completion
token the model sampled (tool and environment tokens of an agentic trajectory carry no loss).
All functions here are pure numpy.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Sequence:
    prompt: np.ndarray  # int32 [a]
    completion: np.ndarray  # int32 [b], b >= 1
    advantage: float
    behaviour_logprobs: np.ndarray  # float32 [b]
    # float32 [b]: 1 where the model sampled the token, 0 for tool/environment tokens (agentic
    # rollouts); None: every completion token is the model's.
    completion_mask: np.ndarray | None = None
    # int32 [a + b, MoE layers, k]: the experts the engine routed each token to (-1: none ran),
    # which the trainer's forward replays (`moe_router_replay`); None: not recorded.
    routing: np.ndarray | None = None

    def model_mask(self) -> np.ndarray:
        """1.0 per completion token the loss counts."""
        if self.completion_mask is None:
            return np.ones(len(self.completion), np.float32)
        if len(self.completion_mask) != len(self.completion):
            raise ValueError(f"completion_mask has {len(self.completion_mask)} entries for "
                             f"{len(self.completion)} completion tokens")
        return np.asarray(self.completion_mask, np.float32)


@dataclasses.dataclass(frozen=True)
class Rows:
    """Local training rows, [rows, row_len] each."""

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray  # 0 marks padding
    targets: np.ndarray
    loss_mask: np.ndarray  # 1.0 where targets[t] is a completion token the model sampled
    advantages: np.ndarray
    old_logps: np.ndarray
    seq_weight: np.ndarray  # 1/b for the sequence's completion tokens (sequence-mean mode)
    routing: np.ndarray | None = None  # int32 [rows, row_len, MoE layers, k]; -1: no expert

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]


def first_fit_decreasing(lengths: list[int], row_len: int) -> list[list[int]]:
    """Bins of sequence indices whose lengths sum to <= row_len; deterministic."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > row_len:
            raise ValueError(f"sequence of {lengths[i]} tokens does not fit a {row_len}-token row")
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(row_len - lengths[i])
    return rows


def pack(seqs: list[Sequence], row_len: int, pad_id: int) -> Rows:
    """Packs sequences into as few rows of `row_len` as first-fit-decreasing finds."""
    bins = first_fit_decreasing([len(s.prompt) + len(s.completion) for s in seqs], row_len)
    shape = (len(bins), row_len)
    out = Rows(
        tokens=np.full(shape, pad_id, np.int32),
        positions=np.zeros(shape, np.int32),
        segment_ids=np.zeros(shape, np.int32),
        targets=np.full(shape, pad_id, np.int32),
        loss_mask=np.zeros(shape, np.float32),
        advantages=np.zeros(shape, np.float32),
        old_logps=np.zeros(shape, np.float32),
        seq_weight=np.zeros(shape, np.float32),
        routing=routing_rows(seqs, shape),
    )
    for r, members in enumerate(bins):
        offset = 0
        for seg, i in enumerate(members, start=1):
            s = seqs[i]
            a, b = len(s.prompt), len(s.completion)
            n = a + b
            span = slice(offset, offset + n)
            out.tokens[r, span] = np.concatenate([s.prompt, s.completion])
            out.positions[r, span] = np.arange(n)
            out.segment_ids[r, span] = seg
            # Positions a-1 .. n-2 predict the completion tokens.
            pred = slice(offset + a - 1, offset + n - 1)
            out.targets[r, pred] = s.completion
            mask = s.model_mask()
            out.loss_mask[r, pred] = mask
            out.advantages[r, pred] = s.advantage
            out.old_logps[r, pred] = s.behaviour_logprobs * mask
            out.seq_weight[r, pred] = mask / max(mask.sum(), 1.0)
            if out.routing is not None:
                out.routing[r, span] = s.routing
            offset += n
    return out


def routing_rows(seqs: list[Sequence], shape: tuple[int, int]) -> np.ndarray | None:
    """Unrouted (-1) routing rows for `seqs`, or None when none carries routing; refuses a mix
    or a sequence whose routing does not cover its tokens."""
    routed = [s.routing for s in seqs if s.routing is not None]
    if not routed:
        return None
    if len(routed) != len(seqs):
        raise ValueError(f"{len(routed)} of {len(seqs)} sequences carry routing: the trainer "
                         "replays all or none")
    for s in seqs:
        if len(s.routing) != len(s.prompt) + len(s.completion):
            raise ValueError(f"routing covers {len(s.routing)} tokens of a "
                             f"{len(s.prompt) + len(s.completion)}-token sequence")
    return np.full((*shape, *routed[0].shape[1:]), -1, np.int32)


def rows_per_device(local_rows: list[int], local_devices: int) -> int:
    """K: the padded row count per device that every host uses (from all hosts' row counts).

    Rounded up to a power of two, so the train step compiles for a bounded set of shapes
    however packing varies from step to step.
    """
    need = max(1, max(-(-n // local_devices) for n in local_rows))
    return 1 << (need - 1).bit_length()


def pad_rows(rows: Rows, num_rows: int, pad_id: int) -> Rows:
    """Appends empty rows (segment 0, no loss) up to `num_rows`."""
    extra = num_rows - rows.num_rows
    if extra < 0:
        raise ValueError(f"cannot pad {rows.num_rows} rows down to {num_rows}")

    def grow(name: str, x: np.ndarray | None) -> np.ndarray | None:
        if x is None:
            return None
        fill = pad_id if name in ("tokens", "targets") else -1 if name == "routing" else 0
        return np.concatenate([x, np.full((extra, *x.shape[1:]), fill, x.dtype)])

    return Rows(**{f.name: grow(f.name, getattr(rows, f.name)) for f in dataclasses.fields(Rows)})
