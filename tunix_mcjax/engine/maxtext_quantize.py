"""The maxtext engine's projection weights quantized per output channel (`quantization`: int8,
fp8), held as `engine.quantize` holds the jax engine's: a `qwix.QArray` of values and float32
scales, one per output channel (every axis the kernel's einsum does not contract, a scanned
leaf's layer axis included).

Covered: dense Qwen3 (decoder_block qwen3), each decoder layer's attention query, key, value
and out kernels and MLP wi_0, wi_1 and wo kernels, and an untied output head
(`decoder/logits_dense/kernel`). The token embedding (also the head when tied, as Qwen3-0.6B to
4B tie it) and the norms stay in the engine's weight dtype. Other families are refused by name
(`check_family`): their MoE expert kernels, routers and other layer kinds are not covered.

The decode model dequantizes a layer's kernels inside the layer scan's body, a layer at a time
(`maxtext_model`), so nothing the program holds grows with depth; the rest before the model
runs (`merge_view`).
"""

from __future__ import annotations

from typing import Any

from tunix_mcjax.engine.maxtext_tree import DECODER, LAYER_PREFIX, STACKED_LAYERS
from tunix_mcjax.engine.quantize import check_mode, dequantize, is_quantized

QUANTIZED_BLOCKS = frozenset({"qwen3"})
# A layer's projections (path below `decoder/layers` or `decoder/layers_<i>`) -> how many of
# their leading axes (after a scanned leaf's layer axis) their einsum contracts: query, key and
# value [embed, heads, head_dim], out [heads, head_dim, embed], the MLP's [in, out].
LAYER_PROJECTIONS: dict[tuple[str, ...], int] = {
    ("self_attention", "query", "kernel"): 1,
    ("self_attention", "key", "kernel"): 1,
    ("self_attention", "value", "kernel"): 1,
    ("self_attention", "out", "kernel"): 2,
    ("mlp", "wi_0", "kernel"): 1,
    ("mlp", "wi_1", "kernel"): 1,
    ("mlp", "wo", "kernel"): 1,
}
OUTPUT_HEAD = (DECODER, "logits_dense", "kernel")  # [embed, vocab], untied only


def check_family(config: Any, mode: str) -> None:
    """Raises ValueError for `quantization` on a MaxText family whose kernels are not covered."""
    block = getattr(config.decoder_block, "value", config.decoder_block)
    if check_mode(mode) and block not in QUANTIZED_BLOCKS:
        raise ValueError(
            f"quantization={mode} with rollout_engine=maxtext: model_name={config.model_name} "
            f"(decoder_block={block}) is not covered; the maxtext engine quantizes dense "
            "Qwen3's projections only (decoder_block qwen3: its MoE expert kernels and other "
            "layer kinds are not). Drop quantization for this model")


def contracted_axes(path: tuple[str, ...], stacked: int) -> tuple[int, ...] | None:
    """The axes a quantized leaf's einsum contracts, the leaf held with its `stacked` layer
    axes in front; None for a leaf the engine keeps unquantized."""
    if path == OUTPUT_HEAD:
        return (0,)
    in_layer = len(path) > 2 and path[0] == DECODER and (
        path[1] == STACKED_LAYERS or path[1].startswith(LAYER_PREFIX))
    if not in_layer or path[2:] not in LAYER_PROJECTIONS:
        return None
    return tuple(range(stacked, stacked + LAYER_PROJECTIONS[path[2:]]))


def merge_view(tree: Any, dtype: Any, carried: tuple[tuple[str, ...], ...],
               path: tuple[str, ...] = ()) -> Any:
    """A nested param tree as the merged MaxText model holds it: quantized leaves dequantized
    to `dtype`, except under the `carried` prefixes (the scanned stacks, which the layer scan
    reads and dequantizes a layer at a time; the merged model only carries them), whose
    values stand in, unconverted."""
    if is_quantized(tree):
        if any(path[:len(prefix)] == prefix for prefix in carried):
            return tree.qvalue
        return dequantize(tree, dtype)
    if isinstance(tree, dict):
        return {key: merge_view(value, dtype, carried, (*path, str(key)))
                for key, value in tree.items()}
    return tree
