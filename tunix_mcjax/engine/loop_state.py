"""What the decode loop (`engine.decode_loop`) carries and exchanges: the static shape of one
compiled program, its per-call inputs and outputs, the loop's state in typed parts (the
distinct prompts, the decode rows, the requests, the counters), and the model protocol.

Shapes: U distinct prompts, B decode rows (slots), N requests, V vocab entries.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from tunix_mcjax.engine import pages as pg
from tunix_mcjax.engine.qwen3_forward import PagedRows

ABSENT, PREFILLING, RESIDENT = 0, 1, 2  # a prompt's pages
# A finished conversation's pages kept in its prompt slot (`Prompts.base` tokens resident) for
# a request that continues it (`engine.session`'s `keep`); evicted like an idle prompt.
KEPT = 3

MIN_PACKED_SLOTS = 32  # fewer slots decode at their own count: one size, no packing
PACKED_SHARE = 8  # the packed row count: an eighth of the slots


def decode_row_sizes(num_slots: int) -> tuple[int, ...]:
    """Row counts a decode step may run at, ascending: the slots and, from MIN_PACKED_SLOTS
    slots up, an eighth of them. Each count compiles the model's step once more (on CPU a
    third size, a quarter apart, made Qwen3-0.6B's program compile 1.4x longer for little: the
    decode-heavy eos-cpu bench 2.83x against 2.51x, intervals overlapping)."""
    if num_slots < MIN_PACKED_SLOTS:
        return (num_slots,)
    return (num_slots // PACKED_SHARE, num_slots)


@dataclasses.dataclass(frozen=True)
class ProgramShape:
    """Static shapes of one compiled program."""

    num_requests: int
    num_slots: int  # rows decoded at once
    num_prompts: int  # distinct prompts
    prompt_len: int  # prompt bucket
    max_new: int
    page_size: int
    num_pages: int  # the pool's
    chunk: int  # prefill tokens per row
    prefill_rows: int  # prefill rows per iteration
    group_size: int  # most requests of one prompt (a GRPO group); 1: no prompt is shared
    pack_decode_rows: bool = True  # decode only the live rows, packed (`decode_row_sizes`)
    # (MoE layers, top-k) when the model reports each token's experts (`DecodeModel`); None:
    # no routing is recorded.
    routing: tuple[int, int] | None = None

    @property
    def row_sizes(self) -> tuple[int, ...]:
        """Row counts a decode step runs at (`decode_row_sizes`), ascending."""
        if not self.pack_decode_rows:
            return (self.num_slots,)
        return decode_row_sizes(self.num_slots)

    @property
    def table_pages(self) -> int:
        return pg.table_pages(self.prompt_len, self.max_new, self.page_size)

    @property
    def prompt_pages(self) -> int:
        return pg.cdiv(self.prompt_len, self.page_size)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Per-call device inputs of the program (everything dynamic)."""

    prompts: jax.Array  # int32 [num_prompts, prompt_len], distinct prompts, right-padded
    prompt_lens: jax.Array  # int32 [num_prompts]; 0 for padding
    request_prompts: jax.Array  # int32 [N]: each request's prompt; -1 pads
    request_keys: jax.Array  # uint32 [N, 2]: each request's key (`engine.keys`)
    temperature: jax.Array  # float32
    top_p: jax.Array  # float32
    stop_ids: jax.Array  # int32 [K], -1 padded: tokens that end a sequence
    max_new_tokens: jax.Array  # int32
    # int32 [N]: the prompt slot a request keeps its pages in when done (`Requests.keep`; a
    # session's, `engine.session`), -1: none; None: no request keeps pages (`generate`).
    request_kept: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Outputs:
    tokens: jax.Array  # int32 [N, max_new]
    logprobs: jax.Array  # float32 [N, max_new]
    lengths: jax.Array  # int32 [N]
    iterations: jax.Array  # int32: loop iterations
    prefill_steps: jax.Array  # int32: iterations that ran a prefill chunk
    preemptions: jax.Array  # int32
    shared_pages: jax.Array  # int32: prompt pages rows read that a row before them had read
    peak_pages: jax.Array  # int32: most pages in use at once
    packed_steps: jax.Array  # int32: decode steps run at fewer rows than the slots
    stalled: jax.Array  # bool: the loop ended with requests left (the pool cannot hold one)
    prefill_tokens: jax.Array  # int32: prompt tokens run through the model by prefill chunks
    # With `ProgramShape.routing` (else None): each request's prompt length and the experts
    # its prompt tokens and its completion tokens went to, int32 [N, T, layers, k], -1 where
    # none ran (a completion's last token never runs through the model).
    prompt_lens: jax.Array | None = None
    prompt_routing: jax.Array | None = None
    routing: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Prompts:
    """The distinct prompts' pages and prefill progress, [U] each."""

    tables: jax.Array  # int32 [U, prompt_pages]
    status: jax.Array  # int32 [U]: ABSENT | PREFILLING | RESIDENT
    next_chunk: jax.Array  # int32 [U]
    rows: jax.Array  # int32 [U]: active rows on the prompt's pages
    left: jax.Array  # int32 [U]: its requests not finished
    readers: jax.Array  # int32 [U]: rows admitted on its pages since its prefill
    logits: jax.Array  # float32 [U, V]: logits after the prompt's last token
    # int32 [U]: tokens of the prompt whose keys/values its pages held before its prefill (a
    # kept conversation's, status KEPT); its prefill starts there. 0: none.
    base: jax.Array
    routing: jax.Array | None = None  # int32 [U, prompt_len, layers, k] (`Outputs`)


