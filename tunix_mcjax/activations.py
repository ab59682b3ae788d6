"""What the planner's train phase depends on: the model's shapes (`ModelShape`, from an abstract
Tunix Qwen3) and the bytes a token leaves saved for the backward, per backend: fitted to XLA's
CPU buffer assignment (`SAVED_PER_UNIT`), counted from the scanned step's residuals on TPU
(`TPU_SAVED_PER_UNIT`, and the attention masks it keeps, `attention_mask_bytes`). `plan.py` adds
them up."""

from __future__ import annotations

import dataclasses
import math

from tunix_mcjax.train.segment_attention import KEY_BLOCK


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What memory depends on, from the Tunix ModelConfig and its param tree."""

    layers: int
    embed: int  # D
    q_width: int  # query heads x head dim
    kv_width: int  # kv heads x head dim
    kv_heads: int
    head_dim: int
    query_heads: int
    mlp: int  # F
    vocab: int
    param_count: int
    layer_param_count: int  # one decoder layer
    sharded_param_count: int  # per device, FSDP over all devices (dims that divide)
    largest_leaf: int
    largest_layer_leaf: int = 0  # one decoder layer's largest
    # (elements, last dimension) of each leaf FSDP shards along its last dimension
    last_dim_sharded: tuple[tuple[int, int], ...] = ()

    @property
    def largest_published_leaf(self) -> int:
        """The largest leaf a publish moves: the trainer's layers are stacked (`layer_runs`), so
        a layer leaf moves as one [layers, ...] array."""
        return max(self.largest_leaf, self.layers * self.largest_layer_leaf)


def model_shape(mc, fsdp: int) -> ModelShape:
    """Param counts from an abstract Tunix Qwen3 (no arrays are made)."""
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    abstract = nnx.eval_shape(lambda: qwen3.Qwen3(mc, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    leaves = [(tuple(path), v.get_value()) for path, v in nnx.to_flat_state(state)]
    specs = dict((tuple(p), v.get_value()) for p, v in
                 nnx.to_flat_state(nnx.get_partition_spec(state)))
    total = sharded = layer0 = largest = largest_layer = 0
    last_dim_sharded = []
    for path, leaf in leaves:
        n = math.prod(leaf.shape)
        total += n
        largest = max(largest, n)
        layer0 += n if path[:2] == ("layers", 0) else 0
        largest_layer = max(largest_layer, n if path[:2] == ("layers", 0) else 0)
        spec = tuple(specs[path]) + (None,) * len(leaf.shape)
        if len(leaf.shape) > 1 and "fsdp" in _axes(spec[len(leaf.shape) - 1]):
            last_dim_sharded.append((n, leaf.shape[-1]))
        sharded += math.prod(-(-d // fsdp) if "fsdp" in _axes(a) else d
                             for d, a in zip(leaf.shape, spec[:len(leaf.shape)], strict=True))
    return ModelShape(mc.num_layers, mc.embed_dim, mc.num_heads * mc.head_dim,
                      mc.num_kv_heads * mc.head_dim, mc.num_kv_heads, mc.head_dim, mc.num_heads,
                      mc.hidden_dim, mc.vocab_size, total, layer0, sharded, largest,
                      largest_layer, tuple(last_dim_sharded))


def _axes(axis) -> tuple:
    return axis if isinstance(axis, tuple) else (axis,)


# Bytes a token leaves saved per decoder layer, per unit of each width, as `fixed + per_byte *
# c` with c the compute dtype's bytes. `heads_x_keys` counts query heads x key positions: all of
# them for rows of one attention key block (the dense formula keeps its probabilities), one
# block's worth for longer rows (blockwise, softmax statistics only). Fitted to XLA's buffer
# assignment for the trainer's step (compiled memory analysis on CPU: fp32 and bf16, 2 and 4
# layers, each width doubled in turn, rows of 128, 256 and 1024 tokens; within 5% on those 32
# shapes).
SAVED_PER_UNIT = {"embed": (18.1, 1.0), "mlp": (0.7, 4.5), "q_width": (16.7, 2.7),
                  "kv_width": (0.3, 10.2)}
DENSE_HEADS_X_KEYS = (8.1, 0.9)
BLOCKWISE_HEADS_X_KEYS = (2.0, 0.0)

# On TPU, the residuals the scanned step keeps for its backward (`packed_qwen3`: the layers'
# stacks scanned, the body checkpointed with `SAVED_WITHOUT_REMAT`): one [layers, rows, T, width]
# stack per saved value, in the compute dtype, per token and layer in units of its bytes: q
# (q_width), k and v (2 x kv_width), gate and up (2 x mlp) and two of the embed width (the
# layer's input among them), as `saved_residuals` lists them for the step (`tests/test_plan.py`).
# Norms, RoPE, SiLU and the attention's softmax statistics are recomputed. XLA's TPU buffer
# assignment holds exactly these stacks (the paper's swe cell on 8 TPU7x chips: 10.5 GiB).
TPU_SAVED_PER_UNIT = {"embed": 2, "q_width": 1, "kv_width": 2, "mlp": 2}
# The attention's key mask and masked fill (`segment_attention._scores`: bool and fp32, one
# [rows, kv heads, group, T, key block] pair per key block) depend on the segment ids only, so
# JAX's partial evaluation computes them outside the layers' scan for every key block at once
# and keeps them through the step's forward and backward: T x keys x query heads x (1 + 4)
# bytes a row, whatever the depth, quadratic in the row's length. On the paper's swe rows (16384
# tokens) that is 20 GiB of XLA's 40.1 GiB peak; numina's (12288) 11.25 GiB.
TPU_MASK_BYTES = 1 + 4


def activation_bytes_per_token(m: ModelShape, compute_bytes: int, row_len: int,
                               remat: bool, tpu: bool = False) -> int:
    """Bytes one token leaves saved for the backward, over all layers (on TPU by
    `TPU_SAVED_PER_UNIT`, elsewhere by the CPU fit). With remat (`remat_policy=full`: a
    decoder layer recomputed in its backward) only each layer's input stays, plus one layer's
    worth while it is recomputed (not fitted; from the shapes)."""
    per_layer = (tpu_saved_per_layer if tpu else _cpu_saved_per_layer)(
        m, compute_bytes, row_len)
    if remat:
        return int(compute_bytes * m.embed * m.layers + per_layer)
    return int(per_layer * m.layers)


def _cpu_saved_per_layer(m: ModelShape, compute_bytes: int, row_len: int) -> float:
    widths = {"embed": m.embed, "mlp": m.mlp, "q_width": m.q_width, "kv_width": m.kv_width}
    coefficients = dict(SAVED_PER_UNIT)
    if row_len <= KEY_BLOCK:
        widths["heads_x_keys"], coefficients["heads_x_keys"] = \
            m.query_heads * row_len, DENSE_HEADS_X_KEYS
    else:
        widths["heads_x_keys"], coefficients["heads_x_keys"] = \
            m.query_heads * KEY_BLOCK, BLOCKWISE_HEADS_X_KEYS
    return sum((fixed + per_byte * compute_bytes) * widths[dim]
               for dim, (fixed, per_byte) in coefficients.items())


def tpu_saved_per_layer(m: ModelShape, compute_bytes: int, row_len: int) -> float:
    """Bytes a token leaves in the scanned step's residual stacks, per layer (`row_len` is
    kept for the signature the CPU fit shares: the stacks do not depend on it)."""
    del row_len
    widths = {"embed": m.embed, "q_width": m.q_width, "kv_width": m.kv_width, "mlp": m.mlp}
    return compute_bytes * sum(units * widths[dim] for dim, units in TPU_SAVED_PER_UNIT.items())


def attention_mask_bytes(m: ModelShape, row_len: int) -> int:
    """On TPU, one row's attention masks kept through the step (`TPU_MASK_BYTES`): every query
    against every key position of its key blocks (the row itself when it fits in one block)."""
    keys = row_len if row_len <= KEY_BLOCK else -(-row_len // KEY_BLOCK) * KEY_BLOCK
    return TPU_MASK_BYTES * m.query_heads * row_len * keys
