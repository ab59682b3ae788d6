"""The on-device generation program over a KV page pool: one `lax.while_loop` whose iterations
prefill, admit and decode, the way a paged serving engine schedules (vLLM's, on TPU).

One iteration:
1. **prefill**: prompts that the next waiting requests need get their pages, and up to
   `prefill_rows` chunks of `chunk` tokens run through the model (at most
   `max_num_batched_tokens` per iteration). A prompt is prefilled once for all the requests that
   share it: the G generations of a GRPO group point at the same prompt pages.
2. **admit**: waiting requests take free rows, in order (preempted ones first). A row's block
   table starts with its prompt's full pages and a copy of the prompt's partly filled last page;
   token 0 is sampled from the prompt's last logits.
3. **decode**: every active row feeds one token; a row crossing into a new page takes one from
   the free stack. When the stack runs dry, idle prompts are evicted, then the last admitted rows
   are preempted: their pages go back and they wait again. A preempted row is recomputed on
   readmission by feeding its recorded tokens again (nothing is re-sampled), so its sample is the
   one it would have had without the preemption.

Attention reads only pages up to the longest live row (`engine.paged_attention`), and a decode
step runs only the live rows, packed into an eighth of the slots when they fit
(`decode_rows`), so time and memory follow the tokens decoded, not the caps or the slots.
The loop stops when no request is left, or when nothing could move (`stalled`, which the engine
turns into an error; pool sizes rule it out).

Randomness is per request and token: token j of request i uses
`fold_in(fold_in(key, first_request_index + i), j)`, so a request's sample does not depend on
its batch, its row, when it was admitted, or whether it was preempted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from tunix_mcjax.engine import pages as pg
from tunix_mcjax.engine.paged_attention import SharedPrefix
from tunix_mcjax.engine.qwen3_forward import PagedRows
from tunix_mcjax.engine.sampling import SamplerSpec, sample

ABSENT, PREFILLING, RESIDENT = 0, 1, 2  # a prompt's pages


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
    key: jax.Array  # PRNGKey of the replica
    first_request_index: jax.Array  # int32, index of request 0 in the replica's share
    temperature: jax.Array  # float32
    top_p: jax.Array  # float32
    stop_ids: jax.Array  # int32 [K], -1 padded: tokens that end a sequence
    max_new_tokens: jax.Array  # int32


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


@dataclasses.dataclass(frozen=True)
class LoopState:
    pool: Any  # the model's page arrays
    free: pg.FreeStack
    prompt_tables: jax.Array  # int32 [U, prompt_pages]
    prompt_state: jax.Array  # int32 [U]: ABSENT | PREFILLING | RESIDENT
    prompt_next_chunk: jax.Array  # int32 [U]
    prompt_rows: jax.Array  # int32 [U]: active rows on the prompt's pages
    prompt_left: jax.Array  # int32 [U]: its requests not finished
    prompt_readers: jax.Array  # int32 [U]: rows admitted on its pages since its prefill
    prompt_logits: jax.Array  # float32 [U, V]: logits after the prompt's last token
    active: jax.Array  # bool [B]
    row_request: jax.Array  # int32 [B]
    row_cursor: jax.Array  # int32 [B]: index of the row's input token in its completion
    row_token: jax.Array  # int32 [B]: the row's input token
    row_tables: jax.Array  # int32 [B, table_pages]
    row_order: jax.Array  # int32 [B]: admission count when admitted (preemption picks the max)
    admissions: jax.Array  # int32
    running: jax.Array  # bool [N]
    done: jax.Array  # bool [N]
    out_tokens: jax.Array  # int32 [N, max_new]
    out_logprobs: jax.Array  # float32 [N, max_new]
    out_lengths: jax.Array  # int32 [N]
    iterations: jax.Array
    prefill_steps: jax.Array
    preemptions: jax.Array
    shared_pages: jax.Array
    peak_pages: jax.Array
    packed_steps: jax.Array
    stalled: jax.Array


for _cls in (Inputs, Outputs, LoopState):
    jax.tree_util.register_dataclass(_cls)


class DecodeModel(Protocol):
    """What the loop needs from a model: its page pool and one call over rows of tokens."""

    def empty_pool(self, num_pages: int, page_size: int) -> Any:
        """The pool's page arrays, zeroed."""

    def forward(self, params: Any, pool: Any, rows: PagedRows) -> tuple[jax.Array, Any]:
        """`rows` through the model -> (fp32 logits [R, V] at `rows.logit_cols`, the pool with
        the rows' keys/values written)."""

    def copy_page(self, pool: Any, source: jax.Array, target: jax.Array) -> Any:
        """The pool with pages `target` holding pages `source`'s contents, in every layer
        (arrays of page ids; a target past the pool is dropped)."""


