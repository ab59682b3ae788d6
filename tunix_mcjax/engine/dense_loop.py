"""The dense generation program MaxText's model still decodes with: batched prefill, then a
`lax.while_loop` of decode steps over one KV row per slot, sized to the caps. The jax engine
runs the paged loop (`engine.decode_loop`); MaxText's families move there with their paged
attention, and this module goes.

Each distinct prompt is prefilled once (GRPO sends every prompt `num_generations` times); its
keys/values and last-position logits form a prompt store that rows copy from. The batch has
`num_slots` rows. With `num_requests > num_slots` (continuous batching) a row whose sequence
ends takes the next waiting request in the same loop iteration by copying that request's
prompt from the store, so the whole share decodes as one batch without waves. The loop stops
as soon as no row is active and no request waits.

The model is a `DecodeModel`: MaxText's own model in its KV-cache decode modes
(`engine.maxtext_model`).

Randomness is per request and token: token j of request i uses
`fold_in(fold_in(key, first_request_index + i), j)`, so a request's sample does not depend on
its batch, its row or when it was admitted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from tunix_mcjax.engine.sampling import SamplerSpec, sample


@dataclasses.dataclass(frozen=True)
class ProgramShape:
    """Static shapes of one compiled program (all powers of two or engine caps)."""

    num_requests: int
    num_slots: int
    num_prompts: int  # distinct prompts
    prompt_len: int
    max_new: int

    @property
    def cache_len(self) -> int:
        return self.prompt_len + self.max_new


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Per-call device inputs of the program (everything dynamic)."""

    prompts: jax.Array  # int32 [num_prompts, prompt_len], distinct prompts, right-padded
    prompt_lens: jax.Array  # int32 [num_prompts]; 0 for padding
    request_prompts: jax.Array  # int32 [N]: each request's prompt; -1 pads (only at the end)
    key: jax.Array  # PRNGKey of the replica
    first_request_index: jax.Array  # int32, index of request 0 in the replica's share
    temperature: jax.Array  # float32
    top_p: jax.Array  # float32
    stop_ids: jax.Array  # int32 [K], -1 padded: tokens that end a sequence
    max_new_tokens: jax.Array  # int32


jax.tree_util.register_dataclass(Inputs)


@dataclasses.dataclass(frozen=True)
class Outputs:
    tokens: jax.Array  # int32 [N, max_new]
    logprobs: jax.Array  # float32 [N, max_new]
    lengths: jax.Array  # int32 [N]
    iterations: jax.Array  # int32: decode iterations the loop ran


jax.tree_util.register_dataclass(Outputs)


class DecodeModel(Protocol):
    """What the loop needs from a model: batched prefill into a prompt store, rows of a decode
    cache copied from that store, and one decode step. Caches are pytrees of arrays."""

    def prefill(self, params: Any, prompts: jax.Array, lengths: jax.Array) -> tuple[jax.Array, Any]:
        """Right-padded prompts [U, T], lengths [U] -> (fp32 logits at lengths-1 [U, V], store)."""

    def rows(self, store: Any, prompt_ids: jax.Array) -> Any:
        """A decode cache whose row b holds prompt `prompt_ids[b]` of the store."""

    def admit(self, cache: Any, store: Any, slot: jax.Array, prompt: jax.Array) -> Any:
        """`cache` with row `slot` replaced by prompt `prompt` of the store."""

    def decode_step(self, params: Any, cache: Any, tokens: jax.Array,
                    positions: jax.Array) -> tuple[jax.Array, Any]:
        """One token per row at its position -> (fp32 logits [B, V], updated cache)."""


