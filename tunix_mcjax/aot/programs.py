"""Every program a step runs, built from shapes only (no weights, no arrays) on a `Target`.

- `train_step`: the trainer's own step (`Trainer.lower`), FSDP over every device of the slice,
  at the recipe's micro-batching and remat, with an `AbstractTrainer` holding shapes.
- `engine_loop`: the jax engine's decode-loop program (`decode_loop.build_program`) for one
  replica at the planner's shapes for a full share (`engine_plan.paged_shape`), on the TPU page
  layout (`CombinedPages`, JAX's Pallas `ragged_paged_attention`).
- `engine_slice`: the same loop as a session runs it (`engine.session`: streamed rewards,
  in-flight weight updates, kept agentic pages), a slice over a state kept on the devices
  (`decode_loop.build_advance`).
- `decode_step`: one decode step of that engine alone (every row at mid-completion), for XLA's
  cost analysis.
- `publish`: the reshard to replicated that `publish.Publisher` runs, when the train step does
  not already end with the params gathered (the flat step's all-gather).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tunix.models.qwen3 import model as qwen3

from tunix_mcjax import engine_plan, models, plan
from tunix_mcjax.aot import PROGRAMS
from tunix_mcjax.aot.target import Target
from tunix_mcjax.config import Config
from tunix_mcjax.engine import jax_engine, pages, quantize
from tunix_mcjax.engine.buckets import pow2_at_least
from tunix_mcjax.engine.decode_loop import build_advance, build_program, initial_state
from tunix_mcjax.engine.jax_engine import MAX_STOP_IDS
from tunix_mcjax.engine.layer_stack import LAYERS, layer_of
from tunix_mcjax.engine.loop_state import Inputs, ProgramShape
from tunix_mcjax.engine.paged_attention import layout_for
from tunix_mcjax.engine.qwen3_forward import PagedRows, Qwen3PagedModel
from tunix_mcjax.engine.sampling import SamplerSpec, sample
from tunix_mcjax.engine.trees import unflatten_tree
from tunix_mcjax.publish import Publisher
from tunix_mcjax.runtime.phases import sampling_params
from tunix_mcjax.train import lora
from tunix_mcjax.train.layer_runs import run_key
from tunix_mcjax.train.trainer import BATCH_KEYS, Trainer, qwen3_policy


@dataclasses.dataclass
class Program:
    """A program lowered for the target, with what it is compared against."""

    name: str
    phase: str  # the planner's phase it runs in (generate, train, publish)
    lowered: jax.stages.Lowered
    args: Any  # its arguments (sharded ShapeDtypeStructs)
    resident: Any  # what other programs hold on each device meanwhile (their state)


def sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


class AbstractTrainer(Trainer):
    """The Trainer with shapes for params and state: its step lowers, nothing runs. Device
    memory (gather-once under `auto`) is the target's HBM, not the host's."""

    def __init__(self, cfg: Config, policy, params, mesh, device_bytes: int, tx=None):
        self._device_bytes = device_bytes
        super().__init__(cfg, policy, params, mesh, tx=tx)

    def device_memory_bytes(self) -> int:
        return self._device_bytes

    def _make_state(self, fn, shardings, *args):
        return jax.tree.map(lambda s, sharding: sds(s.shape, s.dtype, sharding),
                            jax.eval_shape(fn, *args), shardings)

    def full_params(self):
        return self._make_state(self._gather, self.gathered, self.params)

    def _ref_full_params(self):
        if self.ref_params is None:
            return None
        return self._make_state(self._gather, self.gathered, self.ref_params)


def abstract_policy(cfg: Config, mc: qwen3.ModelConfig, mesh):
    """(policy, params as sharded ShapeDtypeStructs) of the run's Tunix Qwen3, by its own
    partition specs (as `models.create_model` shards it)."""
    def build():
        model = qwen3.Qwen3(mc, rngs=nnx.Rngs(0))
        return lora.add_adapters(model) if lora.lora_of(mc) else model

    policy, params = qwen3_policy(nnx.eval_shape(build))
    specs = nnx.get_partition_spec(params)
    return policy, jax.tree.map(lambda x, spec: sds(x.shape, x.dtype, NamedSharding(mesh, spec)),
                                params, specs)


def train_batch(trainer: Trainer, layout: plan.TrainLayout, row_len: int) -> dict:
    """The step's batch [micro-batches, rows, T], rows over fsdp, at the plan's worst case."""
    devices = trainer.mesh.devices.size
    shape = (layout.micro_batches, layout.micro_rows * devices, row_len)
    floats = ("loss_mask", "advantages", "old_logps", "weights")
    return {k: sds(shape, jnp.float32 if k in floats else jnp.int32, trainer.batch_sharding)
            for k in BATCH_KEYS}


def train_step(cfg: Config, target: Target, mc, p: plan.Plan) -> tuple[Program, Trainer]:
    mesh = target.trainer_mesh()
    policy, params = abstract_policy(cfg, mc, mesh)
    trainer = AbstractTrainer(cfg, policy, params, mesh, target.chip.hbm_bytes)
    batch = train_batch(trainer, p.layout, cfg.max_target_length)
    lowered = trainer.lower(batch)
    args = (trainer.params, trainer.opt_state, trainer.ref_params, batch,
            trainer.full_params() if trainer.flat is not None else None)
    return Program("train step", "train", lowered, args, None), trainer


def engine_params(mc, mesh, quantization: str = "") -> dict:
    """The engine's param tree as sharded ShapeDtypeStructs (`JaxEngine`'s specs), its decoder
    layers stacked as the scanned forward takes them (`layer_stack`), quantized as the engine
    holds them under `quantization` (`engine.quantize`)."""
    tp, flat = mesh.shape["tp"], {}
    for path, spec in jax_engine._leaf_specs(mc, tp).items():
        found = layer_of(path)
        if found is None:
            flat[path] = quantize.abstract_leaf(path, sds(
                spec.shape, spec.dtype, NamedSharding(mesh, spec.partition)), quantization)
        elif found[0] == 0:  # one stack per layer leaf, from layer 0's spec
            flat[found[1]] = quantize.abstract_leaf((LAYERS, run_key(0), *found[1][1:]), sds(
                (mc.num_layers, *spec.shape), spec.dtype,
                NamedSharding(mesh, P(None, *spec.partition))), quantization)
    return unflatten_tree(flat)


def engine_model(cfg: Config, target: Target, mc_train) -> tuple[Qwen3PagedModel, Any]:
    """The TPU decode model of one replica, and its param shapes."""
    mc = models.model_config(cfg, mc_train.vocab_size, for_sampling=True)
    mesh = target.replica_mesh(cfg.rollout_tensor_parallelism)
    return tpu_model(mc, mesh, pages.kv_mode_of(cfg)), engine_params(mc, mesh, cfg.quantization)


def tpu_model(mc, mesh: Mesh, kv_mode: str = "") -> Qwen3PagedModel:
    """The jax engine's decode model on a TPU replica `mesh`, with the page layout the engine
    picks there (`layout_for`: the Pallas kernel on each device's heads; quantized pages under
    `kv_mode`)."""
    return Qwen3PagedModel(mc, mesh, layout_for("tpu", mesh.devices.size, mc.head_dim,
                                                mesh=mesh, kv_heads=mc.num_kv_heads,
                                                kv_mode=kv_mode, dtype=mc.dtype))


def pool_shapes(model: Qwen3PagedModel, num_pages: int, page_size: int):
    """The engine's stacked page pool over every layer, as a sharded ShapeDtypeStruct."""
    cfg = model.cfg
    pool = jax.eval_shape(lambda: model.layout.empty(
        num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, layers=cfg.num_layers))
    sharding = NamedSharding(model.mesh, model.layout.spec("data"))
    return jax.tree.map(lambda x: sds(x.shape, x.dtype, sharding), pool)


