"""What a run trains and samples with (`Components`), and building it with the run's prompts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from tunix_mcjax import models, topology
from tunix_mcjax.config import Config
from tunix_mcjax.runtime.agentic_rollouts import AgenticRollouts
from tunix_mcjax.runtime.evaluation import task_evaluator
from tunix_mcjax.runtime.phases import Prompts, RolloutPhases
from tunix_mcjax.tasks import Task, load_task
from tunix_mcjax.tokenizer import load_tokenizer
from tunix_mcjax.train.trainer import Policy, qwen3_policy


@dataclasses.dataclass
class Components:
    """What a run trains and samples with. Built from the config by default; the MaxText adapter
    supplies its own (MaxText's model as the policy, its tokenizer, data and rewards)."""

    tokenizer: Any
    task: Task
    mesh: jax.sharding.Mesh  # the trainer's global mesh; batch rows shard over its "fsdp" axis
    policy: Policy
    params: Any
    engine_model_config: Any  # the engine's: Tunix Qwen3 ModelConfig (jax), MaxText's (maxtext)
    optimizer: Any = None  # an optax transformation; None: `trainer.make_optimizer(cfg)`
    evaluator: Any = None  # a runtime.evaluation.Evaluator; needed when num_test_batches > 0
    chat_parser: Any = None  # agentic runs: `agentic.parsers.ChatParser`'s interface; None: ours


def default_components(cfg: Config, topo: topology.Topology, tokenizer, task: Task
                       ) -> Components:
    """The config's tiny Qwen3 on the global mesh (a cross-host build: run it guarded), and the
    built-in task's evaluator when num_test_batches > 0."""
    mesh = topology.trainer_mesh(topo)
    vocab = len(tokenizer)
    model = models.build_model(cfg, models.model_config(cfg, vocab), mesh)
    policy, params = qwen3_policy(model)
    return Components(tokenizer, task, mesh, policy, params,
                      models.model_config(cfg, vocab, for_sampling=True),
                      evaluator=task_evaluator(cfg, tokenizer, topo.host, topo.num_hosts))


def build(cfg: Config, topo: topology.Topology,
          components: Components | Callable[[], Components] | None,
          watchdog: topology.Watchdog) -> tuple[Components, Prompts]:
    """`components` (prebuilt, a function that builds them, or None: the config's), and the
    run's prompts. Prompts over the budget and unknown rewards fail before the model build;
    every build that waits on other hosts runs under the watchdog."""
    topology.use_compilation_cache(cfg.jax_cache_dir)
    if callable(components):
        with watchdog.guard("build", compiles=True):
            topology.arrive_together("build")  # the build's first cross-host program
            components = components()
    tokenizer = components.tokenizer if components else \
        load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
    prompts = Prompts.load(cfg, tokenizer, components.task if components else load_task(cfg),
                           topo.host)
    if components is None:
        with watchdog.guard("build", compiles=True):
            topology.arrive_together("build")
            components = default_components(cfg, topo, tokenizer, prompts.task)
    return components, prompts


# `use_agentic_rollout` -> the rollout phases' class (one template: `RolloutPhases.rollout`).
ROLLOUTS: dict[bool, type[RolloutPhases]] = {False: RolloutPhases, True: AgenticRollouts}


def rollout_phases(cfg: Config, prompts: Prompts, engine: Any, topo: topology.Topology,
                   chat_parser: Any = None) -> RolloutPhases:
    """This host's rollout phases on its engine: multi-turn (use_agentic_rollout, rendered by
    `chat_parser`, None: the config's template) or one turn."""
    extra = {"parser": chat_parser} if cfg.use_agentic_rollout else {}
    return ROLLOUTS[cfg.use_agentic_rollout](cfg, prompts, engine, topo.num_hosts, topo.host,
                                            **extra)
