"""The block tables of the loop's prompts and rows, and the pool's bookkeeping: pages go back
to the free stack (`engine.pages`) when rows finish or are preempted and when a prompt no
request needs is evicted; the peak of pages in use is recorded.

A row's table starts with its prompt's full pages, shared with the prompt's other rows, then
pages of its own: a copy of the prompt's partly filled last page and the pages it decodes into.
Each page counts its holders (`LoopState.refs`): the prompt tables that list it and the row
that owns it. A kept conversation's table (`keep_rows`) lists its group's full prompt pages
beside the prompt's own table, so a page goes back to the free stack when its last holder
lets go.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tunix_mcjax.engine import pages as pg
from tunix_mcjax.engine.loop_state import (
    ABSENT,
    KEPT,
    Inputs,
    LoopState,
    ProgramShape,
    replace,
)
from tunix_mcjax.engine.scatter import add_where, set_where


def take_pages(state: LoopState, want: jax.Array) -> tuple[jax.Array, LoopState]:
    """A page from the free stack for each True of `want` (-1 elsewhere), each held once; the
    caller checks the stack holds them."""
    taken, free = pg.take(state.free, want)
    refs = state.refs.at[jnp.where(taken >= 0, taken, state.refs.shape[0])].set(1, mode="drop")
    return taken, replace(state, free=free, refs=refs)


def hold_pages(state: LoopState, pages: jax.Array, hold: jax.Array) -> LoopState:
    """One more holder for each of `pages` where `hold` (pages < 0 ignored)."""
    return replace(state, refs=_count(state.refs, pages, hold, 1))


def release_pages(state: LoopState, pages: jax.Array, release: jax.Array) -> LoopState:
    """One holder fewer for each of `pages` where `release` (pages < 0 ignored, a page may
    appear more than once); those left with none go back to the free stack."""
    refs = _count(state.refs, pages, release, -1)
    freed = (refs == 0) & (state.refs > 0)
    free = pg.give(state.free, jnp.arange(refs.shape[0], dtype=jnp.int32), freed)
    return replace(state, free=free, refs=refs)


def _count(refs: jax.Array, pages: jax.Array, where: jax.Array, delta: int) -> jax.Array:
    index = jnp.where(where & (pages >= 0), pages, refs.shape[0])
    return refs.at[index.reshape(-1)].add(delta, mode="drop")


def evict_prompts(state: LoopState, evict: jax.Array) -> LoopState:
    """Give back the pages of the prompts where `evict` [U]; they are prefilled again if needed."""
    state = release_pages(state, state.prompts.tables, evict[:, None])
    return replace(state, prompts=replace(
        state.prompts,
        tables=jnp.where(evict[:, None], -1, state.prompts.tables),
        status=jnp.where(evict, ABSENT, state.prompts.status),
        base=jnp.where(evict, 0, state.prompts.base),
    ))


def private_pages(shape: ProgramShape, prompt_len: jax.Array) -> jax.Array:
    """bool [B, table_pages]: the table entries a row owns (not its prompt's shared pages)."""
    return jnp.arange(shape.table_pages)[None, :] >= (prompt_len // shape.page_size)[:, None]


def admission_tables(shape: ProgramShape, state: LoopState, prompt: jax.Array, full: jax.Array,
                     copied: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, LoopState]:
    """The block tables of rows admitted on `prompt` [B] with `full` [B] full pages: those
    pages, then, where `copied`, a page of the row's own for a copy of the prompt's partly
    filled last page. Returns (tables [B, table_pages], the copies' pages [B] (-1: none), the
    prompt pages they copy [B], the state with the copies' pages taken)."""
    column = jnp.arange(shape.table_pages)
    copy, state = take_pages(state, copied)
    prompt_pages = state.prompts.tables[prompt]
    last = shape.prompt_pages - 1
    shared = jnp.where(column[None] < full[:, None],
                       prompt_pages[:, jnp.minimum(column, last)], -1)
    tables = jnp.where(column[None] == full[:, None], copy[:, None], shared)
    source = jnp.take_along_axis(prompt_pages, jnp.minimum(full, last)[:, None],
                                 axis=1)[:, 0]
    return tables, copy, source, state


def row_prompts(inp: Inputs, state: LoopState) -> jax.Array:
    """int32 [B]: each row's prompt (0 for a row of a padding request)."""
    return jnp.maximum(inp.request_prompts[state.rows.request], 0)


def vacate_rows(shape: ProgramShape, inp: Inputs, state: LoopState, rows: jax.Array,
                finished: jax.Array) -> LoopState:
    """Rows where `rows` leave the batch (finished, or preempted): their own pages go back
    (a finished row that keeps them gives them to its prompt: `keep_rows`), and a prompt whose
    requests all finished gives its pages back too, unless kept."""
    prompt = row_prompts(inp, state)
    kept = keeping(shape, inp, state, rows & finished)
    owned = private_pages(shape, inp.prompt_lens[prompt]) & rows[:, None] & ~kept[:, None]
    state = keep_rows(shape, inp, release_pages(state, state.rows.tables, owned), kept)
    request = state.rows.request
    left = add_where(state.prompts.left, prompt, -1, rows & finished)
    state = replace(
        state,
        rows=replace(state.rows, active=state.rows.active & ~rows,
                     tables=jnp.where(rows[:, None], -1, state.rows.tables)),
        requests=replace(state.requests,
                         running=set_where(state.requests.running, request, False, rows),
                         done=set_where(state.requests.done, request, True, rows & finished)),
        prompts=replace(state.prompts, rows=add_where(state.prompts.rows, prompt, -1, rows),
                        left=left),
    )
    status = state.prompts.status
    return evict_prompts(state, (left == 0) & (status != ABSENT) & (status != KEPT))


def keeping(shape: ProgramShape, inp: Inputs, state: LoopState,
            finished: jax.Array) -> jax.Array:
    """bool [B]: the finished rows whose request keeps its pages, where a continuation fits:
    the keys/values of its prompt and completion but the last token (never run) leave at least
    one token of the prompt bucket free."""
    request = state.rows.request
    resident = inp.prompt_lens[row_prompts(inp, state)] + state.requests.lengths[request] - 1
    return finished & state.requests.keep[request] & (resident < shape.prompt_len)


def kept_slots(inp: Inputs, state: LoopState) -> jax.Array:
    """int32 [B]: the prompt slot each row's request keeps its pages in (`Inputs.request_kept`;
    without it, the row's prompt)."""
    if inp.request_kept is None:
        return row_prompts(inp, state)
    return jnp.maximum(inp.request_kept[state.rows.request], 0)


def keep_rows(shape: ProgramShape, inp: Inputs, state: LoopState,
              kept: jax.Array) -> LoopState:
    """The rows where `kept` [B] hand their pages to their request's keep slot (`kept_slots`):
    its table becomes the row's first `prompt_pages` entries (the prompt's full pages, which
    the slot now holds too, then the row's own), the pages it listed before and the row's past
    them go back, and it is KEPT with the row's resident tokens as its `base`."""
    width, slot = shape.prompt_pages, kept_slots(inp, state)
    length = inp.prompt_lens[row_prompts(inp, state)]
    table = state.rows.tables[:, :width]
    shared = ~private_pages(shape, length)[:, :width] & kept[:, None]
    state = hold_pages(state, table, shared)
    state = release_pages(state, state.prompts.tables[slot], kept[:, None])
    past = (jnp.arange(shape.table_pages)[None, :] >= width) & kept[:, None]
    state = release_pages(state, state.rows.tables, past)
    resident = length + state.requests.lengths[state.rows.request] - 1
    prompts = state.prompts
    return replace(state, prompts=replace(
        prompts,
        tables=set_where(prompts.tables, slot, table, kept),
        status=set_where(prompts.status, slot, KEPT, kept),
        base=set_where(prompts.base, slot, resident, kept)))


def note_usage(state: LoopState) -> LoopState:
    used = state.free.pages.shape[0] - state.free.count
    return replace(state, stats=replace(state.stats, peak_pages=jnp.maximum(
        state.stats.peak_pages, used)))
