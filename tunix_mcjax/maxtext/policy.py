"""MaxText's model as our trainer's `Policy`, and its weights as the engine's param tree.

The model is what `train_rl` trains: built by MaxText's `model_creation_utils.from_pretrained`
and wrapped in its Tunix adapter, on MaxText's mesh (all devices on "fsdp" by default). What the
engine gets depends on the run's engine (`rollout_engine`; by default the model's,
`config_map.rollout_engine_for`): the maxtext engine takes MaxText's own param tree as it is;
the jax and vllm engines take Tunix Qwen3's, a rename plus, with `scan_layers`, unstacking the
layer axis (`param_scan_axis`); shapes are otherwise the same (ADAPTER_NOTES.md section 5).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from tunix.models.qwen3 import model as qwen3

from tunix_mcjax.config import ConfigError
from tunix_mcjax.engine.maxtext_tree import drop_rngs
from tunix_mcjax.maxtext import config_map
from tunix_mcjax.train.trainer import Policy

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# MaxText decoder-layer param path -> Tunix Qwen3 layer param path.
LAYER_PARAMS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("pre_self_attention_layer_norm", "scale"): ("input_layernorm", "w"),
    ("post_self_attention_layer_norm", "scale"): ("post_attention_layernorm", "w"),
    ("self_attention", "query", "kernel"): ("attn", "q_proj", "w"),
    ("self_attention", "key", "kernel"): ("attn", "k_proj", "w"),
    ("self_attention", "value", "kernel"): ("attn", "v_proj", "w"),
    ("self_attention", "out", "kernel"): ("attn", "o_proj", "w"),
    ("self_attention", "query_norm", "scale"): ("attn", "q_norm", "w"),
    ("self_attention", "key_norm", "scale"): ("attn", "k_norm", "w"),
    ("mlp", "wi_0", "kernel"): ("mlp", "gate_proj", "kernel"),
    ("mlp", "wi_1", "kernel"): ("mlp", "up_proj", "kernel"),
    ("mlp", "wo", "kernel"): ("mlp", "down_proj", "kernel"),
}


def build_model(config: Any, pad_id: int) -> tuple[nnx.Module, jax.sharding.Mesh]:
    """MaxText's model and mesh, as train_rl builds its actor (all devices train)."""
    from maxtext.utils import model_creation_utils

    model, mesh = model_creation_utils.from_pretrained(
        config, devices=jax.devices(), wrap_with_tunix_adapter=True, tokenizer_pad_id=pad_id)
    check_mesh(mesh)
    return model, mesh


def check_mesh(mesh: jax.sharding.Mesh) -> None:
    """Batch rows shard over "fsdp" from each process's local rows, so "fsdp" must hold every
    device (its order is MaxText's: on a TPU slice it interleaves the hosts, which the trainer
    places rows for)."""
    if mesh.shape["fsdp"] != mesh.devices.size:
        raise ConfigError(
            f"MaxText's mesh {dict(mesh.shape)} does not put all {mesh.devices.size} devices on "
            "fsdp: rl_runtime=mcjax trains FSDP only; leave the ici_*/dcn_* parallelism keys "
            "at their defaults.")


def drop_rng_state(model: nnx.Module) -> None:
    """Removes the `nnx.Rngs` MaxText layers keep from construction (`drop_rngs`), so that the
    params are the model's only state, which is what the trainer splits, optimises and
    checkpoints; any other state is an error.
    """
    drop_rngs(model)
    rest = nnx.state(model, nnx.Not(nnx.Param))
    if jax.tree.leaves(rest):
        paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(rest)]
        raise ConfigError(f"MaxText's model has state other than params ({paths[:5]}); "
                          "rl_runtime=mcjax trains models whose only state is params.")


