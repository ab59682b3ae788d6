"""The loop's model runner: it carries out the scheduler's decisions (`engine.scheduler`) on
the model and the sampler. It runs prefill chunks, seats admitted requests on their rows
(token 0 from the prompt's last logits) and decodes the live rows, packed into fewer rows
when they fit. It samples each token with its request's key, checks for the end of a sequence
and records every token and its logprob.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tunix_mcjax.engine.block_tables import admission_tables, note_usage, vacate_rows
from tunix_mcjax.engine.loop_state import (
    PREFILLING,
    RESIDENT,
    DecodeModel,
    Inputs,
    LoopState,
    ProgramShape,
    Prompts,
    replace,
)
from tunix_mcjax.engine.paged_attention import SharedPrefix
from tunix_mcjax.engine.qwen3_forward import PagedRows
from tunix_mcjax.engine.sampling import SamplerSpec, sample
from tunix_mcjax.engine.scatter import add_where, set_where
from tunix_mcjax.engine.scheduler import Admission, DecodeRows, PrefillChunks


@dataclasses.dataclass(frozen=True)
class ModelRunner:
    """What every phase of one program call reads and never changes: the model and its params,
    the shape, the sampler (`masked_id` is never sampled; None: nothing masked), the inputs."""

    model: DecodeModel
    shape: ProgramShape
    spec: SamplerSpec
    masked_id: int | None
    params: Any
    inp: Inputs

    def prefill(self, state: LoopState, chunks: PrefillChunks) -> LoopState:
        """One step of prefill `chunks` (when any is valid); a prompt whose last chunk ran
        keeps its last logits and is resident."""
        shape, inp = self.shape, self.inp

        def run(state: LoopState) -> LoopState:
            batch = prefill_batch(shape, inp, state, chunks)
            logits, pool, routing = self.forward(state.pool, batch)
            prompt, valid = chunks.prompt, chunks.valid
            length, start = inp.prompt_lens[prompt], chunk_starts(shape, state, chunks)
            prompts = record_prompt_routing(state.prompts, chunks, start, length, routing)
            next_chunk = add_where(prompts.next_chunk, prompt, 1, valid)
            num_chunks = (inp.prompt_lens - prompts.base + shape.chunk - 1) // shape.chunk
            finished = (prompts.status == PREFILLING) & (next_chunk >= num_chunks)
            prompts = replace(
                prompts,
                logits=set_where(prompts.logits, prompt, logits,
                                 valid & (start + shape.chunk >= length)),
                next_chunk=next_chunk,
                status=jnp.where(finished, RESIDENT, prompts.status),
            )
            stats = replace(state.stats, prefill_steps=state.stats.prefill_steps + 1,
                            prefill_tokens=state.stats.prefill_tokens + jnp.sum(batch.q_lens))
            return replace(state, pool=pool, prompts=prompts, stats=stats)

        return jax.lax.cond(jnp.any(chunks.valid), run, lambda s: s, state)

    def admit(self, state: LoopState, admission: Admission) -> LoopState:
        """The admitted requests take their rows (when any is admitted): each row's table holds
        its prompt's full pages and a copy of its partly filled last one; a fresh request
        samples token 0 from its prompt's logits, and may end there."""
        return jax.lax.cond(jnp.any(admission.ready),
                            lambda s: self._admit(s, admission), lambda s: s, state)

    def _admit(self, state: LoopState, adm: Admission) -> LoopState:
        shape, inp = self.shape, self.inp
        b = shape.num_slots
        table, copy, source, state = admission_tables(shape, state, adm.prompt, adm.full,
                                                      adm.ready & adm.partial)
        pool = self.model.copy_page(state.pool, jnp.maximum(source, 0),
                                    jnp.where(copy >= 0, copy, shape.num_pages))
        fresh = adm.ready & (state.requests.lengths[adm.request] == 0)
        zero = jnp.zeros((b,), jnp.int32)
        tokens, logprobs = self.draw(state.prompts.logits[adm.prompt], adm.request, zero)
        state = record(note_usage(replace(state, pool=pool)), adm.request, zero,
                       tokens, logprobs, fresh)
        first = state.requests.tokens[adm.request, 0]
        state = seat_rows(shape, state, adm, table, first)
        ended = fresh & ends(inp, first, jnp.ones((b,), jnp.int32))
        rows = set_where(jnp.zeros((b,), bool), adm.row, True, ended)
        return vacate_rows(shape, inp, state, rows, rows)

    def decode(self, state: LoopState, scheduled: DecodeRows) -> LoopState:
        """One token through every active row (its pages in place: `schedule_decode`); a row
        recomputing a preempted completion feeds its recorded tokens; rows that end leave."""
        shape, inp, rows = self.shape, self.inp, state.rows
        paged = decode_batch(shape, inp, state, scheduled)
        request, index = rows.request, rows.cursor + 1
        known = index < state.requests.lengths[request]
        tokens, logprobs, pool, packed, routing = self.decode_rows(state.pool, paged, request,
                                                                   index)
        stats = replace(state.stats, packed_steps=state.stats.packed_steps + packed)
        state = record(replace(state, pool=pool, stats=stats), request, index, tokens, logprobs,
                       rows.active & ~known)
        if routing is not None:  # the experts of each row's input token, completion token
            requests = state.requests  # `cursor` (a recomputed one's again)
            state = replace(state, requests=replace(requests, routing=set_where(
                requests.routing, request, routing[:, 0], rows.active, column=rows.cursor)))
        next_token = jnp.where(
            known, state.requests.tokens[request, jnp.minimum(index, shape.max_new - 1)], tokens)
        finished = rows.active & ~known & ends(inp, tokens, index + 1)
        state = replace(state, rows=replace(rows, cursor=rows.cursor + rows.active,
                                            token=next_token))
        return vacate_rows(shape, inp, state, finished, finished)

    def decode_rows(self, pool: Any, rows: PagedRows, requests: jax.Array, index: jax.Array
                    ) -> tuple[jax.Array, jax.Array, Any, jax.Array, jax.Array | None]:
        """The model and the sampler over the live rows (q_lens > 0) only, packed in row order
        into the fewest of `shape.row_sizes` that hold them, so a step costs what its live rows
        cost, not what the slots would (a long tail of a few long completions runs at a few
        rows). Returns (tokens [B], logprobs [B], pool, 1 if packed below B else 0, routing
        [B, 1, layers, k] or None); the caller reads the live rows' only (a packed step gives
        the others token 0)."""
        num_slots, live = self.shape.num_slots, rows.q_lens > 0

        def every_slot(pool):  # the rows as they stand: nothing to pick or put back
            logits, pool, routing = self.forward(pool, rows)
            tokens, logprobs = self.draw(logits, requests, index)
            return tokens, logprobs, pool, jnp.int32(0), routing

        def packed(size: int):
            def run(pool):  # the live rows first, in row order: each keeps its request and key
                pick = jnp.argsort(~live, stable=True)[:size]
                logits, pool, routing = self.forward(pool, pick_rows(rows, pick))
                tokens, logprobs = self.draw(logits, requests[pick], index[pick])
                if routing is not None:
                    routing = jnp.full((num_slots, *routing.shape[1:]), -1,
                                       routing.dtype).at[pick].set(routing)
                return (jnp.zeros((num_slots,), tokens.dtype).at[pick].set(tokens),
                        jnp.zeros((num_slots,), logprobs.dtype).at[pick].set(logprobs), pool,
                        jnp.int32(1), routing)
            return run

        sizes = self.shape.row_sizes
        if len(sizes) == 1:
            return every_slot(pool)
        which = jnp.sum(jnp.asarray(sizes[:-1]) < jnp.sum(live))
        return jax.lax.switch(which, [*map(packed, sizes[:-1]), every_slot], pool)

    def forward(self, pool: Any, rows: PagedRows) -> tuple[jax.Array, Any, jax.Array | None]:
        """The model on `rows`: (logits, pool, routing [R, C, layers, k] or None)."""
        out = self.model.forward(self.params, pool, rows)
        return out if self.shape.routing is not None else (*out, None)

    def draw(self, logits: jax.Array, requests: jax.Array,
             token_index: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Token `token_index[b]` of request `requests[b]` from `logits[b]`, with its own key:
        `fold_in(request_keys[request], token_index)` (`engine.keys`)."""
        inp = self.inp
        keys = jax.vmap(jax.random.fold_in)(inp.request_keys[requests], token_index)
        return sample(self.spec, logits, keys, inp.temperature, inp.top_p, self.masked_id)


def record_prompt_routing(prompts: Prompts, chunks: PrefillChunks, start: jax.Array,
                          length: jax.Array, routing: jax.Array | None) -> Prompts:
    """`prompts` with the experts of each valid chunk's real tokens recorded (no routing:
    unchanged)."""
    if routing is None:
        return prompts
    positions = start[:, None] + jnp.arange(routing.shape[1])[None, :]
    real = chunks.valid[:, None] & (positions < length[:, None])
    index = jnp.broadcast_to(chunks.prompt[:, None], positions.shape)
    return replace(prompts, routing=set_where(prompts.routing, index, routing, real,
                                              column=positions))


def prefill_batch(shape: ProgramShape, inp: Inputs, state: LoopState,
                  chunks: PrefillChunks) -> PagedRows:
    """The model call of one prefill step: a row per chunk, writing into its prompt's pages."""
    prompt, valid = chunks.prompt, chunks.valid
    length = inp.prompt_lens[prompt]
    start = chunk_starts(shape, state, chunks)
    positions = start[:, None] + jnp.arange(shape.chunk)[None, :]
    real = valid[:, None] & (positions < length[:, None])
    table = state.prompts.tables[prompt]
    page = jnp.take_along_axis(table, jnp.minimum(positions // shape.page_size,
                                                  shape.prompt_pages - 1), axis=1)
    kv_lens = jnp.where(valid, jnp.minimum(start + shape.chunk, length), 0)
    return PagedRows(
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


def chunk_starts(shape: ProgramShape, state: LoopState, chunks: PrefillChunks) -> jax.Array:
    """int32 [prefill_rows]: each chunk's first position (after its prompt's `base`)."""
    return state.prompts.base[chunks.prompt] + chunks.chunk * shape.chunk


def decode_batch(shape: ProgramShape, inp: Inputs, state: LoopState,
                 scheduled: DecodeRows) -> PagedRows:
    """The model call of one decode step: every row's input token (inactive rows write
    nothing and attend to nothing)."""
    rows, active = state.rows, state.rows.active
    return PagedRows(
        tokens=rows.token[:, None],
        positions=scheduled.position[:, None],
        write_pages=jnp.where(active, rows.tables[jnp.arange(shape.num_slots), scheduled.column],
                              shape.num_pages)[:, None],
        write_offsets=(scheduled.position % shape.page_size)[:, None],
        tables=rows.tables,
        kv_lens=jnp.where(active, scheduled.position + 1, 0),
        q_lens=active.astype(jnp.int32),
        logit_cols=jnp.zeros((shape.num_slots,), jnp.int32),
        prefix=shared_prefix(shape, inp, state, scheduled.prompt),
    )


def seat_rows(shape: ProgramShape, state: LoopState, adm: Admission, table: jax.Array,
              first: jax.Array) -> LoopState:
    """The admitted requests on their rows, with `table` and input token `first`; counts the
    prompt pages a row reads after another row of its prompt did (what sharing saved)."""
    ready, row, rows, prompts = adm.ready, adm.row, state.rows, state.prompts
    same = jnp.tril(adm.prompt[:, None] == adm.prompt[None, :], k=-1) & ready[None, :]
    readers = prompts.readers[adm.prompt] + jnp.sum(same, axis=1)
    shared = state.stats.shared_pages + jnp.sum(jnp.where(ready & (readers > 0), adm.full, 0))
    return replace(
        state,
        rows=replace(
            rows,
            active=set_where(rows.active, row, True, ready),
            request=set_where(rows.request, row, adm.request, ready),
            cursor=set_where(rows.cursor, row, 0, ready),
            token=set_where(rows.token, row, first, ready),
            tables=set_where(rows.tables, row, table, ready),
            order=set_where(rows.order, row, rows.admissions + jnp.cumsum(ready) - 1, ready),
            admissions=rows.admissions + jnp.sum(ready),
        ),
        requests=replace(state.requests,
                         running=set_where(state.requests.running, adm.request, True, ready)),
        prompts=replace(prompts, rows=add_where(prompts.rows, adm.prompt, 1, ready),
                        readers=add_where(prompts.readers, adm.prompt, 1, ready)),
        stats=replace(state.stats, shared_pages=shared),
    )


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
    return SharedPrefix(tables=state.prompts.tables[:, :width],
                        pages=inp.prompt_lens // shape.page_size, row_prompt=row_prompt,
                        group=min(shape.group_size, shape.num_slots))


def ends(inp: Inputs, tokens: jax.Array, counts: jax.Array) -> jax.Array:
    """Whether a sequence of `counts` tokens whose last is `tokens` is over."""
    stops = jnp.any(tokens[:, None] == inp.stop_ids[None, :], axis=-1)
    return stops | (counts >= inp.max_new_tokens)


def record(state: LoopState, requests: jax.Array, index: jax.Array, tokens: jax.Array,
           logprobs: jax.Array, valid: jax.Array) -> LoopState:
    """Token `index[b]` of request `requests[b]` and its logprob, where `valid[b]`."""
    out = state.requests
    return replace(state, requests=replace(
        out,
        tokens=set_where(out.tokens, requests, tokens, valid, column=index),
        logprobs=set_where(out.logprobs, requests, logprobs, valid, column=index),
        lengths=set_where(out.lengths, requests, index + 1, valid),
    ))
