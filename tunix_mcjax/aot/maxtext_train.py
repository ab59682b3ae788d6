"""MaxText's own train step for a TPU slice, from shapes only, at a MaxText RL script's keys
(`python -m tunix_mcjax.aot run_gptoss_20b_rl --topology v5p:2x4x4 --programs train`).

It is the step a run under `rl_runtime=mcjax` trains with (`maxtext.build_components`, then
`ColocatedRuntime`): our `Trainer` over MaxText's model as a `Policy` (`maxtext.policy`), with
MaxText's RL optimizer (`utils_rl.get_optimizer`), on MaxText's mesh over every device of the
slice (all on fsdp, `policy.check_mesh`). The model is built abstractly by MaxText's own helper
(`create_nnx_abstract_model`, as its `train_compile.py` does) and wrapped in its Tunix adapter as
`from_pretrained` wraps it; the trainer holds shapes (`programs.AbstractTrainer`); the batch is
the planner's worst case (every sequence at `max_target_length`, one a packed row).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from tunix_mcjax import memory, plan
from tunix_mcjax.aot.programs import AbstractTrainer, Program, train_batch
from tunix_mcjax.aot.target import Target, shard_bytes
from tunix_mcjax.config import Config
from tunix_mcjax.engine.buckets import pow2_at_least


def abstract_model(config: Any, mesh) -> Any:
    """MaxText's model in its Tunix adapter, its params sharded ShapeDtypeStructs on `mesh`."""
    from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter
    from maxtext.utils import model_creation_utils

    _, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
    with mesh:
        model = TunixMaxTextAdapter(base_model=model, pad_id=0)  # rows carry segment ids
    model.config = None
    return model


def trainer_mesh(config: Any, target: Target) -> Mesh:
    """The trainer's mesh as a run makes it: MaxText's over every device of the slice, all on
    fsdp (`policy.check_mesh`), in MaxText's order (on a multi-host slice it interleaves the
    hosts along fsdp; the trainer places each host's rows on its devices wherever they sit)."""
    from maxtext.utils import maxtext_utils

    from tunix_mcjax.maxtext import policy

    mesh = maxtext_utils.get_mesh_from_config(config, list(target.devices))
    policy.check_mesh(mesh)
    return mesh


def hosts_interleaved(mesh: Mesh) -> bool:
    """Whether the hosts' devices alternate along the mesh (MaxText's torus order)."""
    hosts = [d.process_index for d in mesh.devices.flat]
    return hosts != sorted(hosts)


def train_layout(cfg: Config, target: Target, trainer: AbstractTrainer) -> plan.TrainLayout:
    """The trainer's micro-batching of the planner's worst case (`plan.train_layout`): every
    host's share of the step's sequences, one a row, K a power of two per device."""
    host_sequences = cfg.global_rows // target.hosts
    k = pow2_at_least(max(1, -(-host_sequences // target.devices_per_host)))
    n, per = memory.micro_batch_rows(k, trainer.micro_batches)
    return plan.TrainLayout(trainer.gather_params_once, n, k, per)


def train_step(config: Any, cfg: Config, target: Target) -> tuple[Program, dict]:
    """MaxText's train step under our Trainer for `target`, and what it was built at."""
    import multiprocessing.pool  # noqa: F401  utils_rl uses it unimported (train_rl's imports load it)

    from maxtext.trainers.post_train.rl import utils_rl

    from tunix_mcjax.maxtext import policy

    resident = engine_weights(config, cfg, target)
    mesh = trainer_mesh(config, target)
    model = abstract_model(config, mesh)
    trainer_policy, params = policy.maxtext_policy(model, config, cfg.rollout_engine)
    trainer = AbstractTrainer(cfg, trainer_policy, params, mesh, target.chip.hbm_bytes,
                              tx=utils_rl.get_optimizer(config))
    layout = train_layout(cfg, target, trainer)
    batch = train_batch(trainer, layout, cfg.max_target_length)
    lowered = trainer.lower(batch)
    args = (trainer.params, trainer.opt_state, trainer.ref_params, batch)
    facts = {"layers": config.num_decoder_layers, "scan_layers": bool(config.scan_layers),
             "remat_policy": str(config.remat_policy), "mesh": dict(mesh.shape),
             "param_count": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
             "param_bytes_per_device": shard_bytes(trainer.params),
             "optimizer_bytes_per_device": shard_bytes(trainer.opt_state),
             "gather_params_once": trainer.gather_params_once,
             "micro_batches": layout.micro_batches, "rows_per_device": layout.micro_rows,
             "row_len": cfg.max_target_length, "reference_model": trainer.ref_params is not None,
             "mesh_hosts_interleaved": hosts_interleaved(mesh)}
    return Program("maxtext train step", "train", lowered, args, resident), facts


def engine_weights(config: Any, cfg: Config, target: Target) -> Any:
    """What the engine holds on a device through the train step: its weights (sharded
    ShapeDtypeStructs), MaxText's tree on the maxtext engine, Tunix Qwen3's on the jax engine;
    its page pool is given back before it (`free_kv_cache_during_weight_sync`)."""
    from tunix_mcjax.aot import maxtext_programs, programs
    from tunix_mcjax.engine.maxtext_model import local_mesh
    from tunix_mcjax.maxtext import policy

    if not cfg.free_kv_cache_during_weight_sync:
        raise ValueError("free_kv_cache_during_weight_sync=false keeps the engine's page pool "
                         "through the train step, which the compiled train step does not count: "
                         "compile it with free_kv_cache_during_weight_sync=true")
    if cfg.rollout_engine not in ("jax", "maxtext"):
        raise ValueError(f"rollout_engine={cfg.rollout_engine}: the compiled train step counts "
                         "the jax and maxtext engines' weights; use one of them")
    tp = cfg.rollout_tensor_parallelism
    if cfg.rollout_engine == "maxtext":
        engine_cfg = maxtext_programs.engine_config(config, cfg)
        mesh = local_mesh(engine_cfg, np.array(target.devices[:tp]))
        return maxtext_programs.engine_params(engine_cfg, mesh)[0]
    mc = policy.engine_model_config(config, cfg.rollout_engine)
    return programs.engine_params(mc, target.replica_mesh(tp))


def planner(cfg: Config, target: Target) -> plan.Plan | None:
    """The planner's plan where it has one: models whose trainer shapes are Tunix Qwen3's
    (dense Qwen3, the jax engine's); None for the others (MoE, gpt-oss, Gemma4)."""
    from tunix_mcjax.models import PRESETS

    if cfg.rollout_engine != "jax" or cfg.model_name not in PRESETS:
        return None
    return plan.plan(cfg, target.cluster(), plan.model_config_for(cfg))


def compile_train(config: Any, cfg: Config, target: Target) -> tuple[dict, dict]:
    """(the report's row, what the step was built at): compile seconds, wall and this
    process's CPU, XLA's memory analysis, the train phase's peak with the engine's weights
    beside the planner's where it has one, and whether the phase fits a device."""
    from tunix_mcjax.aot import report

    report.progress(f"{config.model_name} on {target.topology}: building MaxText's train step")
    program, facts = train_step(config, cfg, target)
    row, _ = report.compile_program(program, target, planner(cfg, target))
    return row, facts