def replace(state: LoopState, **changes: Any) -> LoopState:
    return dataclasses.replace(state, **changes)


# ----- requests and pages -------------------------------------------------------------------


def waiting_priority(state: LoopState) -> jax.Array:
    """Per request, lower is admitted sooner: preempted ones in order, then fresh ones in order;
    2N for requests that are not waiting."""
    n = state.done.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    waiting = ~state.done & ~state.running
    return jnp.where(waiting, jnp.where(state.out_lengths > 0, index, n + index), 2 * n)


def release_pages(state: LoopState, pages: jax.Array, release: jax.Array) -> LoopState:
    return replace(state, free=pg.give(state.free, pages, release))


def evict_prompts(state: LoopState, evict: jax.Array) -> LoopState:
    """Give back the pages of the prompts where `evict` [U]; they are prefilled again if needed."""
    state = release_pages(state, state.prompt_tables, evict[:, None])
    return replace(
        state,
        prompt_tables=jnp.where(evict[:, None], -1, state.prompt_tables),
        prompt_state=jnp.where(evict, ABSENT, state.prompt_state),
    )


def private_pages(shape: ProgramShape, prompt_len: jax.Array) -> jax.Array:
    """bool [B, table_pages]: the table entries a row owns (not its prompt's shared pages)."""
    return jnp.arange(shape.table_pages)[None, :] >= (prompt_len // shape.page_size)[:, None]


def vacate_rows(shape: ProgramShape, inp: Inputs, state: LoopState, rows: jax.Array,
                finished: jax.Array) -> LoopState:
    """Rows where `rows` leave the batch (finished, or preempted): their own pages go back, and
    a prompt whose requests all finished gives its pages back too."""
    prompt = jnp.maximum(inp.request_prompts[state.row_request], 0)
    owned = private_pages(shape, inp.prompt_lens[prompt]) & rows[:, None]
    state = release_pages(state, state.row_tables, owned)
    requests = jnp.where(rows, state.row_request, shape.num_requests)  # out of bounds: dropped
    prompt_rows = state.prompt_rows.at[jnp.where(rows, prompt, shape.num_prompts)].add(
        -1, mode="drop")
    left = state.prompt_left.at[jnp.where(rows & finished, prompt, shape.num_prompts)].add(
        -1, mode="drop")
    state = replace(
        state,
        active=state.active & ~rows,
        row_tables=jnp.where(rows[:, None], -1, state.row_tables),
        running=state.running.at[requests].set(False, mode="drop"),
        done=state.done.at[jnp.where(finished, requests, shape.num_requests)].set(
            True, mode="drop"),
        prompt_rows=prompt_rows,
        prompt_left=left,
    )
    return evict_prompts(state, (left == 0) & (state.prompt_state != ABSENT))


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
        idle = (state.prompt_state != ABSENT) & (state.prompt_rows == 0)
        prompt = jnp.argmax(idle)

        def evict(state, need):
            return evict_prompts(state, jnp.arange(shape.num_prompts) == prompt), need

        def preempt(state, need):
            victim = jnp.argmax(jnp.where(state.active, state.row_order, -1))
            rows = jnp.arange(shape.num_slots) == victim
            state = vacate_rows(shape, inp, state, rows, jnp.zeros_like(rows))
            return replace(state, preemptions=state.preemptions + 1), need & ~rows

        return jax.lax.cond(jnp.any(idle), evict, preempt, state, need)

    return jax.lax.while_loop(short, free_one, (state, need))


def note_usage(state: LoopState) -> LoopState:
    used = state.free.pages.shape[0] - state.free.count
    return replace(state, peak_pages=jnp.maximum(state.peak_pages, used))


# ----- the three phases ----------------------------------------------------------------------


def start_prefills(shape: ProgramShape, inp: Inputs, state: LoopState) -> LoopState:
    """Pages for the absent prompts of the requests that would take the free rows next, in that
    order, while the free stack holds each prompt and one page for its first row's copy."""
    order = jnp.argsort(waiting_priority(state))[: shape.num_slots]
    free_rows = shape.num_slots - jnp.sum(state.active)
    waiting = jnp.sum(~state.done & ~state.running)
    candidate = jnp.arange(shape.num_slots) < jnp.minimum(free_rows, waiting)
    prompt = jnp.maximum(inp.request_prompts[order], 0)
    earlier = jnp.tril(prompt[:, None] == prompt[None, :], k=-1) & candidate[None, :]
    first = candidate & ~jnp.any(earlier, axis=1) & (state.prompt_state[prompt] == ABSENT)
    num_pages = (inp.prompt_lens[prompt] + shape.page_size - 1) // shape.page_size
    start = first & (jnp.cumsum(jnp.where(first, num_pages + 1, 0)) <= state.free.count)
    want = start[:, None] & (jnp.arange(shape.prompt_pages)[None, :] < num_pages[:, None])
    taken, free = pg.take(state.free, want)
    target = jnp.where(start, prompt, shape.num_prompts)
    return note_usage(replace(
        state,
        free=free,
        prompt_tables=state.prompt_tables.at[target].set(taken, mode="drop"),
        prompt_state=state.prompt_state.at[target].set(PREFILLING, mode="drop"),
        prompt_next_chunk=state.prompt_next_chunk.at[target].set(0, mode="drop"),
        prompt_readers=state.prompt_readers.at[target].set(0, mode="drop"),
    ))


def prefill_rows(shape: ProgramShape, inp: Inputs, state: LoopState):
    """The next chunks of the prompts being prefilled, in prompt order: (prompt [R], chunk [R],
    valid [R])."""
    chunks = (inp.prompt_lens + shape.chunk - 1) // shape.chunk
    remaining = jnp.where(state.prompt_state == PREFILLING, chunks - state.prompt_next_chunk, 0)
    ends = jnp.cumsum(remaining)
    row = jnp.arange(shape.prefill_rows)
    prompt = jnp.clip(jnp.searchsorted(ends, row, side="right"), 0, shape.num_prompts - 1)
    chunk = state.prompt_next_chunk[prompt] + row - (ends[prompt] - remaining[prompt])
    return prompt, chunk, row < ends[-1]


def prefill_phase(model: DecodeModel, shape: ProgramShape, params: Any, inp: Inputs,
                  state: LoopState) -> LoopState:
    """Start the prompts the next rows need, then run one step of prefill chunks."""
    state = start_prefills(shape, inp, state)
    prompt, chunk, valid = prefill_rows(shape, inp, state)

    def run(state: LoopState) -> LoopState:
        length = inp.prompt_lens[prompt]
        start = chunk * shape.chunk
        positions = start[:, None] + jnp.arange(shape.chunk)[None, :]
        real = valid[:, None] & (positions < length[:, None])
        table = state.prompt_tables[prompt]
        page = jnp.take_along_axis(table, jnp.minimum(positions // shape.page_size,
                                                      shape.prompt_pages - 1), axis=1)
        kv_lens = jnp.where(valid, jnp.minimum(start + shape.chunk, length), 0)
        rows = PagedRows(
            tokens=jnp.take_along_axis(inp.prompts[prompt],
                                       jnp.minimum(positions, shape.prompt_len - 1), axis=1),
            positions=positions,
            write_pages=jnp.where(real, page, shape.num_pages),
            write_offsets=positions % shape.page_size,
            tables=table,
            kv_lens=kv_lens,
            q_lens=jnp.where(valid, kv_lens - start, 0),
            logit_cols=jnp.clip(length - 1 - start, 0, shape.chunk - 1),
        )
        logits, pool = model.forward(params, state.pool, rows)
        last = valid & (start + shape.chunk >= length)
        target = jnp.where(last, prompt, shape.num_prompts)
        next_chunk = state.prompt_next_chunk.at[jnp.where(valid, prompt, shape.num_prompts)].add(
            1, mode="drop")
        chunks = (inp.prompt_lens + shape.chunk - 1) // shape.chunk
        finished = (state.prompt_state == PREFILLING) & (next_chunk >= chunks)
        return replace(
            state,
            pool=pool,
            prompt_logits=state.prompt_logits.at[target].set(logits, mode="drop"),
            prompt_next_chunk=next_chunk,
            prompt_state=jnp.where(finished, RESIDENT, state.prompt_state),
            prefill_steps=state.prefill_steps + 1,
        )

    return jax.lax.cond(jnp.any(valid), run, lambda s: s, state)


def admit_phase(model: DecodeModel, shape: ProgramShape, spec: SamplerSpec,
                masked_id: int | None, inp: Inputs, state: LoopState) -> LoopState:
    """Waiting requests take free rows, all at once and in priority order: the first ones whose
    prompts are resident (up to the first that is not), while free rows last and the free stack
    holds a page for each one's copy of its prompt's partly filled last page."""
    b, column = shape.num_slots, jnp.arange(shape.table_pages)
    priority = waiting_priority(state)
    request = jnp.argsort(priority)[:b].astype(jnp.int32)
    prompt = jnp.maximum(inp.request_prompts[request], 0)
    length = inp.prompt_lens[prompt]
    full, partial = length // shape.page_size, length % shape.page_size != 0
    ready = (priority[request] < 2 * shape.num_requests) \
        & (state.prompt_state[prompt] == RESIDENT)
    ready = (jnp.cumprod(ready) > 0) & (jnp.arange(b) < jnp.sum(~state.active))
    ready &= jnp.cumsum(ready & partial) <= state.free.count

    def admit(state: LoopState) -> LoopState:
        slot = jnp.where(ready, jnp.argsort(state.active, stable=True)[:b], b)  # free rows
        copy, free = pg.take(state.free, ready & partial)
        prompt_pages = state.prompt_tables[prompt]
        shared = jnp.where(column[None] < full[:, None],
                           prompt_pages[:, jnp.minimum(column, shape.prompt_pages - 1)], -1)
        table = jnp.where(column[None] == full[:, None], copy[:, None], shared)
        source = jnp.take_along_axis(prompt_pages, jnp.minimum(full, shape.prompt_pages - 1)
                                     [:, None], axis=1)[:, 0]
        pool = model.copy_page(state.pool, jnp.maximum(source, 0),
                               jnp.where(copy >= 0, copy, shape.num_pages))
        fresh = ready & (state.out_lengths[request] == 0)
        zero = jnp.zeros((b,), jnp.int32)
        tokens, logprobs = draw(spec, masked_id, inp, state.prompt_logits[prompt], request, zero)
        state = record(note_usage(replace(state, pool=pool, free=free)), request, zero, tokens,
                       logprobs, fresh)
        first = state.out_tokens[request, 0]
        # Rows that read a prompt's pages after another row of it did: what sharing saved.
        same = jnp.tril(prompt[:, None] == prompt[None, :], k=-1) & ready[None, :]
        readers = state.prompt_readers[prompt] + jnp.sum(same, axis=1)
        target = jnp.where(ready, prompt, shape.num_prompts)
        state = replace(
            state,
            active=state.active.at[slot].set(True, mode="drop"),
            row_request=state.row_request.at[slot].set(request, mode="drop"),
            row_cursor=state.row_cursor.at[slot].set(0, mode="drop"),
            row_token=state.row_token.at[slot].set(first, mode="drop"),
            row_tables=state.row_tables.at[slot].set(table, mode="drop"),
            row_order=state.row_order.at[slot].set(
                state.admissions + jnp.cumsum(ready) - 1, mode="drop"),
            admissions=state.admissions + jnp.sum(ready),
            running=state.running.at[jnp.where(ready, request, shape.num_requests)].set(
                True, mode="drop"),
            prompt_rows=state.prompt_rows.at[target].add(1, mode="drop"),
            prompt_readers=state.prompt_readers.at[target].add(1, mode="drop"),
            shared_pages=state.shared_pages + jnp.sum(jnp.where(ready & (readers > 0), full, 0)),
        )
        ended = fresh & ends(inp, first, jnp.ones((b,), jnp.int32))
        rows = jnp.zeros((b,), bool).at[jnp.where(ended, slot, b)].set(True, mode="drop")
        return vacate_rows(shape, inp, state, rows, rows)

    return jax.lax.cond(jnp.any(ready), admit, lambda s: s, state)


def decode_phase(model: DecodeModel, shape: ProgramShape, spec: SamplerSpec,
                 masked_id: int | None, params: Any, inp: Inputs, state: LoopState) -> LoopState:
    """One token through every active row; rows that end give their pages back."""
    prompt = jnp.maximum(inp.request_prompts[state.row_request], 0)
    positions = inp.prompt_lens[prompt] + state.row_cursor
    column = positions // shape.page_size
    rows = jnp.arange(shape.num_slots)
    need = state.active & (state.row_tables[rows, column] < 0)
    state, need = make_room(shape, inp, state, need)
    taken, free = pg.take(state.free, need)
    tables = state.row_tables.at[rows, column].set(
        jnp.where(need, taken, state.row_tables[rows, column]))
    state = note_usage(replace(state, free=free, row_tables=tables))
    active = state.active
    paged = PagedRows(
        tokens=state.row_token[:, None],
        positions=positions[:, None],
        write_pages=jnp.where(active, tables[rows, column], shape.num_pages)[:, None],
        write_offsets=(positions % shape.page_size)[:, None],
        tables=tables,
        kv_lens=jnp.where(active, positions + 1, 0),
        q_lens=active.astype(jnp.int32),
        logit_cols=jnp.zeros((shape.num_slots,), jnp.int32),
        prefix=shared_prefix(shape, inp, state, prompt),
    )
    request, index = state.row_request, state.row_cursor + 1
    known = index < state.out_lengths[request]
    tokens, logprobs, pool, packed = decode_rows(model, shape, spec, masked_id, params, inp,
                                                 state.pool, paged, request, index)
    state = record(replace(state, pool=pool, packed_steps=state.packed_steps + packed), request,
                   index, tokens, logprobs, active & ~known)
    next_token = jnp.where(known, state.out_tokens[request, jnp.minimum(index, shape.max_new - 1)],
                           tokens)
    finished = active & ~known & ends(inp, tokens, index + 1)
    state = replace(state, row_cursor=state.row_cursor + active, row_token=next_token)
    return vacate_rows(shape, inp, state, finished, finished)


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


def decode_rows(model: DecodeModel, shape: ProgramShape, spec: SamplerSpec,
                masked_id: int | None, params: Any, inp: Inputs, pool: Any, rows: PagedRows,
                requests: jax.Array, index: jax.Array
                ) -> tuple[jax.Array, jax.Array, Any, jax.Array]:
    """The model and the sampler over the live rows (q_lens > 0) only, packed in row order into
    the fewest of `shape.row_sizes` that hold them, so a step costs what its live rows cost,
    not what the slots would (a long tail of a few long completions runs at a few rows).
    Returns (tokens [B], logprobs [B], pool, 1 if packed below B else 0); the caller reads the
    live rows' only (a packed step gives the others token 0)."""
    num_slots, live = shape.num_slots, rows.q_lens > 0

    def every_slot(pool):  # the rows as they stand: nothing to pick or put back
        logits, pool = model.forward(params, pool, rows)
        tokens, logprobs = draw(spec, masked_id, inp, logits, requests, index)
        return tokens, logprobs, pool, jnp.int32(0)

    def packed(size: int):
        def run(pool):  # the live rows first, in row order: each keeps its own request and key
            pick = jnp.argsort(~live, stable=True)[:size]
            logits, pool = model.forward(params, pool, pick_rows(rows, pick))
            tokens, logprobs = draw(spec, masked_id, inp, logits, requests[pick], index[pick])
            return (jnp.zeros((num_slots,), tokens.dtype).at[pick].set(tokens),
                    jnp.zeros((num_slots,), logprobs.dtype).at[pick].set(logprobs), pool,
                    jnp.int32(1))
        return run

    sizes = shape.row_sizes
    if len(sizes) == 1:
        return every_slot(pool)
    which = jnp.sum(jnp.asarray(sizes[:-1]) < jnp.sum(live))
    return jax.lax.switch(which, [*map(packed, sizes[:-1]), every_slot], pool)


def pick_rows(rows: PagedRows, pick: jax.Array) -> PagedRows:
    """Rows `pick` of `rows`; a shared prefix keeps its prompts' pages and picks its rows'."""
    picked = jax.tree.map(lambda x: x[pick], dataclasses.replace(rows, prefix=None))
    if rows.prefix is None:
        return picked
    prefix = dataclasses.replace(rows.prefix, row_prompt=rows.prefix.row_prompt[pick])
    return dataclasses.replace(picked, prefix=prefix)


def shared_prefix(shape: ProgramShape, inp: Inputs, state: LoopState,
                  row_prompt: jax.Array) -> SharedPrefix | None:
    """The prompts' full pages that decode rows share (attended once per prompt), or None
    when no prompt has two requests or none fills a page."""
    width = shape.prompt_len // shape.page_size
    if shape.group_size == 1 or width == 0:
        return None
    return SharedPrefix(tables=state.prompt_tables[:, :width],
                        pages=inp.prompt_lens // shape.page_size, row_prompt=row_prompt,
                        group=min(shape.group_size, shape.num_slots))


# ----- sampling -------------------------------------------------------------------------------


def draw(spec: SamplerSpec, masked_id: int | None, inp: Inputs, logits: jax.Array,
         requests: jax.Array, token_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token `token_index[b]` of request `requests[b]` from `logits[b]`, with its own key."""

    def key_for(request, index):
        return jax.random.fold_in(jax.random.fold_in(inp.key, inp.first_request_index + request),
                                  index)

    keys = jax.vmap(key_for)(requests, token_index)
    return sample(spec, logits, keys, inp.temperature, inp.top_p, masked_id)


def ends(inp: Inputs, tokens: jax.Array, counts: jax.Array) -> jax.Array:
    """Whether a sequence of `counts` tokens whose last is `tokens` is over."""
    stops = jnp.any(tokens[:, None] == inp.stop_ids[None, :], axis=-1)
    return stops | (counts >= inp.max_new_tokens)


def record(state: LoopState, requests, index, tokens, logprobs, valid) -> LoopState:
    rows = jnp.where(valid, requests, state.out_tokens.shape[0])  # out of bounds: dropped
    return replace(
        state,
        out_tokens=state.out_tokens.at[rows, index].set(tokens, mode="drop"),
        out_logprobs=state.out_logprobs.at[rows, index].set(logprobs, mode="drop"),
        out_lengths=state.out_lengths.at[rows].set(index + 1, mode="drop"),
    )


# ----- the program ----------------------------------------------------------------------------


def initial_state(shape: ProgramShape, inp: Inputs, pool: Any, vocab: int) -> LoopState:
    n, b, u = shape.num_requests, shape.num_slots, shape.num_prompts
    real = inp.request_prompts >= 0
    left = jnp.zeros((u,), jnp.int32).at[jnp.where(real, inp.request_prompts, u)].add(
        1, mode="drop")
    zeros_b = jnp.zeros((b,), jnp.int32)
    zero = jnp.int32(0)
    return LoopState(
        pool=pool,
        free=pg.full_stack(shape.num_pages),
        prompt_tables=jnp.full((u, shape.prompt_pages), -1, jnp.int32),
        prompt_state=jnp.zeros((u,), jnp.int32),
        prompt_next_chunk=jnp.zeros((u,), jnp.int32),
        prompt_rows=jnp.zeros((u,), jnp.int32),
        prompt_left=left,
        prompt_readers=jnp.zeros((u,), jnp.int32),
        prompt_logits=jnp.zeros((u, vocab), jnp.float32),
        active=jnp.zeros((b,), bool),
        row_request=zeros_b,
        row_cursor=zeros_b,
        row_token=zeros_b,
        row_tables=jnp.full((b, shape.table_pages), -1, jnp.int32),
        row_order=zeros_b,
        admissions=zero,
        running=jnp.zeros((n,), bool),
        done=~real,
        out_tokens=jnp.zeros((n, shape.max_new), jnp.int32),
        out_logprobs=jnp.zeros((n, shape.max_new), jnp.float32),
        out_lengths=jnp.zeros((n,), jnp.int32),
        iterations=zero, prefill_steps=zero, preemptions=zero, shared_pages=zero,
        peak_pages=zero, packed_steps=zero, stalled=jnp.bool_(False),
    )


def iteration(model: DecodeModel, shape: ProgramShape, spec: SamplerSpec,
              masked_id: int | None, params: Any, inp: Inputs, state: LoopState) -> LoopState:
    """Prefill and admit (when a row is free and a request waits), then decode; `stalled`
    when none of them moved anything."""
    before = (state.prefill_steps, state.admissions, jnp.sum(state.out_lengths))
    room = jnp.any(~state.active) & jnp.any(~state.done & ~state.running)
    state = jax.lax.cond(room, lambda s: admit_phase(
        model, shape, spec, masked_id, inp, prefill_phase(model, shape, params, inp, s)),
        lambda s: s, state)
    state = jax.lax.cond(
        jnp.any(state.active),
        lambda s: decode_phase(model, shape, spec, masked_id, params, inp, s),
        lambda s: s, state)
    moved = (state.prefill_steps > before[0]) | (state.admissions > before[1]) \
        | jnp.any(state.active) | (jnp.sum(state.out_lengths) > before[2])
    return replace(state, iterations=state.iterations + 1, stalled=~moved)


def unfinished(state: LoopState) -> jax.Array:
    return ~state.stalled & ~jnp.all(state.done)


def build_program(
    model: DecodeModel,
    shape: ProgramShape,
    spec: SamplerSpec,
    masked_id: int | None,
    vocab: int,
    lockstep_axis: str | None = None,
) -> Callable[[Any, Any, Inputs], tuple[Outputs, Any]]:
    """The pure function `(params, pool, inputs) -> (outputs, pool)` for one shape; jit it over
    the model's mesh, donating the pool. `masked_id` is never sampled (None: nothing masked).
    With `lockstep_axis`, every shard along that mesh axis iterates until all are done (the
    single-controller structure: run it under `shard_map`)."""

    def keep_going(state: LoopState) -> jax.Array:
        going = unfinished(state)
        if lockstep_axis is None:
            return going
        return jax.lax.psum(going.astype(jnp.int32), lockstep_axis) > 0

    def program(params: Any, pool: Any, inp: Inputs) -> tuple[Outputs, Any]:
        state = initial_state(shape, inp, pool, vocab)
        state = jax.lax.while_loop(
            keep_going,
            lambda s: jax.lax.cond(unfinished(s),
                                   lambda s: iteration(model, shape, spec, masked_id, params,
                                                       inp, s),
                                   lambda s: s, s),
            state)
        outputs = Outputs(
            tokens=state.out_tokens, logprobs=state.out_logprobs, lengths=state.out_lengths,
            iterations=state.iterations, prefill_steps=state.prefill_steps,
            preemptions=state.preemptions, shared_pages=state.shared_pages,
            peak_pages=state.peak_pages, packed_steps=state.packed_steps,
            stalled=state.stalled & ~jnp.all(state.done))
        return outputs, state.pool

    return program