def forward(model: nnx.Module, tokens: jax.Array, positions: jax.Array,
            segment_ids: jax.Array, *, rules: Any, routing: jax.Array | None = None) -> jax.Array:
    """fp32 logits of MaxText's Tunix adapter on packed rows (segment 0 is padding); with
    `routing` (int32 [B, T, MoE layers, k], the engine's) each MoE layer routes with it."""
    with nn_partitioning.axis_rules(rules):
        logits, _ = model(tokens, positions, None, None, segment_ids=segment_ids,
                          forced_routed_experts=routing)
    return logits.astype(jnp.float32)


def to_tunix_qwen3(params: nnx.State, *, num_layers: int, scan_axis: int | None,
                   tied: bool) -> dict:
    """MaxText Qwen3 params -> the Tunix Qwen3 param tree (nested dict) the engine loads."""
    base = nnx.to_pure_dict(params)["base"]
    decoder = base["decoder"]

    def layer(i: int) -> dict:
        if scan_axis is None:
            return decoder[f"layers_{i}"]
        return jax.tree.map(lambda a: jnp.take(a, i, axis=scan_axis), decoder["layers"])

    def rename(src: dict) -> dict:
        out: dict = {}
        for mt_path, tx_path in LAYER_PARAMS.items():
            value = functools.reduce(lambda d, k: d[k], mt_path, src)
            node = out
            for key in tx_path[:-1]:
                node = node.setdefault(key, {})
            node[tx_path[-1]] = value
        return out

    tree = {
        "embedder": {"input_embedding": base["token_embedder"]["embedding"]},
        "final_norm": {"w": decoder["decoder_norm"]["scale"]},
        "layers": {i: rename(layer(i)) for i in range(num_layers)},
    }
    if not tied:
        tree["lm_head"] = {"w": decoder["logits_dense"]["kernel"]}
    return tree


def maxtext_tree(params: nnx.State) -> dict:
    """The maxtext engine's param tree: MaxText's own, without the Tunix adapter's `base`."""
    return nnx.to_pure_dict(params)["base"]


def maxtext_policy(model: nnx.Module, config: Any,
                   engine: str | None = None) -> tuple[Policy, nnx.State]:
    """The trainer's view of MaxText's model, plus its params, for `engine` (None: the model's
    default engine)."""
    drop_rng_state(model)
    graphdef, params = nnx.split(model, nnx.Param)
    if (engine or config_map.rollout_engine_for(config)) == "maxtext":
        to_engine = maxtext_tree
    else:
        to_engine = jax.jit(functools.partial(
            to_tunix_qwen3, num_layers=config.num_decoder_layers,
            scan_axis=config.param_scan_axis if config.scan_layers else None,
            tied=config.logits_via_embedding))
    fwd = functools.partial(forward, rules=config.logical_axis_rules)
    return Policy(graphdef, fwd, to_engine), params


def engine_model_config(config: Any, engine: str | None = None) -> Any:
    """The engine's model config: MaxText's own config for the maxtext engine, else the Tunix
    Qwen3 ModelConfig whose param tree `to_tunix_qwen3` produces."""
    if (engine or config_map.rollout_engine_for(config)) == "maxtext":
        return config
    dtype, weight_dtype = (str(getattr(d, "value", d)) for d in (config.dtype, config.weight_dtype))
    if dtype not in DTYPES or weight_dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype}, weight_dtype={weight_dtype}: the engine runs "
                          f"{' or '.join(DTYPES)}")
    return qwen3.ModelConfig(
        num_layers=config.num_decoder_layers,
        vocab_size=config.vocab_size,
        embed_dim=config.emb_dim,
        hidden_dim=config.mlp_dim,
        num_heads=config.num_query_heads,
        head_dim=config.head_dim,
        num_kv_heads=config.num_kv_heads,
        rope_theta=int(config.rope_max_timescale),
        norm_eps=config.normalization_layer_epsilon,
        use_tied_embedding=config.logits_via_embedding,
        shd_config=qwen3.ShardingConfig.get_default_sharding(is_sampling=True),
        dtype=DTYPES[dtype],
        param_dtype=DTYPES[weight_dtype],
    )
