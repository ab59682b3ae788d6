"""What the planner's train phase depends on: the model's shapes (`ModelShape`, from an abstract
Tunix Qwen3) and the bytes a token leaves saved for the backward, per backend: fitted to XLA's
CPU buffer assignment (`SAVED_PER_UNIT`), counted from JAX's residuals on TPU
(`TPU_SAVED_PER_UNIT`). `plan.py` adds them up."""

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
    for path, leaf in leaves:
        n = math.prod(leaf.shape)
        total += n
        largest = max(largest, n)
        layer0 += n if path[:2] == ("layers", 0) else 0
        largest_layer = max(largest_layer, n if path[:2] == ("layers", 0) else 0)
        spec = tuple(specs[path]) + (None,) * len(leaf.shape)
        sharded += math.prod(-(-d // fsdp) if "fsdp" in _axes(a) else d
                             for d, a in zip(leaf.shape, spec[:len(leaf.shape)], strict=True))
    return ModelShape(mc.num_layers, mc.embed_dim, mc.num_heads * mc.head_dim,
                      mc.num_kv_heads * mc.head_dim, mc.num_kv_heads, mc.head_dim, mc.num_heads,
                      mc.hidden_dim, mc.vocab_size, total, layer0, sharded, largest,
                      largest_layer)


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

# On TPU, XLA's buffer assignment of the train step (compiled for TPU7x: the paper's gsm8k,
# numina and swe cells, bench_results/aot) holds far less than the CPU fit: its per-token
# growth (1.46-1.61 MB a token between the cells) is the residuals JAX saves for the backward in
# the compute dtype (1.51 MB a token at Qwen3-0.6B), without the fp32 RMSNorm chains (upcast,
# x / rms, x w: 62 KB a token and layer more) that the CPU backend stores and TPU's fusions
# recompute. Per token and decoder layer, in units of the compute dtype's bytes, as JAX saves
# them for Tunix's Qwen3 layer (`jax.ad_checkpoint.saved_residuals`, `tests/test_plan.py`):
# both norms' outputs (2 x embed), q and the attention's output (2 x q_width), k and v (2 x
# kv_width), gate, up, silu's three and their product (6 x mlp), and RoPE's sin and cos for q
# and k (2 x head_dim, each half of it). With the weights' cast (`params_cast_bytes`) the
# train phase is 13%, 5% and 6% below XLA's at 8 chips (`tests/test_aot_cells.py`); the rest,
# larger at short rows, is not itemised. These are the residuals of the layer unscanned. The
# trainer now scans its stacked layers and keeps less (`packed_qwen3.SAVED_WITHOUT_REMAT`: the
# projections' outputs, 22.5 KB a token and layer at Qwen3-0.6B in bf16 against the 53.8 KB
# counted here), while XLA's peak also holds the backward's recompute of one layer; the totals
# stay within 15% of XLA's (bench_results/aot/*-train.json), so the count is kept as fitted.
TPU_SAVED_PER_UNIT = {"embed": 2, "q_width": 2, "kv_width": 2, "mlp": 6, "head_dim": 2}
# fp32 per query head: blockwise attention's running max and denominator (`_fwd`); the dense
# formula (rows of one key block) keeps its probabilities instead, in fp32 and the compute dtype
# (not compiled for TPU yet: the paper's rows are all longer).
TPU_BLOCKWISE_STATS = 8
TPU_DENSE_PROBS = 4


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
    widths = {"embed": m.embed, "q_width": m.q_width, "kv_width": m.kv_width, "mlp": m.mlp,
              "head_dim": m.head_dim}
    saved = sum(units * widths[dim] for dim, units in TPU_SAVED_PER_UNIT.items())
    attention = m.query_heads * (TPU_BLOCKWISE_STATS if row_len > KEY_BLOCK
                                 else row_len * (TPU_DENSE_PROBS + compute_bytes))
    return saved * compute_bytes + attention