@dataclasses.dataclass(frozen=True)
class Rows:
    """The decode rows (slots), [B] each."""

    active: jax.Array  # bool [B]
    request: jax.Array  # int32 [B]
    cursor: jax.Array  # int32 [B]: index of the row's input token in its completion
    token: jax.Array  # int32 [B]: the row's input token
    tables: jax.Array  # int32 [B, table_pages]
    order: jax.Array  # int32 [B]: admission count when admitted (preemption picks the max)
    admissions: jax.Array  # int32: rows admitted so far


@dataclasses.dataclass(frozen=True)
class Requests:
    """Every request's state and its completion so far, [N] each."""

    running: jax.Array  # bool [N]: on a row
    done: jax.Array  # bool [N]
    tokens: jax.Array  # int32 [N, max_new]
    logprobs: jax.Array  # float32 [N, max_new]
    lengths: jax.Array  # int32 [N]
    keep: jax.Array  # bool [N]: when done, its pages stay in its keep slot (status KEPT)
    routing: jax.Array | None = None  # int32 [N, max_new, layers, k] (`Outputs`)

    @property
    def waiting(self) -> jax.Array:
        return ~self.done & ~self.running


@dataclasses.dataclass(frozen=True)
class Stats:
    """The loop's counters (`Outputs` names them)."""

    iterations: jax.Array
    prefill_steps: jax.Array
    preemptions: jax.Array
    shared_pages: jax.Array
    peak_pages: jax.Array
    packed_steps: jax.Array
    stalled: jax.Array
    prefill_tokens: jax.Array


@dataclasses.dataclass(frozen=True)
class LoopState:
    pool: Any  # the model's page arrays
    free: pg.FreeStack
    refs: jax.Array  # int32 [num_pages]: each page's holders (`engine.block_tables`)
    prompts: Prompts
    rows: Rows
    requests: Requests
    stats: Stats


for _cls in (Inputs, Outputs, Prompts, Rows, Requests, Stats, LoopState):
    jax.tree_util.register_dataclass(_cls)


def replace(part: Any, **changes: Any) -> Any:
    """`part` (the state or one of its parts) with `changes`."""
    return dataclasses.replace(part, **changes)


class DecodeModel(Protocol):
    """What the loop needs from a model: its page pool and one call over rows of tokens."""

    def empty_pool(self, num_pages: int, page_size: int) -> Any:
        """The pool's page arrays, zeroed."""

    def forward(self, params: Any, pool: Any, rows: PagedRows) -> tuple[jax.Array, Any]:
        """`rows` through the model -> (fp32 logits [R, V] at `rows.logit_cols`, the pool with
        the rows' keys/values written); a model built to report routing adds each row token's
        experts, int32 [R, C, layers, k] (the program's `ProgramShape.routing`)."""

    def copy_page(self, pool: Any, source: jax.Array, target: jax.Array) -> Any:
        """The pool with pages `target` holding pages `source`'s contents, in every layer
        (arrays of page ids; a target past the pool is dropped)."""