def program_shape(cfg: Config, e: engine_plan.PagedShape, pack_decode_rows: bool = True
                  ) -> ProgramShape:
    """The decode loop's shape for the planner's full share at the caps."""
    group = pow2_at_least(min(cfg.num_generations, e.requests))
    return ProgramShape(
        num_requests=e.num_requests, num_slots=e.num_slots, num_prompts=e.num_prompts,
        prompt_len=e.prompt_len, max_new=e.max_new, page_size=e.page_size,
        num_pages=e.pool_pages, chunk=e.chunk, prefill_rows=e.prefill_rows,
        group_size=group if cfg.enable_prefix_caching else 1,
        pack_decode_rows=pack_decode_rows)


def loop_inputs(shape: ProgramShape, sharding) -> Inputs:
    i32, f32 = jnp.int32, jnp.float32
    return Inputs(
        prompts=sds((shape.num_prompts, shape.prompt_len), i32, sharding),
        prompt_lens=sds((shape.num_prompts,), i32, sharding),
        request_prompts=sds((shape.num_requests,), i32, sharding),
        request_keys=sds((shape.num_requests, 2), jnp.uint32, sharding),
        temperature=sds((), f32, sharding), top_p=sds((), f32, sharding),
        stop_ids=sds((MAX_STOP_IDS,), i32, sharding), max_new_tokens=sds((), i32, sharding))


