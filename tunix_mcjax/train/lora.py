"""LoRA as Tunix does it (qwix's `LoraProvider` + `apply_lora_to_model`), on Tunix Qwen3.

Tunix's CLI (`tunix/cli/utils/model.py`) wraps the actor in qwix LoRA: every projection whose
module path fully matches `module_path` (a regex over paths such as `layers/3/mlp/gate_proj`)
gets `<param>_lora_a` and `<param>_lora_b` (`nnx.LoRAParam`) beside its weight, and its output
becomes `x @ W + (x @ A) @ B * alpha / rank`. Only the adapters train; the reference model is the
base without them.

`add_adapters` puts those same params, with qwix's names, shapes, sharding metadata and initial
values (A he-uniform, B zero, keyed as qwix keys them under `nnx.Rngs(10003)`, its default) on a
plain Tunix Qwen3, so trainer and engine keep their functional forwards (`delta` adds the
adapters' term). A model config that carries a `LoraSpec` (`LoraModelConfig`) tells both the
trainer and the engine that the tree has adapters, and their scale.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.qwen3 import model as qwen3

from tunix_mcjax.config import ConfigError

# qwix's seed for LoRA weights when the caller passes no rngs (Tunix's CLI passes none).
QWIX_DEFAULT_SEED = 10003
LORA_DIM = "r"

# The projections of a Tunix Qwen3 decoder layer in forward order (the order qwix creates and
# keys their adapters in): (module under the layer, weight name, the forward's einsum).
PROJECTIONS = (
    ("attn/q_proj", "w", "BTD,DNH->BTNH"),
    ("attn/k_proj", "w", "BSD,DKH->BSKH"),
    ("attn/v_proj", "w", "BSD,DKH->BSKH"),
    ("attn/o_proj", "w", "BTNH,NHD->BTD"),
    ("mlp/gate_proj", "kernel", "BTD,DF->BTF"),
    ("mlp/up_proj", "kernel", "BTD,DF->BTF"),
    ("mlp/down_proj", "kernel", "BTF,FD->BTD"),
)
# Modules with weights outside the decoder projections: LoRA on them is not implemented.
UNSUPPORTED_MODULES = ("embedder", "lm_head")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Tunix's `lora_config`: rank, alpha and the module-path regex."""

    rank: int
    alpha: float
    module_path: str

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(slots=True)
class LoraModelConfig(qwen3.ModelConfig):
    """A Tunix Qwen3 config whose param tree carries LoRA adapters."""

    lora: LoraSpec | None = None


def spec_of(cfg) -> LoraSpec | None:
    """The run's LoRA spec from our Config (`lora_rank` 0: none)."""
    if cfg.lora_rank <= 0:
        return None
    return LoraSpec(cfg.lora_rank, float(cfg.lora_alpha), cfg.lora_module_path)


def with_lora(mc: qwen3.ModelConfig, spec: LoraSpec | None) -> qwen3.ModelConfig:
    """`mc` as a LoraModelConfig carrying `spec` (unchanged when `spec` is None)."""
    if spec is None:
        return mc
    fields = {f.name: getattr(mc, f.name) for f in dataclasses.fields(qwen3.ModelConfig)}
    return LoraModelConfig(**fields, lora=spec)


def lora_of(mc) -> LoraSpec | None:
    return getattr(mc, "lora", None)


def targets(mc: qwen3.ModelConfig, module_path: str) -> list[tuple[int, str, str, str]]:
    """(layer, module, weight name, einsum) of every projection `module_path` fully matches,
    in qwix's creation order. Raises ConfigError naming the problem when it matches none, or a
    module whose LoRA is not implemented."""
    pattern = re.compile(module_path)
    others = [m for m in UNSUPPORTED_MODULES if pattern.fullmatch(m)]
    if others:
        raise ConfigError(f"lora_module_path={module_path!r} matches {', '.join(others)}: LoRA "
                         "is implemented for the decoder projections only (layers/N/attn/"
                         "{q,k,v,o}_proj, layers/N/mlp/{gate,up,down}_proj)")
    if mc.num_experts:
        raise ConfigError("LoRA is implemented for dense Qwen3 only (num_experts is set)")
    out = [(i, module, weight, spec) for i in range(mc.num_layers)
           for module, weight, spec in PROJECTIONS if pattern.fullmatch(f"layers/{i}/{module}")]
    if not out:
        raise ConfigError(
            f"lora_module_path={module_path!r} fully matches none of Tunix Qwen3's projection "
            "modules (e.g. layers/0/attn/q_proj, layers/0/mlp/gate_proj); Tunix's run_qwen3.sh "
            "uses '.*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj'")
    return out


