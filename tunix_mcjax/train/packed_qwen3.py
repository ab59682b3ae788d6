"""The trainer's Qwen3 forward over Tunix's param tree, on packed rows.

It is Tunix's Qwen3 layer (`qwen3_layer`, which the engine's paged forward computes too) with
blockwise segment attention (`segment_attention.py`) instead of a dense [B, T, T] mask, split in
two so the trainer can score logprobs in chunks: `hidden_states` (final-normed, [B, T, D]) and
`unembed` (fp32 logits for any leading shape).

The layers run as `lax.scan`s over their weights stacked (`layer_runs`: the trainer stores them
so, one stack per run of same-shaped layers), so the step holds one layer body whatever the
depth; the scanned body is checkpointed, with remat down to its input, without it keeping its
projections' outputs (`SAVED_WITHOUT_REMAT`). A tree in Tunix's per-layer layout (a Tunix
model's own state) is stacked in the step first: the same arithmetic, at the cost of the copy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from tunix.models.qwen3.model import ModelConfig

from tunix_mcjax.train import layer_runs
from tunix_mcjax.train.qwen3_layer import decoder_layer, embed_tokens, rms_norm
from tunix_mcjax.train.segment_attention import KEY_BLOCK, segment_attention

Params = dict[Any, Any]
# Without remat, what the scanned body keeps for the backward: the projections' outputs (dots
# without batch dimensions); the ops between them (norms, RoPE, SiLU, attention's score and
# probability products) are recomputed. Scanned with nothing checkpointed, the body keeps every
# residual in a [L, ...] buffer, fp32 ones included, which the unrolled step's fusions did not:
# numina's step on 8 TPU7x chips peaks at 58.36 GiB so, 28.53 with this policy, 27.75 unrolled.
SAVED_WITHOUT_REMAT = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
BATCH_AXIS = "fsdp"  # packed rows shard over the trainer mesh's fsdp axis


def _rows_sharded(x: jax.Array) -> jax.Array:
    """Keeps activations sharded by rows under a mesh with an fsdp axis (FSDP-style compute when
    params are sharded: XLA gathers weights, not activations); a no-op elsewhere, and inside
    shard_map, where the rows are already one device's."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or BATCH_AXIS not in mesh.axis_names or BATCH_AXIS in mesh.manual_axes:
        return x
    return jax.lax.with_sharding_constraint(x, jax.P(BATCH_AXIS))


def hidden_states(cfg: ModelConfig, params: Params, tokens: jax.Array, positions: jax.Array,
                  segment_ids: jax.Array, *, key_block: int = KEY_BLOCK,
                  remat: bool = False) -> jax.Array:
    """Final-normed hidden states [B, T, D]; attention stays inside each row's segments.
    With `remat`, the backward keeps only each layer's input and recomputes the layer; without,
    each layer's projection outputs (`SAVED_WITHOUT_REMAT`)."""

    def attend(q, k, v):
        return segment_attention(q, k, v, segment_ids, key_block), None

    def body(x, lp):
        return _rows_sharded(decoder_layer(cfg, lp, x, positions, attend)[0]), None

    body = jax.checkpoint(body) if remat else jax.checkpoint(body, policy=SAVED_WITHOUT_REMAT)
    x = _rows_sharded(embed_tokens(cfg, params, tokens))
    for stack in layer_stacks(params["layers"], cfg.num_layers):
        x, _ = jax.lax.scan(body, x, stack)
    return rms_norm(x, params["final_norm"]["w"], cfg.norm_eps, cfg.dtype)


def layer_stacks(layers: Params, num_layers: int) -> list[Params]:
    """The stacks to scan, in layer order: the stored ones (`layer_runs`), or Tunix's per-layer
    trees stacked here. Raises when they do not cover `num_layers` layers."""
    if not layer_runs.is_runs(layers):
        layers = layer_runs.stack_layers(layers)
    stacks = [s for _, s in layer_runs.ordered(layers)]
    depth = sum(jax.tree.leaves(s)[0].shape[0] for s in stacks)
    if depth != num_layers:
        raise ValueError(f"the param tree holds {depth} layers, the model config {num_layers}")
    return stacks


def unembed(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    """fp32 logits [..., V] from final-normed hidden states [..., D]."""
    x = x.astype(cfg.dtype)
    if cfg.use_tied_embedding:
        w = params["embedder"]["input_embedding"].astype(cfg.dtype)
        logits = jnp.einsum("...D,VD->...V", x, w)
    else:
        logits = jnp.einsum("...D,DV->...V", x, params["lm_head"]["w"].astype(cfg.dtype))
    return logits.astype(jnp.float32)
