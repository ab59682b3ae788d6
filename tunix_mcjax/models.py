"""Qwen3 model configs and random-init construction (Tunix `tunix.models.qwen3`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.qwen3 import model as qwen3
from tunix.models.qwen3 import params as qwen3_params

from tunix_mcjax.config import Config, ConfigError
from tunix_mcjax.train import lora

PRESETS = {
    "qwen3-0.6b": qwen3.ModelConfig.qwen3_0p6b,
    "qwen3-1.7b": qwen3.ModelConfig.qwen3_1p7b,
    "qwen3-4b": qwen3.ModelConfig.qwen3_4b,
    "qwen3-8b": qwen3.ModelConfig.qwen3_8b,
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def model_config(cfg: Config, vocab_size: int, *, for_sampling: bool = False) -> qwen3.ModelConfig:
    """The Tunix ModelConfig for `cfg.model_name` (`qwen3-tiny` reads the `base_*` keys); the
    engine's (`for_sampling`) holds its weights in `rollout_weight_dtype`. With `lora_rank` > 0
    it is a `lora.LoraModelConfig`: the tree carries adapters."""
    return lora.with_lora(_base_model_config(cfg, vocab_size, for_sampling), lora.spec_of(cfg))


def _base_model_config(cfg: Config, vocab_size: int, for_sampling: bool) -> qwen3.ModelConfig:
    sharding = qwen3.ShardingConfig.get_default_sharding(is_sampling=for_sampling)
    weights = cfg.rollout_weight_dtype if for_sampling and cfg.rollout_weight_dtype else \
        cfg.weight_dtype
    dtypes = {"dtype": DTYPES[cfg.dtype], "param_dtype": DTYPES[weights]}
    if cfg.model_name == "qwen3-tiny":
        return qwen3.ModelConfig(
            num_layers=cfg.base_num_decoder_layers,
            vocab_size=cfg.vocab_size or vocab_size,
            embed_dim=cfg.base_emb_dim,
            hidden_dim=cfg.base_mlp_dim,
            num_heads=cfg.base_num_query_heads,
            head_dim=cfg.head_dim,
            num_kv_heads=cfg.base_num_kv_heads,
            rope_theta=cfg.rope_max_timescale,
            norm_eps=1e-6,
            use_tied_embedding=True,
            shd_config=sharding,
            **dtypes,
        )
    if cfg.model_name not in PRESETS:
        raise ConfigError(
            f"model_name={cfg.model_name!r} is not supported; use qwen3-tiny or one of "
            f"{', '.join(PRESETS)}"
        )
    base = PRESETS[cfg.model_name]()
    return dataclasses.replace(base, shd_config=sharding, **dtypes)


def _init_mlp(model: nnx.Module, seed: int) -> None:
    """Tunix zero-initialises MLP kernels (it expects a checkpoint); with all three at zero the
    MLP gets no gradient and never trains. Random init gives them a fan-in scaled normal."""
    key = jax.random.key(seed + 1)
    for i, layer in enumerate(model.layers):
        for j, name in enumerate(("gate_proj", "up_proj", "down_proj")):
            kernel = getattr(layer.mlp, name).kernel
            fan_in = kernel.shape[0]
            value = jax.random.normal(jax.random.fold_in(key, 3 * i + j), kernel.shape)
            kernel.set_value((value / jnp.sqrt(fan_in)).astype(kernel.get_value().dtype))


def create_model(mc: qwen3.ModelConfig, seed: int, mesh: jax.sharding.Mesh | None = None):
    """Random-init Qwen3. With `mesh`, params are created sharded by the model's own specs."""
    if mesh is None:
        model = qwen3.Qwen3(mc, rngs=nnx.Rngs(seed))
        _init_mlp(model, seed)
        return model

    @nnx.jit
    def make():
        model = qwen3.Qwen3(mc, rngs=nnx.Rngs(seed))
        _init_mlp(model, seed)
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
        return model

    with jax.set_mesh(mesh):
        return make()


def load_model(mc: qwen3.ModelConfig, path: str, mesh: jax.sharding.Mesh | None = None):
    """Qwen3 from a local Hugging Face safetensors directory (Tunix's loader), sharded on mesh.

    Tensors are cast to the config's param dtype: Tunix keeps the file's dtype otherwise, so a
    bf16 checkpoint (as Qwen3 ships) would train in bf16 under `weight_dtype=float32`."""
    if not Path(path).is_dir() or not any(Path(path).glob("*.safetensors")):
        raise ConfigError(f"load_parameters_path={path!r} is not a directory with *.safetensors "
                          "files (a Hugging Face Qwen3 checkpoint)")
    return qwen3_params.create_model_from_safe_tensors(path, mc, mesh=mesh, dtype=mc.param_dtype)


def build_model(cfg: Config, mc: qwen3.ModelConfig, mesh: jax.sharding.Mesh | None = None):
    """The run's starting policy: loaded from `load_parameters_path`, else random init; with
    LoRA (`mc` carries a spec), plus Tunix's adapters on that base."""
    if cfg.load_parameters_path:
        model = load_model(mc, cfg.load_parameters_path, mesh)
    else:
        model = create_model(mc, cfg.init_weights_seed, mesh)
    return lora.add_adapters(model, mesh) if lora.lora_of(mc) else model



def hf_state_dict(model: nnx.Module, mc: qwen3.ModelConfig) -> dict[str, np.ndarray]:
    """The model's params under Hugging Face Qwen3 names and layouts ([out, in] matrices): what
    `load_model` (Tunix's loader) reads back exactly. Tied embeddings: no `lm_head`."""
    flat = {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    out = {"model.embed_tokens.weight": flat["embedder/input_embedding"],
           "model.norm.weight": flat["final_norm/w"]}
    if not mc.use_tied_embedding:
        out["lm_head.weight"] = flat["lm_head/w"].T
    for i in range(mc.num_layers):
        p, hf = f"layers/{i}/", f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj"):
            w = flat[f"{p}attn/{name}/w"]
            out[f"{hf}self_attn.{name}.weight"] = w.reshape(w.shape[0], -1).T
        o = flat[f"{p}attn/o_proj/w"]
        out[f"{hf}self_attn.o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{hf}mlp.{name}.weight"] = flat[f"{p}mlp/{name}/kernel"].T
        out[f"{hf}self_attn.q_norm.weight"] = flat[f"{p}attn/q_norm/w"]
        out[f"{hf}self_attn.k_norm.weight"] = flat[f"{p}attn/k_norm/w"]
        out[f"{hf}input_layernorm.weight"] = flat[f"{p}input_layernorm/w"]
        out[f"{hf}post_attention_layernorm.weight"] = flat[f"{p}post_attention_layernorm/w"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_safetensors(model: nnx.Module, mc: qwen3.ModelConfig, path: str | Path) -> Path:
    """Writes `path/model.safetensors`, a checkpoint `load_parameters_path=path` starts from."""
    from safetensors.numpy import save_file

    Path(path).mkdir(parents=True, exist_ok=True)
    out = Path(path) / "model.safetensors"
    save_file(hf_state_dict(model, mc), str(out))
    return out