def _einsum_parts(spec: str) -> tuple[str, str, str]:
    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")
    return lhs, rhs, out


def adapter_layout(spec: str, w_shape: tuple[int, ...], rank: int):
    """qwix's adapter shapes for weight `w_shape` under einsum `spec`: A takes the contracted
    dims then rank, B rank then the rest. Returns (a_shape, b_shape, a_dims, b_dims), where
    a_dims/b_dims index the weight dim each adapter dim inherits its sharding from."""
    lhs, rhs, _ = _einsum_parts(spec)
    contracted = [i for i, c in enumerate(rhs) if c in lhs]
    rest = [i for i, c in enumerate(rhs) if c not in lhs]
    a_shape = (*(w_shape[i] for i in contracted), rank)
    b_shape = (rank, *(w_shape[i] for i in rest))
    return a_shape, b_shape, (*contracted, None), (None, *rest)


def _transposed(sharding, dims, shape) -> tuple | None:
    """The weight's sharding names carried over to an adapter (qwix: size-1 dims unsharded)."""
    if sharding is None:
        return None
    return tuple(None if d is None or n == 1 else sharding[d] for d, n in zip(dims, shape,
                                                                               strict=True))


def _place(value: jax.Array, names: tuple | None, mesh) -> jax.Array:
    """`value` (the same on every host) as a global array sharded by `names` on `mesh`."""
    if mesh is None:
        return value
    host = np.asarray(value)
    sharding = jax.NamedSharding(mesh, jax.P(*(names or ())))
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def add_adapters(model: qwen3.Qwen3, mesh: jax.sharding.Mesh | None = None) -> qwen3.Qwen3:
    """Adds the adapters of `model.config.lora` to `model` in place (sharded on `mesh`): the
    params Tunix's `apply_lora_to_model` creates, with its initial values. Returns `model`."""
    spec = lora_of(model.config)
    init_a = jax.nn.initializers.he_uniform()
    key = jax.random.key(QWIX_DEFAULT_SEED)
    for j, (layer, module_path, weight, einsum) in enumerate(
            targets(model.config, spec.module_path)):
        module = model.layers[layer]
        for name in module_path.split("/"):
            module = getattr(module, name)
        w = getattr(module, weight)
        sharding = w.get_metadata().get("out_sharding")
        a_shape, b_shape, a_dims, b_dims = adapter_layout(einsum, w.shape, spec.rank)
        # qwix draws one key per adapter param in creation order: A then B.
        a = init_a(jax.random.fold_in(key, 2 * j), a_shape, w.dtype)
        b = jnp.zeros(b_shape, w.dtype)
        for suffix, value, dims in (("_lora_a", a, a_dims), ("_lora_b", b, b_dims)):
            names = _transposed(sharding, dims, value.shape)
            setattr(module, weight + suffix,
                    nnx.LoRAParam(_place(value, names, mesh), out_sharding=names))
    return model


def has_adapters(module_params: dict, weight: str) -> bool:
    return weight + "_lora_a" in module_params


def delta(x: jax.Array, module_params: dict, weight: str, spec: str, dtype, scale: float
          ) -> jax.Array:
    """The adapters' term of a projection: (x @ A) @ B * scale, contracted as the weight is
    by `spec` (qwix's LoRA einsum), in the compute `dtype`."""
    lhs, rhs, out = _einsum_parts(spec)
    a_str = "".join(c for c in rhs if c in lhs) + LORA_DIM
    b_str = LORA_DIM + "".join(c for c in rhs if c not in lhs)
    mid = "".join(c for c in lhs if c not in rhs) + LORA_DIM
    a = module_params[weight + "_lora_a"].astype(dtype)
    b = module_params[weight + "_lora_b"].astype(dtype)
    xa = jnp.einsum(f"{lhs},{a_str}->{mid}", x.astype(dtype), a)
    return jnp.einsum(f"{mid},{b_str}->{out}", xa, b) * scale

