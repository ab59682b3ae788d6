"""The maxtext engine's decode-loop program, and a session's slice of it, for a TPU slice from
shapes only, at a MaxText RL script's keys (`python -m tunix_mcjax.aot run_gptoss_20b_rl
--topology v5p:2x4x4`).

The script's command is read from the installed script (`maxtext.recipes.script_command`) and
checked as a run checks it (`maxtext.checked_config`); `key=value` overrides follow it. The
program is `decode_loop.build_program` over `MaxTextPagedModel` (MaxText's training forward,
its layers scanned as the script's tree stacks them, our paged attention) for one replica on
the first `rollout_tensor_parallelism` devices, at a full share of the step's rollouts, as the
engine runs it on TPU: pages in `CombinedPages` (JAX's Pallas `ragged_paged_attention`), or
`CombinedXlaPages` (the same pages attended by XLA) for layers with attention sinks (gpt-oss)
or heads other than 128 wide (Gemma4); MoE kernels padded as `maxtext_tpu.tpu_config` pads
them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_mcjax import engine_plan
from tunix_mcjax.aot.programs import Program, lower_loop, lower_slice, program_shape, sds
from tunix_mcjax.aot.target import Target
from tunix_mcjax.config import Config
from tunix_mcjax.engine import pages
from tunix_mcjax.engine.maxtext_model import (
    TENSOR_AXIS,
    MaxTextPagedModel,
    decode_config,
    local_mesh,
)
from tunix_mcjax.engine.maxtext_scan import layer_major_shape, scan_layout, stacked_count
from tunix_mcjax.engine.maxtext_tpu import tpu_config
from tunix_mcjax.engine.maxtext_tree import param_specs, scan_plan
from tunix_mcjax.engine.paged_attention import CombinedPages
from tunix_mcjax.engine.sampling import SamplerSpec
from tunix_mcjax.runtime.phases import sampling_params


def script_configs(name: str, overrides: list[str], hosts: int) -> tuple[Any, Config]:
    """(MaxText's config, our Config) of MaxText's RL script `name` with `overrides` after its
    own keys, checked as a run on `hosts` hosts checks them."""
    from tunix_mcjax.maxtext import checked_config, recipes

    _, args = recipes.script_command(name)
    train_rl = recipes.script_path(name).parents[1] / "train_rl.py"
    config, cfg, _ = checked_config([str(train_rl), *args, *overrides], {}, num_hosts=hosts)
    return config, cfg


def engine_config(config: Any, cfg: Config) -> Any:
    """The engine's MaxText config on TPU, as `MaxTextEngine._model_config` makes it
    (the script's scan_layers, no remat, MoE kernels padded as `tpu_config` pads them)."""
    config = decode_config(config, batch=1, prompt_len=cfg.max_prefill_predict_length,
                           max_new=cfg.max_completion_length,
                           weight_dtype=cfg.rollout_weight_dtype or None)
    return tpu_config(config.model_copy(update={"remat_policy": "none"}))


def engine_params(config: Any, mesh) -> tuple[dict, int]:
    """(MaxText's param tree as the engine holds it, stacked leaves layer-major
    (`maxtext_scan.layer_major`), as sharded ShapeDtypeStructs; its bytes per device)."""
    stacked = scan_layout(scan_plan(config, mesh), config.num_decoder_layers).stacked
    axis = config.param_scan_axis
    tree: dict[Any, Any] = {}
    per_device = 0
    for path, (keys, shape, dtype, spec) in param_specs(config, mesh).items():
        count = stacked_count(path, stacked)
        axes = (*spec, *[None] * (len(shape) - len(spec)))
        shape, spec = layer_major_shape(shape, axis, count), P(*layer_major_shape(axes, axis,
                                                                                  count))
        leaf = sds(shape, dtype, NamedSharding(mesh, spec))
        per_device += int(np.prod(leaf.sharding.shard_shape(shape))) * np.dtype(dtype).itemsize
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = leaf
    return tree, per_device


def pool_shapes(model: MaxTextPagedModel, num_pages: int, page_size: int) -> list[Any]:
    """The engine's pool (a list over stacks of KV slots) as sharded ShapeDtypeStructs."""
    made = jax.eval_shape(lambda: model.make_pool(num_pages, page_size))
    shardings = [NamedSharding(model.mesh, spec) for spec in model.pool_specs()]
    return [jax.tree.map(lambda x, s=sharding: sds(x.shape, x.dtype, s), layer)
            for layer, sharding in zip(made, shardings, strict=True)]


def _engine(config: Any, cfg: Config, target: Target) -> tuple[Any, ...]:
    """One replica's maxtext engine for a full share at the caps, its pool as the engine sizes
    it (every slot decoded: no packed decode rows): (model, params, shape, sampler, pool,
    what it was built at)."""
    tp = cfg.rollout_tensor_parallelism
    engine_cfg = engine_config(config, cfg)
    mesh = local_mesh(engine_cfg, np.array(target.devices[:tp]))
    params, weight_bytes = engine_params(engine_cfg, mesh)
    model = MaxTextPagedModel(engine_cfg, mesh, CombinedPages(mesh, TENSOR_AXIS))
    one_page = model.page_bytes(cfg.vllm_block_size or pages.DEFAULT_PAGE_SIZE, tp)
    paged = engine_plan.paged_shape_of(cfg, target.cluster(), one_page, weight_bytes)
    shape = program_shape(cfg, paged, pack_decode_rows=False)
    spec = SamplerSpec.of(sampling_params(cfg), engine_cfg.vocab_size)
    pool = pool_shapes(model, shape.num_pages, shape.page_size)
    layouts = sorted({type(layout).__name__ for layout in model.layouts.values()})
    facts = {"weight_bytes_per_device": weight_bytes, "num_pages": shape.num_pages,
             "num_slots": shape.num_slots, "num_requests": shape.num_requests,
             "prompt_len": shape.prompt_len, "max_new": shape.max_new,
             "page_size": shape.page_size, "tensor_parallelism": tp, "page_layouts": layouts,
             "layers": engine_cfg.num_decoder_layers, "scanned_layers": model.scan.scanned,
             "dtype": str(jnp.dtype(model.dtype))}
    return model, params, shape, spec, pool, facts


def engine_loop(config: Any, cfg: Config, target: Target) -> tuple[Program, dict]:
    """The maxtext engine's decode loop for one replica, and what it was built at."""
    model, params, shape, spec, pool, facts = _engine(config, cfg, target)
    lowered, args = lower_loop(model, shape, spec, params, pool, model.config.vocab_size)
    return Program("maxtext engine decode loop", "generate", lowered, args, None), facts


def engine_slice(config: Any, cfg: Config, target: Target) -> Program:
    """The maxtext engine's session slice for one replica (`programs.lower_slice`)."""
    model, params, shape, spec, pool, _ = _engine(config, cfg, target)
    lowered, args = lower_slice(model, shape, spec, params, pool, model.config.vocab_size)
    return Program("maxtext engine slice", "generate", lowered, args, None)