def engine_at_caps(cfg: Config, target: Target, mc_train, p: plan.Plan
                   ) -> tuple[Qwen3PagedModel, Any, ProgramShape, SamplerSpec]:
    """The jax engine's TPU model of one replica, its param shapes, and its program's shape and
    sampler at the planner's full share."""
    model, params = engine_model(cfg, target, mc_train)
    spec = SamplerSpec.of(sampling_params(cfg), model.cfg.vocab_size)
    return model, params, program_shape(cfg, p.engine), spec


def lower_loop(model: Any, shape: ProgramShape, spec: SamplerSpec, params: Any, pool: Any,
               vocab: int) -> tuple[Any, tuple]:
    """`model`'s whole decode loop (`decode_loop.build_program`), lowered, and its arguments;
    the page pool donated and updated in place."""
    fn = build_program(model, shape, spec, None, vocab)
    args = (params, pool, loop_inputs(shape, NamedSharding(model.mesh, P())))
    with jax.sharding.use_abstract_mesh(model.mesh.abstract_mesh):
        lowered = jax.jit(fn, donate_argnums=1).lower(*args)
    return lowered, args


def engine_loop(cfg: Config, target: Target, mc_train, p: plan.Plan, resident) -> Program:
    model, params, shape, spec = engine_at_caps(cfg, target, mc_train, p)
    pool = pool_shapes(model, shape.num_pages, shape.page_size)
    lowered, args = lower_loop(model, shape, spec, params, pool, model.cfg.vocab_size)
    return Program("engine decode loop", "generate", lowered, args, resident)


def lower_slice(model: Any, shape: ProgramShape, spec: SamplerSpec, params: Any, pool: Any,
                vocab: int) -> tuple[Any, tuple]:
    """A session's slice (`SessionPrograms.advance`) of `model`'s loop, lowered, and its
    arguments: the loop state (its page pool as the pool is sharded, the rest replicated, as
    the session's start program leaves it) donated and given back in place."""
    replicated = NamedSharding(model.mesh, P())
    inputs = loop_inputs(shape, replicated)
    abstract = jax.eval_shape(lambda pool, inp: initial_state(shape, inp, pool, vocab), pool,
                              inputs)
    state = dataclasses.replace(
        jax.tree.map(lambda x: sds(x.shape, x.dtype, replicated), abstract), pool=pool)
    advance = build_advance(model, shape, spec, None)

    def run(params, state, inp, max_iterations, groups):
        state, outputs = advance(params, state, inp, max_iterations, groups)
        return state, outputs, state.requests.done

    args = (params, state, inputs, sds((), jnp.int32, replicated),
            sds((shape.num_requests,), jnp.int32, replicated))
    out_state = jax.tree.map(lambda x: x.sharding, state)
    with jax.sharding.use_abstract_mesh(model.mesh.abstract_mesh):
        lowered = jax.jit(run, donate_argnums=1, out_shardings=(out_state, None, None)).lower(
            *args)
    return lowered, args


def engine_slice(cfg: Config, target: Target, mc_train, p: plan.Plan, resident) -> Program:
    """The jax engine's session slice at the planner's shapes (`lower_slice`)."""
    model, params, shape, spec = engine_at_caps(cfg, target, mc_train, p)
    pool = pool_shapes(model, shape.num_pages, shape.page_size)
    lowered, args = lower_slice(model, shape, spec, params, pool, model.cfg.vocab_size)
    return Program("engine slice", "generate", lowered, args, resident)


