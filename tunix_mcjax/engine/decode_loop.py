"""The on-device generation program over a KV page pool: one `lax.while_loop` whose iterations
prefill, admit and decode, the way a paged serving engine schedules (vLLM's, on TPU). This
module ties the phases into the loop; the scheduler (`engine.scheduler`) decides each phase's
work, the model runner (`engine.runner`) carries it out, `engine.block_tables` keeps the pages
and `engine.loop_state` defines what the loop carries.

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
(`runner.ModelRunner.decode_rows`), so time and memory follow the tokens decoded, not the caps
or the slots.
The loop stops when no request is left, or when nothing could move (`stalled`, which the engine
turns into an error; pool sizes rule it out).

Randomness is per request and token: token j of a request uses `fold_in(request_key, j)`
(`engine.keys`), so a request's sample does not depend on its batch, its row, when it was
admitted, or whether it was preempted.

`build_program` is `generate`'s program: start, the loop and the outputs in one call.
`initial_state`, `build_advance` (a slice: at most N more iterations of the same `iteration`)
and `join` are the pieces a session (`engine.session`) runs as separate programs, the state
staying on the device between them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tunix_mcjax.engine import pages as pg
from tunix_mcjax.engine.block_tables import evict_prompts
from tunix_mcjax.engine.loop_state import (
    KEPT,
    DecodeModel,
    Inputs,
    LoopState,
    Outputs,
    ProgramShape,
    Prompts,
    Requests,
    Rows,
    Stats,
    replace,
)
from tunix_mcjax.engine.runner import ModelRunner
from tunix_mcjax.engine.sampling import SamplerSpec
from tunix_mcjax.engine.scatter import add_where
from tunix_mcjax.engine.scheduler import (
    choose_admissions,
    prefill_chunks,
    schedule_decode,
    start_prefills,
)


def initial_state(shape: ProgramShape, inp: Inputs, pool: Any, vocab: int) -> LoopState:
    """Every request waiting, no prompt resident, every page free."""
    n, b, u = shape.num_requests, shape.num_slots, shape.num_prompts
    real = inp.request_prompts >= 0
    left = add_where(jnp.zeros((u,), jnp.int32), inp.request_prompts, 1, real)
    zeros_u, zeros_b, zero = jnp.zeros((u,), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.int32(0)

    def unrouted(*lead: int) -> jax.Array | None:
        return None if shape.routing is None else jnp.full((*lead, *shape.routing), -1, jnp.int32)

    prompts = Prompts(
        tables=jnp.full((u, shape.prompt_pages), -1, jnp.int32), status=zeros_u,
        next_chunk=zeros_u, rows=zeros_u, left=left, readers=zeros_u,
        logits=jnp.zeros((u, vocab), jnp.float32), base=zeros_u,
        routing=unrouted(u, shape.prompt_len))
    rows = Rows(active=jnp.zeros((b,), bool), request=zeros_b, cursor=zeros_b, token=zeros_b,
                tables=jnp.full((b, shape.table_pages), -1, jnp.int32), order=zeros_b,
                admissions=zero)
    requests = Requests(running=jnp.zeros((n,), bool), done=~real,
                        tokens=jnp.zeros((n, shape.max_new), jnp.int32),
                        logprobs=jnp.zeros((n, shape.max_new), jnp.float32),
                        lengths=jnp.zeros((n,), jnp.int32), keep=jnp.zeros((n,), bool),
                        routing=unrouted(n, shape.max_new))
    stats = Stats(iterations=zero, prefill_steps=zero, preemptions=zero, shared_pages=zero,
                  peak_pages=zero, packed_steps=zero, stalled=jnp.bool_(False),
                  prefill_tokens=zero)
    return LoopState(pool=pool, free=pg.full_stack(shape.num_pages),
                     refs=jnp.zeros((shape.num_pages,), jnp.int32), prompts=prompts, rows=rows,
                     requests=requests, stats=stats)


def prefill_phase(runner: ModelRunner, state: LoopState) -> LoopState:
    """Start the prompts the next rows need, then run one step of prefill chunks."""
    state = start_prefills(runner.shape, runner.inp, state)
    return runner.prefill(state, prefill_chunks(runner.shape, runner.inp, state))


def admit_phase(runner: ModelRunner, state: LoopState) -> LoopState:
    """Waiting requests whose prompts are resident take the free rows."""
    return runner.admit(state, choose_admissions(runner.shape, runner.inp, state))


def decode_phase(runner: ModelRunner, state: LoopState) -> LoopState:
    """Pages for the rows that cross into a new one, then one token through every active row."""
    state, scheduled = schedule_decode(runner.shape, runner.inp, state)
    return runner.decode(state, scheduled)


def iteration(runner: ModelRunner, state: LoopState) -> LoopState:
    """Prefill and admit (when a row is free and a request waits), then decode; `stalled`
    when none of them moved anything."""
    before = (state.stats.prefill_steps, state.rows.admissions, jnp.sum(state.requests.lengths))
    room = jnp.any(~state.rows.active) & jnp.any(state.requests.waiting)
    state = jax.lax.cond(room, lambda s: admit_phase(runner, prefill_phase(runner, s)),
                         lambda s: s, state)
    state = jax.lax.cond(jnp.any(state.rows.active), lambda s: decode_phase(runner, s),
                         lambda s: s, state)
    moved = (state.stats.prefill_steps > before[0]) | (state.rows.admissions > before[1]) \
        | jnp.any(state.rows.active) | (jnp.sum(state.requests.lengths) > before[2])
    return replace(state, stats=replace(state.stats, iterations=state.stats.iterations + 1,
                                        stalled=~moved))


def unfinished(state: LoopState) -> jax.Array:
    return ~state.stats.stalled & ~jnp.all(state.requests.done)


def outputs_of(state: LoopState, inp: Inputs) -> Outputs:
    stats, requests = state.stats, state.requests
    routed = {}
    if requests.routing is not None:
        prompt = jnp.maximum(inp.request_prompts, 0)
        routed = dict(prompt_lens=inp.prompt_lens[prompt],
                      prompt_routing=state.prompts.routing[prompt], routing=requests.routing)
    return Outputs(**routed,
        tokens=requests.tokens, logprobs=requests.logprobs, lengths=requests.lengths,
        iterations=stats.iterations, prefill_steps=stats.prefill_steps,
        preemptions=stats.preemptions, shared_pages=stats.shared_pages,
        peak_pages=stats.peak_pages, packed_steps=stats.packed_steps,
        prefill_tokens=stats.prefill_tokens,
        stalled=stats.stalled & ~jnp.all(requests.done))


def whole_groups(done: jax.Array, groups: jax.Array) -> jax.Array:
    """How many groups are whole: `groups` [N] is each request slot's group (-1: none), and a
    group is whole when every slot of it is `done` [N]."""
    n = groups.shape[0]
    segment = jnp.where(groups >= 0, groups, n)
    members = jax.ops.segment_sum(jnp.ones_like(groups), segment, n + 1)[:n]
    finished = jax.ops.segment_sum(done.astype(groups.dtype), segment, n + 1)[:n]
    return jnp.sum((members > 0) & (finished == members))


def run_loop(runner: ModelRunner, state: LoopState, max_iterations: jax.Array | None = None,
             lockstep_axis: str | None = None, groups: jax.Array | None = None) -> LoopState:
    """Iterations until no request is left or nothing could move, at most `max_iterations` (a
    traced int32, so one program serves every slice size; None: no bound). With `groups` [N]
    (each request slot's group, -1: none), also until one more group is whole than at the
    start. With `lockstep_axis`, every shard along that mesh axis iterates until all are
    done."""
    start = None if groups is None else whole_groups(state.requests.done, groups)

    def keep_going(carry: tuple[LoopState, jax.Array]) -> jax.Array:
        state, count = carry
        going = unfinished(state)
        if lockstep_axis is not None:
            going = jax.lax.psum(going.astype(jnp.int32), lockstep_axis) > 0
        if groups is not None:
            going &= whole_groups(state.requests.done, groups) == start
        return going if max_iterations is None else going & (count < max_iterations)

    def body(carry: tuple[LoopState, jax.Array]) -> tuple[LoopState, jax.Array]:
        state, count = carry
        state = jax.lax.cond(unfinished(state), lambda s: iteration(runner, s), lambda s: s, state)
        return state, count + 1

    return jax.lax.while_loop(keep_going, body, (state, jnp.int32(0)))[0]


def build_program(
    model: DecodeModel,
    shape: ProgramShape,
    spec: SamplerSpec,
    masked_id: int | None,
    vocab: int,
    lockstep_axis: str | None = None,
) -> Callable[[Any, Any, Inputs], tuple[Outputs, Any]]:
    """The pure function `(params, pool, inputs) -> (outputs, pool)` for one shape: start,
    every iteration and the outputs in one program (`generate`'s); jit it over the model's
    mesh, donating the pool. `masked_id` is never sampled (None: nothing masked). With
    `lockstep_axis`, every shard along that mesh axis iterates until all are done (the
    single-controller structure: run it under `shard_map`)."""

    def program(params: Any, pool: Any, inp: Inputs) -> tuple[Outputs, Any]:
        runner = ModelRunner(model, shape, spec, masked_id, params, inp)
        state = run_loop(runner, initial_state(shape, inp, pool, vocab),
                         lockstep_axis=lockstep_axis)
        return outputs_of(state, inp), state.pool

    return program


def build_advance(model: DecodeModel, shape: ProgramShape, spec: SamplerSpec,
                  masked_id: int | None) -> Callable[..., tuple[LoopState, Outputs]]:
    """`(params, state, inputs, max_iterations, groups) -> (state, outputs)`: a slice of the
    loop (`engine.session`), at most `max_iterations` more iterations, ending once one more
    of `groups` is whole (`run_loop`; all -1: never); donate the state."""

    def advance(params: Any, state: LoopState, inp: Inputs, max_iterations: jax.Array,
                groups: jax.Array) -> tuple[LoopState, Outputs]:
        runner = ModelRunner(model, shape, spec, masked_id, params, inp)
        state = run_loop(runner, state, max_iterations, groups=groups)
        return state, outputs_of(state, inp)

    return advance


def join(state: LoopState, inp: Inputs, joined: jax.Array, keep: jax.Array) -> LoopState:
    """`state` with the requests where `joined` [N] waiting afresh on their prompts (`inp`'s
    `request_prompts`): a slot that held a finished request starts over. Those where `keep`
    [N] leave their pages to their keep slot when done (`Inputs.request_kept`,
    `block_tables.keep_rows`); a prompt slot still KEPT continues from its pages
    (`scheduler.start_prefills`)."""
    requests, prompt = state.requests, jnp.maximum(inp.request_prompts, 0)
    return replace(state, requests=replace(
        requests, done=requests.done & ~joined, running=requests.running & ~joined,
        lengths=jnp.where(joined, 0, requests.lengths),
        keep=jnp.where(joined, keep, requests.keep)), prompts=replace(
        state.prompts, left=add_where(state.prompts.left, prompt, 1, joined)))


def release(state: LoopState, released: jax.Array) -> LoopState:
    """`state` with the KEPT prompt slots where `released` [U] evicted (their pages free)."""
    return evict_prompts(state, released & (state.prompts.status == KEPT))
