"""Causal attention over packed rows, blockwise over keys, with no [B, T, T] mask.

Packed rows hold several sequences kept apart by segment ids (0 marks padding). Query t attends
to key s when both are in the same non-padding segment and s <= t. `segment_attention` builds
that mask per key block from the segment ids, keeps an online softmax across blocks (as flash
attention does) and has its own backward, which recomputes each block's probabilities from the
saved softmax statistics: memory is O(B * T * block) per step, not O(B * T * T). Rows that fit
in one block are that one block: the dense formula on its [B, T, T] mask.

Masked scores take Tunix's `K_MASK`, as its dense path does, so every output equals
`jnp.where(mask, scores, K_MASK)` then softmax, padding rows included (they average all keys).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from tunix.models.qwen3.model import K_MASK

KEY_BLOCK = 512  # keys per block: scores of one step are [B, heads, T, KEY_BLOCK]


def _blocks(q, k, v, segment_ids, block):
    """Queries grouped by kv head, and keys/values/segments/positions stacked per key block."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    num_blocks = -(-t // block)
    pad = num_blocks * block - t
    if pad:
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    key_seg = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)  # never matches

    def stack(x):  # [B, S, ...] -> [num_blocks, B, block, ...]
        return jnp.moveaxis(x.reshape(b, num_blocks, block, *x.shape[2:]), 1, 0)

    key_pos = jnp.arange(num_blocks * block).reshape(num_blocks, block)
    return q, (stack(k), stack(v), stack(key_seg), key_pos)


def _scores(q, k_blk, seg_blk, pos_blk, segment_ids, scale):
    """fp32 scores [B, K, G, T, block] of one key block, masked, and the mask [B, T, block]."""
    t = q.shape[1]
    s = jnp.einsum("BTKGH,BSKH->BKGTS", q, k_blk) * scale
    q_seg = segment_ids[:, :, None]
    mask = (q_seg == seg_blk[:, None, :]) & (q_seg > 0)
    mask &= jnp.arange(t)[None, :, None] >= pos_blk[None, None, :]
    # Keys past T (block padding) drop out of the softmax entirely, even for padding rows.
    fill = jnp.where(seg_blk >= 0, K_MASK, -jnp.inf)[:, None, None, None, :]
    return jnp.where(mask[:, None, None], s.astype(jnp.float32), fill), mask


def _forward(q, k, v, segment_ids, block):
    b, t, n, h = q.shape
    scale = h**-0.5
    qg, blocks = _blocks(q, k, v, segment_ids, block)
    stats = qg.shape[:1] + qg.shape[2:4] + (t,)  # [B, K, G, T]

    def step(carry, blk):
        m, denom, o = carry
        k_blk, v_blk, seg_blk, pos_blk = blk
        s, _ = _scores(qg, k_blk, seg_blk, pos_blk, segment_ids, scale)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("BKGTS,BSKH->BKGTH", p.astype(v.dtype), v_blk).astype(jnp.float32)
        return (m_new, denom * corr + p.sum(-1), o * corr[..., None] + pv), None

    init = (jnp.full(stats, K_MASK, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros((*stats, h), jnp.float32))
    (m, denom, o), _ = jax.lax.scan(step, init, blocks)
    out = jnp.moveaxis(o / denom[..., None], 3, 1).reshape(b, t, n, h).astype(q.dtype)
    return out, (m, denom)


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                      block: int = KEY_BLOCK) -> jax.Array:
    """GQA attention on packed rows: q [B, T, N, H], k/v [B, T, K, H], segment_ids [B, T].

    Rows of at most one key block take the dense formula on that block's mask (the same ops as
    Tunix's masked path, so the same gradients bit for bit); longer rows go blockwise."""
    if q.shape[1] <= block:
        qg, (k_blk, v_blk, seg_blk, pos_blk) = _blocks(q, k, v, segment_ids, q.shape[1])
        s, _ = _scores(qg, k_blk[0], seg_blk[0], pos_blk[0], segment_ids, q.shape[-1]**-0.5)
        probs = jax.nn.softmax(s, axis=-1).astype(k.dtype)
        return jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(q.shape)
    return _blockwise(q, k, v, segment_ids, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise(q, k, v, segment_ids, block):
    return _forward(q, k, v, segment_ids, block)[0]


def _fwd(q, k, v, segment_ids, block):
    out, (m, denom) = _forward(q, k, v, segment_ids, block)
    return out, (q, k, v, segment_ids, out, m, denom)


def _bwd(block, res, d_out):
    q, k, v, segment_ids, out, m, denom = res
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    scale = h**-0.5
    qg, blocks = _blocks(q, k, v, segment_ids, block)

    def grouped(x):  # [B, T, N, H] -> fp32 [B, K, G, T, H]
        x = x.reshape(b, t, kv_heads, n // kv_heads, h).astype(jnp.float32)
        return jnp.moveaxis(x, 1, 3)

    do, o = grouped(d_out), grouped(out)
    delta = jnp.sum(do * o, axis=-1)  # [B, K, G, T]
    qf = jnp.moveaxis(qg.astype(jnp.float32), 1, 3)

    def step(dq, blk):
        k_blk, v_blk, seg_blk, pos_blk = blk
        s, mask = _scores(qg, k_blk, seg_blk, pos_blk, segment_ids, scale)
        # exp(s - m) / denom, not exp(s - logsumexp): K_MASK + log(denom) rounds to K_MASK in fp32.
        p = jnp.exp(s - m[..., None]) / denom[..., None]
        dv = jnp.einsum("BKGTS,BKGTH->BSKH", p, do)
        dp = jnp.einsum("BKGTH,BSKH->BKGTS", do, v_blk.astype(jnp.float32))
        # where(mask, s, K_MASK) passes no gradient to masked scores.
        ds = jnp.where(mask[:, None, None], p * (dp - delta[..., None]), 0.0) * scale
        dq = dq + jnp.einsum("BKGTS,BSKH->BKGTH", ds, k_blk.astype(jnp.float32))
        dk = jnp.einsum("BKGTS,BKGTH->BSKH", ds, qf)
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros_like(qf), blocks)

    def unstack(x):  # [num_blocks, B, block, K, H] -> [B, T, K, H]
        return jnp.moveaxis(x, 0, 1).reshape(b, -1, *x.shape[3:])[:, :t]

    dq = jnp.moveaxis(dq, 3, 1).reshape(b, t, n, h)
    return (dq.astype(q.dtype), unstack(dk).astype(k.dtype), unstack(dv).astype(v.dtype), None)


_blockwise.defvjp(_fwd, _bwd)
