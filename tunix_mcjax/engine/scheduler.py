"""The loop's scheduler: which requests wait in what order, which prompts get pages and which
of their chunks prefill, which waiting requests take free rows, and where decode rows get
their next pages (evicting idle prompts, then preempting the last admitted rows, when the
pool runs dry). Each choice is handed to the runner (`engine.runner`) as a typed decision.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from tunix_mcjax.engine.block_tables import (
    evict_prompts,
    note_usage,
    row_prompts,
    take_pages,
    vacate_rows,
)
from tunix_mcjax.engine.loop_state import (
    ABSENT,
    KEPT,
    PREFILLING,
    RESIDENT,
    Inputs,
    LoopState,
    ProgramShape,
    replace,
)
from tunix_mcjax.engine.scatter import set_where


@dataclasses.dataclass(frozen=True)
class PrefillChunks:
    """The prompt chunks one prefill step runs, a row each: [prefill_rows] each."""

    prompt: jax.Array  # int32: the row's prompt
    chunk: jax.Array  # int32: which of its chunks
    valid: jax.Array  # bool: False for rows past the last chunk


@dataclasses.dataclass(frozen=True)
class Admission:
    """Waiting requests in priority order and which of them take a free row now: [B] each."""

    request: jax.Array  # int32
    prompt: jax.Array  # int32: its prompt
    ready: jax.Array  # bool: admitted now
    row: jax.Array  # int32: the free row it takes (where ready)
    full: jax.Array  # int32: its prompt's full pages (shared by the row's table)
    partial: jax.Array  # bool: the prompt's last page is partly filled (the row copies it)


@dataclasses.dataclass(frozen=True)
class DecodeRows:
    """Where each row's input token goes in this decode step, [B] each."""

    prompt: jax.Array  # int32: the row's prompt
    position: jax.Array  # int32: the token's position in the row's sequence
    column: jax.Array  # int32: its block table entry


for _cls in (PrefillChunks, Admission, DecodeRows):
    jax.tree_util.register_dataclass(_cls)


def waiting_priority(state: LoopState) -> jax.Array:
    """Per request, lower is admitted sooner: preempted ones in order, then fresh ones in order;
    2N for requests that are not waiting."""
    requests = state.requests
    n = requests.done.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    return jnp.where(requests.waiting, jnp.where(requests.lengths > 0, index, n + index), 2 * n)


def preempt_last_row(shape: ProgramShape, inp: Inputs, state: LoopState,
                     need: jax.Array) -> tuple[LoopState, jax.Array]:
    """The last admitted row waits again (its pages go back); it needs no page now."""
    victim = jnp.argmax(jnp.where(state.rows.active, state.rows.order, -1))
    rows = jnp.arange(shape.num_slots) == victim
    state = vacate_rows(shape, inp, state, rows, jnp.zeros_like(rows))
    stats = replace(state.stats, preemptions=state.stats.preemptions + 1)
    return replace(state, stats=stats), need & ~rows


def make_room(shape: ProgramShape, inp: Inputs, state: LoopState,
              need: jax.Array) -> tuple[LoopState, jax.Array]:
    """Free pages until the rows in `need` [B] can each take one: first the pages of prompts no
    row uses, then the last admitted rows (preempted: they wait again). Returns the state and
    the rows that still need a page."""

    def short(carry):
        state, need = carry
        return jnp.sum(need) > state.free.count

    def free_one(carry):
        state, need = carry
        idle = (state.prompts.status != ABSENT) & (state.prompts.rows == 0)
        first_idle = jnp.arange(shape.num_prompts) == jnp.argmax(idle)
        return jax.lax.cond(jnp.any(idle), lambda s, n: (evict_prompts(s, first_idle), n),
                            functools.partial(preempt_last_row, shape, inp), state, need)

    return jax.lax.while_loop(short, free_one, (state, need))


def start_prefills(shape: ProgramShape, inp: Inputs, state: LoopState) -> LoopState:
    """Pages for the absent prompts of the requests that would take the free rows next, in that
    order, while the free stack holds each prompt and one page for its first row's copy. A KEPT
    prompt (a conversation's pages, `Prompts.base` tokens resident) takes only the pages its
    new tokens need, and its prefill starts at its base."""
    state = reclaim_kept(shape, inp, state)
    prompt, first = next_starts(shape, inp, state)
    want = missing_pages(shape, inp, state, prompt) & first[:, None]
    start = first & (jnp.cumsum(jnp.where(first, jnp.sum(want, axis=1) + 1, 0))
                     <= state.free.count)
    taken, state = take_pages(state, want & start[:, None])
    prompts = state.prompts
    tables = jnp.where(start[:, None] & want, taken, prompts.tables[prompt])
    return note_usage(replace(state, prompts=replace(
        prompts,
        tables=set_where(prompts.tables, prompt, tables, start),
        status=set_where(prompts.status, prompt, PREFILLING, start),
        next_chunk=set_where(prompts.next_chunk, prompt, 0, start),
        readers=set_where(prompts.readers, prompt, 0, start),
    )))


def next_starts(shape: ProgramShape, inp: Inputs,
                state: LoopState) -> tuple[jax.Array, jax.Array]:
    """The prompts of the waiting requests that would take the free rows next, in that order,
    [num_slots], and which of them start a prefill (the first request of an absent or kept
    prompt)."""
    order = jnp.argsort(waiting_priority(state))[: shape.num_slots]
    free_rows = shape.num_slots - jnp.sum(state.rows.active)
    waiting = jnp.sum(state.requests.waiting)
    candidate = jnp.arange(shape.num_slots) < jnp.minimum(free_rows, waiting)
    prompt = jnp.maximum(inp.request_prompts[order], 0)
    earlier = jnp.tril(prompt[:, None] == prompt[None, :], k=-1) & candidate[None, :]
    status = state.prompts.status[prompt]
    first = candidate & ~jnp.any(earlier, axis=1) & ((status == ABSENT) | (status == KEPT))
    return prompt, first