def decode_rows(shape: ProgramShape, context: int, sharding) -> PagedRows:
    """One decode step's rows: every slot live, `context` tokens long after it."""
    b, i32 = shape.num_slots, jnp.int32
    return PagedRows(
        tokens=sds((b, 1), i32, sharding), positions=sds((b, 1), i32, sharding),
        write_pages=sds((b, 1), i32, sharding), write_offsets=sds((b, 1), i32, sharding),
        tables=sds((b, shape.table_pages), i32, sharding), kv_lens=sds((b,), i32, sharding),
        q_lens=sds((b,), i32, sharding), logit_cols=sds((b,), i32, sharding))


def decode_step(cfg: Config, target: Target, mc_train, p: plan.Plan) -> tuple[Program, dict]:
    """The engine's decode step alone (model and sampler over every slot), and the KV bytes
    its attention kernel reads per device with every row at mid-completion (XLA's cost
    analysis does not see inside the kernel)."""
    model, params, shape, spec = engine_at_caps(cfg, target, mc_train, p)
    replicated = NamedSharding(model.mesh, P())

    def step(params, pool, rows, keys, temperature, top_p):
        logits, pool = model.forward(params, pool, rows)
        return (*sample(spec, logits, keys, temperature, top_p, None), pool)

    context = shape.prompt_len + shape.max_new // 2
    pool = pool_shapes(model, shape.num_pages, shape.page_size)
    args = (params, pool, decode_rows(shape, context, replicated),
            sds((shape.num_slots, 2), jnp.uint32, replicated),
            sds((), jnp.float32, replicated), sds((), jnp.float32, replicated))
    with jax.sharding.use_abstract_mesh(model.mesh.abstract_mesh):
        lowered = jax.jit(step, donate_argnums=1).lower(*args)
    mc, tp = model.cfg, model.mesh.shape["tp"]
    kv_read = shape.num_slots * pages.cdiv(context, shape.page_size) * pages.page_bytes(
        mc.num_layers, mc.num_kv_heads, mc.head_dim, shape.page_size,
        np.dtype(mc.dtype).itemsize, tp)
    return (Program("engine decode step", "generate", lowered, args, None),
            {"rows": shape.num_slots, "context_tokens": context, "kv_bytes_read": kv_read})


def publish(cfg: Config, trainer: Trainer, resident) -> Program | None:
    """The reshard to replicated of `publish.Publisher` (the whole tree in one call, or its
    largest leaf per call); None when the train step's output is already gathered."""
    if trainer.engine_params_gathered:
        return None
    tree = trainer.engine_params()
    if not cfg.rl_publish_weights_single_call:
        tree = max(jax.tree.leaves(tree), key=lambda x: int(np.prod(x.shape)))
    publisher = Publisher(trainer.mesh, cfg.rl_publish_weights_single_call)
    with jax.set_mesh(trainer.mesh):
        lowered = publisher._replicate.lower(tree)
    return Program("publish", "publish", lowered, (tree,), resident)


def step_programs(cfg: Config, target: Target, mc, p: plan.Plan,
                  which: tuple[str, ...] = PROGRAMS) -> tuple[list[Program], dict]:
    """The programs `which` of a step (of PROGRAMS: the engine's loop, the train step, publish
    and the decode step alone), each with what the others hold meanwhile; and the decode step's
    KV reads (`decode_step`). The train step is built for the others' state in any case."""
    train, trainer = train_step(cfg, target, mc, p)
    engine_mc = models.model_config(cfg, mc.vocab_size, for_sampling=True)
    replica = target.replica_mesh(cfg.rollout_tensor_parallelism)
    weights = engine_params(engine_mc, replica)
    kept_pool = [] if cfg.free_kv_cache_during_weight_sync else pool_shapes(
        tpu_model(engine_mc, replica, pages.kv_mode_of(cfg)),
        p.engine.pool_pages,
        p.engine.page_size)
    train.resident = (weights, kept_pool)
    programs, kv = [], {}
    state = (trainer.params, trainer.opt_state, trainer.ref_params)
    if "engine" in which:
        programs.append(engine_loop(cfg, target, mc, p, state))
    if "slice" in which:
        programs.append(engine_slice(cfg, target, mc, p, state))
    if "train" in which:
        programs.append(train)
    gather = publish(cfg, trainer, (trainer.opt_state, trainer.ref_params, weights, kept_pool)) \
        if "publish" in which else None
    if gather is not None:
        programs.append(gather)
    if "decode" in which:
        step, kv = decode_step(cfg, target, mc, p)
        programs.append(step)
    return programs, kv
