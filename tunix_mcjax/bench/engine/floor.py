"""The floors an engine iteration is measured against: our bare step, and the HBM floor.

`floor_arm` times our jitted paged decode step alone (batch x 1 token over the page pool, pool
donated) in a tight loop, and our prefill alone (one chunk of every distinct prompt, as the
engine prefills them). `hbm_floor` is the least time an iteration takes if it only streams what
it must read from device memory (`HBM_FLOOR_FORMULA`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunix_mcjax.bench.engine.arms import Measure, resolve_layout, timed
from tunix_mcjax.bench.engine.workload import EngineProfile, model_of
from tunix_mcjax.engine import paged_attention, pages
from tunix_mcjax.engine import qwen3_forward as fwd
from tunix_mcjax.engine.buckets import pow2_at_least
from tunix_mcjax.engine.trees import flatten_tree, unflatten_tree


def paged_rows(tokens, positions, tables, prefix=None) -> fwd.PagedRows:
    """Rows of `tokens` at `positions`, their keys and values written on `tables`' pages."""
    n, c = tokens.shape
    page = pages.DEFAULT_PAGE_SIZE
    return fwd.PagedRows(
        tokens=tokens, positions=positions,
        write_pages=jnp.take_along_axis(tables, positions // page, axis=1),
        write_offsets=positions % page, tables=tables,
        kv_lens=positions[:, -1] + 1, q_lens=jnp.full((n,), c, jnp.int32),
        logit_cols=jnp.full((n,), c - 1, jnp.int32), prefix=prefix)


def floor_rows(profile: EngineProfile, batch: int, steps: int
               ) -> tuple[list[fwd.PagedRows], fwd.PagedRows, int]:
    """`steps` decode calls of `batch` rows at the prompt bucket, each group of `generations`
    rows on its prompt's pages (then its own) as in the engine; one prefill chunk of each
    distinct prompt, on pages after theirs; and how many pages they use in all."""
    prompt_bucket = pow2_at_least(profile.prompt_lengths[1])
    page = pages.DEFAULT_PAGE_SIZE
    table = pages.cdiv(prompt_bucket + steps, page)
    groups, width = pages.cdiv(batch, profile.generations), prompt_bucket // page
    prompt_tables = jnp.arange(groups * width, dtype=jnp.int32).reshape(groups, width)
    row_prompt = jnp.arange(batch, dtype=jnp.int32) // profile.generations
    own = groups * width + jnp.arange(batch * (table - width), dtype=jnp.int32)
    tables = jnp.concatenate([prompt_tables[row_prompt], own.reshape(batch, -1)], axis=1)
    prefix = paged_attention.SharedPrefix(prompt_tables, jnp.full((groups,), width, jnp.int32),
                                          row_prompt, group=profile.generations)
    decode_rows = [paged_rows(jnp.full((batch, 1), 5, jnp.int32),
                              jnp.full((batch, 1), prompt_bucket + i, jnp.int32), tables,
                              prefix if profile.generations > 1 and width else None)
                   for i in range(steps)]
    n = profile.prompts  # the engine prefills each distinct prompt once
    prefill_tables = batch * table + jnp.arange(n * table, dtype=jnp.int32).reshape(n, table)
    prefill = paged_rows(jnp.full((n, prompt_bucket), 5, jnp.int32),
                         jnp.broadcast_to(jnp.arange(prompt_bucket, dtype=jnp.int32),
                                          (n, prompt_bucket)), prefill_tables)
    return decode_rows, prefill, (batch + profile.prompts) * table


def floor_arm(profile, params, batch: int, steps: int = 32,
              layout: Any = None) -> tuple[Measure, dict]:
    """Our paged decode step alone (`floor_rows`, pool donated) in a tight loop, and our
    prefill alone, jitted, on `layout` (None: the one the engine picks on this platform)."""
    layout, mc, device = resolve_layout(layout), model_of(profile), jax.devices()[0]
    decode_rows, prefill, num_pages = floor_rows(profile, batch, steps)
    params = jax.device_put(fwd.stack_layers(unflatten_tree(flatten_tree(params)),
                                             mc.num_layers), device)
    pool = jax.device_put(layout.empty(num_pages, pages.DEFAULT_PAGE_SIZE, mc.num_kv_heads,
                                       mc.head_dim, mc.dtype, layers=mc.num_layers), device)
    step = jax.jit(lambda p, pool, r: fwd.paged_forward(mc, p, pool, r, layout),
                   donate_argnums=1)
    state = {"pool": pool}

    def run(calls) -> None:
        pool = state["pool"]
        for r in calls:
            logits, pool = step(params, pool, r)
        state["pool"] = pool
        logits.block_until_ready()

    run(decode_rows[:1])  # compile
    run([prefill])

    def measure(rep: int) -> dict[str, float]:
        return {
            "step_ms": timed(lambda: run(decode_rows))[0] / steps * 1e3,
            "prefill_ms": timed(lambda: run([prefill]))[0] * 1e3,
        }

    return measure, {"batch": batch, "layout": type(layout).__name__}


HBM_BANDWIDTH = 4.8e12  # bytes/s: an H200's HBM3e, by its datasheet (`--hbm-bandwidth`)
HBM_FLOOR_FORMULA = (
    "floor_iteration_ms = (W + KV / I) / bandwidth * 1e3: W = weight bytes (every weight read "
    "once a step, the tied output head the whole embedding), KV = sum over requests r and "
    "their tokens j >= 1 of (prompt_len_r + j) x kv_bytes_per_token (the step that samples "
    "token j reads its prompt's and j tokens' keys and values; token 0 comes from prefill), "
    "I = the arm's decode iterations; kv_bytes_per_token = 2 x layers x kv_heads x head_dim "
    "x dtype bytes; mean_live_length = KV / kv_bytes_per_token / decode steps")


def hbm_floor(profile: EngineProfile, params, prompts: Sequence[Sequence[int]],
              lengths: Sequence[int], iterations: float, bandwidth: float) -> dict[str, float]:
    """The least time a decode iteration takes if it streams only what it must read from
    device memory (HBM_FLOOR_FORMULA), for requests `prompts` whose completions have `lengths`
    tokens, decoded in `iterations` iterations."""
    mc = model_of(profile)
    weight_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                       for x in jax.tree.leaves(params))
    kv_token_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * np.dtype(
        mc.dtype).itemsize
    steps = sum(max(n - 1, 0) for n in lengths)
    kv_tokens = sum(max(n - 1, 0) * len(p) + n * max(n - 1, 0) / 2
                    for p, n in zip(prompts, lengths, strict=True))
    floor_s = (weight_bytes + kv_tokens * kv_token_bytes / iterations) / bandwidth
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_token_bytes,
            "kv_bytes_read": kv_tokens * kv_token_bytes, "decode_steps": steps,
            "mean_live_length": kv_tokens / max(steps, 1), "iterations": iterations,
            "floor_iteration_ms": floor_s * 1e3}