def missing_pages(shape: ProgramShape, inp: Inputs, state: LoopState,
                  prompt: jax.Array) -> jax.Array:
    """bool [len(prompt), prompt_pages]: the pages each prompt's tokens need that its table
    lacks (all of them for an absent prompt)."""
    num_pages = (inp.prompt_lens[prompt] + shape.page_size - 1) // shape.page_size
    column = jnp.arange(shape.prompt_pages)[None, :]
    return (column < num_pages[:, None]) & (state.prompts.tables[prompt] < 0)


def reclaim_kept(shape: ProgramShape, inp: Inputs, state: LoopState) -> LoopState:
    """With no row running, evict kept conversations no request waits on until the prompts
    of the next waiting requests can all start (`next_starts`: one iteration, not one a
    request), then idle prompts (kept conversations first) until the first of them can:
    kept pages never stall the loop."""
    first = jnp.argmin(waiting_priority(state))
    prompt = jnp.maximum(inp.request_prompts[first], 0)
    index = jnp.arange(shape.num_prompts)

    def all_short(state: LoopState) -> jax.Array:
        starts, starting = next_starts(shape, inp, state)
        need = jnp.sum(missing_pages(shape, inp, state, starts) & starting[:, None])
        return ~jnp.any(state.rows.active) & (need + jnp.sum(starting) > state.free.count)

    def first_short(state: LoopState) -> jax.Array:
        status = state.prompts.status[prompt]
        need = jnp.sum(missing_pages(shape, inp, state, prompt[None])) + 1
        return (~jnp.any(state.rows.active) & state.requests.waiting[first]
                & ((status == ABSENT) | (status == KEPT)) & (need > state.free.count))

    def finished(state: LoopState) -> jax.Array:
        prompts = state.prompts
        return (prompts.status == KEPT) & (prompts.left == 0) & (prompts.rows == 0)

    def idle(state: LoopState) -> jax.Array:
        prompts = state.prompts
        return (prompts.status != ABSENT) & (prompts.rows == 0) & (index != prompt)

    def evict_while(state: LoopState, short: Any, evictable: Any) -> LoopState:
        def evict_one(state: LoopState) -> LoopState:
            pick = jnp.argmax(jnp.where(jnp.any(finished(state)), finished(state),
                                        evictable(state)))
            return evict_prompts(state, index == pick)

        return jax.lax.while_loop(lambda s: short(s) & jnp.any(evictable(s)), evict_one, state)

    return evict_while(evict_while(state, all_short, finished), first_short, idle)


def prefill_chunks(shape: ProgramShape, inp: Inputs, state: LoopState) -> PrefillChunks:
    """The next chunks of the prompts being prefilled, in prompt order (a prompt's chunks
    start at its `base`)."""
    prompts = state.prompts
    chunks = (inp.prompt_lens - prompts.base + shape.chunk - 1) // shape.chunk
    remaining = jnp.where(prompts.status == PREFILLING, chunks - prompts.next_chunk, 0)
    ends = jnp.cumsum(remaining)
    row = jnp.arange(shape.prefill_rows)
    prompt = jnp.clip(jnp.searchsorted(ends, row, side="right"), 0, shape.num_prompts - 1)
    chunk = prompts.next_chunk[prompt] + row - (ends[prompt] - remaining[prompt])
    return PrefillChunks(prompt, chunk, row < ends[-1])


def choose_admissions(shape: ProgramShape, inp: Inputs, state: LoopState) -> Admission:
    """Waiting requests take free rows, all at once and in priority order: the first ones whose
    prompts are resident (up to the first that is not), while free rows last and the free stack
    holds a page for each one's copy of its prompt's partly filled last page."""
    b = shape.num_slots
    priority = waiting_priority(state)
    request = jnp.argsort(priority)[:b].astype(jnp.int32)
    prompt = jnp.maximum(inp.request_prompts[request], 0)
    length = inp.prompt_lens[prompt]
    full, partial = length // shape.page_size, length % shape.page_size != 0
    ready = (priority[request] < 2 * shape.num_requests) \
        & (state.prompts.status[prompt] == RESIDENT)
    ready = (jnp.cumprod(ready) > 0) & (jnp.arange(b) < jnp.sum(~state.rows.active))
    ready &= jnp.cumsum(ready & partial) <= state.free.count
    free_row = jnp.argsort(state.rows.active, stable=True)[:b]
    return Admission(request, prompt, ready, free_row, full, partial)


def schedule_decode(shape: ProgramShape, inp: Inputs,
                    state: LoopState) -> tuple[LoopState, DecodeRows]:
    """A page for every active row whose input token starts one, making room first."""
    prompt = row_prompts(inp, state)
    position = inp.prompt_lens[prompt] + state.rows.cursor
    column = position // shape.page_size
    rows = jnp.arange(shape.num_slots)
    need = state.rows.active & (state.rows.tables[rows, column] < 0)
    state, need = make_room(shape, inp, state, need)
    taken, state = take_pages(state, need)
    tables = state.rows.tables.at[rows, column].set(
        jnp.where(need, taken, state.rows.tables[rows, column]))
    state = note_usage(replace(state, rows=replace(state.rows, tables=tables)))
    return state, DecodeRows(prompt, position, column)
