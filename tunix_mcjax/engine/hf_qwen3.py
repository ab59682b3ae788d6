"""The Tunix Qwen3 param tree under Hugging Face names and layouts, as a checked bijection.

vLLM's torch Qwen3 loads Hugging Face checkpoints: `[out, in]` matrices, q/k/v and gate/up as
separate tensors (vLLM fuses them into `qkv_proj` and `gate_up_proj` itself). `to_hf` maps a
whole Tunix tree and refuses a tree with a leaf missing or unknown, so a publish is never
partial; `check_covers` checks the result against the parameters a vLLM model actually has,
since vLLM silently keeps its old value for any parameter a reload leaves out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from tunix.models.qwen3.model import ModelConfig

from tunix_mcjax.train.qwen3_layer import TUNIX_ROPE_THETA

LeafPath = tuple[str, ...]
# Tunix layer leaf -> (Hugging Face name under `model.layers.{i}.`, layout).
# Layouts: "qkv" [E, N, H] -> [N*H, E]; "o" [N, H, E] -> [E, N*H]; "t" transpose; "id" as is.
_LAYER = {
    ("attn", "q_proj", "w"): ("self_attn.q_proj.weight", "qkv"),
    ("attn", "k_proj", "w"): ("self_attn.k_proj.weight", "qkv"),
    ("attn", "v_proj", "w"): ("self_attn.v_proj.weight", "qkv"),
    ("attn", "o_proj", "w"): ("self_attn.o_proj.weight", "o"),
    ("attn", "q_norm", "w"): ("self_attn.q_norm.weight", "id"),
    ("attn", "k_norm", "w"): ("self_attn.k_norm.weight", "id"),
    ("mlp", "gate_proj", "kernel"): ("mlp.gate_proj.weight", "t"),
    ("mlp", "up_proj", "kernel"): ("mlp.up_proj.weight", "t"),
    ("mlp", "down_proj", "kernel"): ("mlp.down_proj.weight", "t"),
    ("input_layernorm", "w"): ("input_layernorm.weight", "id"),
    ("post_attention_layernorm", "w"): ("post_attention_layernorm.weight", "id"),
}
_TOP = {
    ("embedder", "input_embedding"): ("model.embed_tokens.weight", "id"),
    ("final_norm", "w"): ("model.norm.weight", "id"),
    ("lm_head", "w"): ("lm_head.weight", "t"),
}


def name_map(mc: ModelConfig) -> dict[LeafPath, tuple[str, str]]:
    """Every Tunix leaf of a dense Qwen3 of this shape -> (HF name, layout). One to one."""
    out = {path: target for path, target in _TOP.items()
           if path != ("lm_head", "w") or not mc.use_tied_embedding}
    for i in range(mc.num_layers):
        for path, (name, layout) in _LAYER.items():
            out[("layers", str(i), *path)] = (f"model.layers.{i}.{name}", layout)
    names = [name for name, _ in out.values()]
    assert len(set(names)) == len(names), "the Tunix -> HF name map must be one to one"
    return out


def _layout(value: np.ndarray, layout: str) -> np.ndarray:
    if layout == "qkv":
        return value.reshape(value.shape[0], -1).T
    if layout == "o":
        return value.reshape(-1, value.shape[-1]).T
    if layout == "t":
        return value.T
    return value


def check_complete(paths: Iterable[LeafPath], mc: ModelConfig) -> None:
    """Raises ValueError naming the leaves missing from or unknown to this model's tree: a
    publish moves every leaf."""
    names, paths = name_map(mc), set(paths)
    missing = sorted("/".join(p) for p in names if p not in paths)
    unknown = sorted("/".join(p) for p in paths if p not in names)
    if missing or unknown:
        raise ValueError(
            f"a vLLM publish takes the whole Qwen3 param tree: {len(missing)} leaves missing "
            f"{missing[:3]}, {len(unknown)} unknown {unknown[:3]}. Publish with "
            "rl_publish_weights_single_call=true and a tree of this model's shape.")


def to_hf(flat: Mapping[LeafPath, Any], mc: ModelConfig) -> dict[str, np.ndarray]:
    """The whole tree `flat` (leaf path -> host array) under HF names and layouts."""
    check_complete(flat, mc)
    names = name_map(mc)
    return {names[p][0]: np.ascontiguousarray(_layout(np.asarray(v), names[p][1]))
            for p, v in flat.items()}


def check_covers(hf_names: Iterable[str], model_params: Iterable[str],
                 packed: Mapping[str, list[str]]) -> None:
    """Every HF name lands on one of the model's parameters and every model parameter gets all
    of its shards (`packed`: fused module -> its HF parts, vLLM's `packed_modules_mapping`).
    Raises ValueError naming what is left untouched or has nowhere to go."""
    to_fused = {part: fused for fused, parts in packed.items() for part in parts}
    params = set(model_params)
    landed: dict[str, set[str]] = {p: set() for p in params}
    nowhere = []
    for name in hf_names:
        module, _, leaf = name.rpartition(".")
        parent, _, short = module.rpartition(".")
        target = f"{parent}.{to_fused.get(short, short)}.{leaf}"
        if target not in landed:
            nowhere.append(name)
            continue
        landed[target].add(short)
    untouched = []
    for param, parts in landed.items():
        short = param.rpartition(".")[0].rpartition(".")[2]
        expected = set(packed.get(short, [short]))
        if parts != expected:
            untouched.append(f"{param} (got {sorted(parts)}, needs {sorted(expected)})")
    if nowhere or untouched:
        raise ValueError(f"the HF weights do not match vLLM's model: no parameter for "
                         f"{nowhere[:3]}; not fully written: {untouched[:3]}")


def hf_config(mc: ModelConfig, max_model_len: int, overrides: Mapping[str, Any] | None = None
              ) -> dict[str, Any]:
    """`config.json` of a Hugging Face Qwen3 with this shape (vLLM builds its model from it).

    RoPE theta is Tunix's 1e6, which its Qwen3 uses whatever the config says (qwen3_forward).
    `overrides` are MaxText's `vllm_hf_overrides`, applied last.
    """
    dtype = np.dtype(mc.param_dtype).name
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": mc.vocab_size,
        "hidden_size": mc.embed_dim,
        "intermediate_size": mc.hidden_dim,
        "num_hidden_layers": mc.num_layers,
        "num_attention_heads": mc.num_heads,
        "num_key_value_heads": mc.num_kv_heads,
        "head_dim": mc.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_model_len,
        "rms_norm_eps": mc.norm_eps,
        "rope_theta": TUNIX_ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": TUNIX_ROPE_THETA},
        "tie_word_embeddings": bool(mc.use_tied_embedding),
        "attention_bias": False,
        "torch_dtype": dtype,
    }
    config.update(overrides or {})
    return config