def build_program(
    model: DecodeModel,
    shape: ProgramShape,
    spec: SamplerSpec,
    masked_id: int | None,
) -> Callable[[Any, Inputs], Outputs]:
    """The pure function `(params, inputs) -> outputs` for one shape; jit it over the model's
    mesh. `masked_id` is never sampled (pad, unless pad is a stop id; None: nothing masked)."""
    n, b = shape.num_requests, shape.num_slots
    continuous = n > b

    def key_for(inp: Inputs, request: jax.Array, token_index: jax.Array) -> jax.Array:
        request_key = jax.random.fold_in(inp.key, inp.first_request_index + request)
        return jax.random.fold_in(request_key, token_index)

    def draw(logits, inp, requests, counts):
        keys = jax.vmap(key_for, in_axes=(None, 0, 0))(inp, requests, counts)
        return sample(spec, logits, keys, inp.temperature, inp.top_p, masked_id)

    def ends(inp: Inputs, tokens: jax.Array, counts: jax.Array) -> jax.Array:
        stops = jnp.any(tokens[:, None] == inp.stop_ids[None, :], axis=-1)
        return stops | (counts >= inp.max_new_tokens)

    def record(state, requests, counts, tokens, logprobs, valid):
        rows = jnp.where(valid, requests, n)  # out of bounds: dropped
        state["out_tokens"] = state["out_tokens"].at[rows, counts].set(tokens, mode="drop")
        state["out_logprobs"] = state["out_logprobs"].at[rows, counts].set(logprobs, mode="drop")
        state["out_lengths"] = state["out_lengths"].at[rows].set(counts + 1, mode="drop")
        return state

    def initial_state(inp: Inputs, store) -> dict[str, Any]:
        store_logits, store_kv = store
        requests = jnp.arange(b, dtype=jnp.int32)
        real = inp.request_prompts[:b] >= 0
        prompt = jnp.maximum(inp.request_prompts[:b], 0)
        cache = model.rows(store_kv, prompt)
        zeros = jnp.zeros((b,), jnp.int32)
        tokens, logprobs = draw(store_logits[prompt], inp, requests, zeros)
        state = {
            "cache": cache,
            "requests": requests,
            "counts": zeros + 1,
            "tokens": tokens,
            "positions": inp.prompt_lens[prompt],
            "active": real & ~ends(inp, tokens, zeros + 1),
            "next_request": jnp.int32(b),
            "iterations": jnp.int32(0),
            "out_tokens": jnp.zeros((n, shape.max_new), jnp.int32),
            "out_logprobs": jnp.zeros((n, shape.max_new), jnp.float32),
            "out_lengths": jnp.zeros((n,), jnp.int32),
        }
        return record(state, requests, zeros, tokens, logprobs, real)

    def admit_one(inp: Inputs, store, state):
        """Copy the next waiting request's prompt into the first free row; sample token 0."""
        store_logits, store_kv = store
        slot = jnp.argmin(state["active"])
        request = state["next_request"]
        prompt = inp.request_prompts[request]
        state["cache"] = model.admit(state["cache"], store_kv, slot, prompt)
        zero = jnp.zeros((1,), jnp.int32)
        logits = jax.lax.dynamic_slice_in_dim(store_logits, prompt, 1)
        token, logprob = draw(logits, inp, request[None], zero)
        state = record(state, request[None], zero, token, logprob, jnp.ones((1,), bool))
        state["requests"] = state["requests"].at[slot].set(request)
        state["counts"] = state["counts"].at[slot].set(1)
        state["tokens"] = state["tokens"].at[slot].set(token[0])
        state["positions"] = state["positions"].at[slot].set(inp.prompt_lens[prompt])
        state["active"] = state["active"].at[slot].set(~ends(inp, token, zero + 1)[0])
        state["next_request"] = request + 1
        return state

    def admit_waiting(inp: Inputs, store, state):
        num_real = jnp.sum(inp.request_prompts >= 0)

        def has_room(s):
            return jnp.any(~s["active"]) & (s["next_request"] < num_real)

        return jax.lax.while_loop(has_room, lambda s: admit_one(inp, store, s), state)

    def decode_iteration(params, inp: Inputs, store, state):
        logits, state["cache"] = model.decode_step(
            params, state["cache"], state["tokens"], state["positions"]
        )
        active, counts = state["active"], state["counts"]
        tokens, logprobs = draw(logits, inp, state["requests"], counts)
        state = record(state, state["requests"], counts, tokens, logprobs, active)
        counts = counts + active
        state["counts"] = counts
        state["tokens"] = tokens
        state["positions"] = state["positions"] + 1
        state["active"] = active & ~ends(inp, tokens, counts)
        state["iterations"] = state["iterations"] + 1
        if continuous:
            state = admit_waiting(inp, store, state)
        return state

    def program(params, inp: Inputs) -> Outputs:
        # The prompt store: last logits [U, V] and the model's cache of the prompts.
        store = model.prefill(params, inp.prompts, jnp.maximum(inp.prompt_lens, 1))
        state = initial_state(inp, store)
        if continuous:
            state = admit_waiting(inp, store, state)
        state = jax.lax.while_loop(
            lambda s: jnp.any(s["active"]),
            lambda s: decode_iteration(params, inp, store, s),
            state,
        )
        return Outputs(
            tokens=state["out_tokens"],
            logprobs=state["out_logprobs"],
            lengths=state["out_lengths"],
            iterations=state["iterations"],
        )

    return program
