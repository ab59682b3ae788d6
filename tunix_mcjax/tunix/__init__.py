"""Tunix adapter: `python -m tunix.cli.grpo_main ... rl_runtime=mcjax` runs GRPO on this runtime.

Tunix's `grpo_main` (patched, see patches/tunix/0001) hands the run to the entry point `mcjax`
of the `tunix.rl_runtimes` group, `main` below, before any JAX backend exists. On every host:
`jax.distributed` first, then Tunix's own config (`GrpoPipeline`), checked key by key
(`config_map`), Tunix's tokenizer, dataset and reward functions (`data`), the Qwen3 checkpoint
(`model`), Tunix's optimizer and schedule, and the colocated step loop with a per-host engine.

Under a cluster launcher (one process per host) `jax.distributed.initialize()` finds the peers.
On one machine, `TUNIX_MCJAX_HOSTS=H` (and `TUNIX_MCJAX_DEVICES_PER_HOST=D`, default 1) makes
this process start H local JAX processes of the same command, as `tunix_mcjax.launch` does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from tunix_mcjax import logs, topology
from tunix_mcjax.config import Config, ConfigError

FACTS_FILE = "tunix_adapter_host{host}.json"
HOSTS_ENV, DEVICES_ENV = "TUNIX_MCJAX_HOSTS", "TUNIX_MCJAX_DEVICES_PER_HOST"
GRPO_MAIN = "tunix.cli.grpo_main"
_WATCHED_MODULES = ("vllm", "tpu_inference", "sglang_jax")


def main(argv: Sequence[str], kwargs: dict | None = None) -> None:
    """Tunix's `rl_runtime=mcjax`: `argv` is grpo_main's (program, base config, key=value...)."""
    from tunix_mcjax.run import guarded

    argv, kwargs = list(argv), dict(kwargs or {})
    logs.quiet_library_logs()
    try:
        local = local_topology()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if local is not None and "TUNIX_MCJAX_COORDINATOR" not in os.environ:
        sys.exit(launch_local(argv, kwargs, *local))
    topo = topology.initialize_from_env()
    if not topo.is_leader:
        logs.quiet_library_logs(errors_only=True)
    code = guarded(topo, lambda: run(argv, kwargs, topo))
    if code:
        sys.exit(code)


def local_topology() -> tuple[int, int] | None:
    """(hosts, devices per host) asked for by TUNIX_MCJAX_HOSTS / _DEVICES_PER_HOST, or None."""
    if HOSTS_ENV not in os.environ:
        return None
    try:
        hosts, devices = int(os.environ[HOSTS_ENV]), int(os.environ.get(DEVICES_ENV, "1"))
    except ValueError as e:
        raise ConfigError(f"{HOSTS_ENV} and {DEVICES_ENV} must be integers: {e}") from e
    if hosts < 1 or devices < 1:
        raise ConfigError(f"{HOSTS_ENV}={hosts} and {DEVICES_ENV}={devices} must be >= 1")
    return hosts, devices


def launch_local(argv: list[str], kwargs: dict, hosts: int, devices: int) -> int:
    """Checks the config, then runs grpo_main's command as H local JAX processes."""
    from tunix_mcjax.launch import launch

    try:
        if kwargs:
            raise ConfigError(f"grpo_main keyword arguments {sorted(kwargs)} cannot reach "
                              "local processes; pass them as key=value arguments")
        config = pipeline_config(argv, kwargs)
        not_applied = checked(config, hosts * devices)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"rl_runtime=mcjax: {hosts} local hosts x {devices} devices; {len(not_applied)} "
          "Tunix settings do not apply (host 0 lists them)", flush=True)
    return launch(argv[1], argv[2:], hosts, devices, module=GRPO_MAIN)


def pipeline(argv: Sequence[str], kwargs: dict) -> Any:
    """Tunix's own config and pipeline (`grpo_main.GrpoPipeline`); touches no JAX backend."""
    try:
        return grpo_main_module().GrpoPipeline(list(argv), **kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"Tunix's config: {e}") from e


def grpo_main_module() -> Any:
    """Tunix's grpo_main: `__main__` under `python -m tunix.cli.grpo_main` (importing it again
    would define its absl flags twice), else the imported module."""
    import importlib

    main_module = sys.modules.get("__main__")
    if getattr(getattr(main_module, "__spec__", None), "name", None) == GRPO_MAIN:
        return main_module
    return importlib.import_module(GRPO_MAIN)


def pipeline_config(argv: Sequence[str], kwargs: dict) -> dict:
    from tunix_mcjax.tunix import config_map

    return config_map.plain(pipeline(argv, kwargs).config)


def checked(config: dict, num_devices: int) -> dict[str, str]:
    """Refuses what this runtime cannot honour; returns the keys that do not apply."""
    from tunix_mcjax.tunix import config_map

    not_applied = config_map.check(config)
    config_map.check_devices(config, num_devices)
    return not_applied


@dataclasses.dataclass
class Run:
    """What one host builds from Tunix's config before any device work."""

    cfg: Config
    pipeline: Any
    tokenizer: Any
    stream: list[dict]
    test_rows: list[dict]
    reward_fns: list[Any]
    not_applied: dict[str, str]


def prepare(argv: Sequence[str], kwargs: dict, topo: topology.Topology | None) -> Run:
    """Tunix's config checked and mapped, its tokenizer, data and rewards; the checkpoint found
    (downloaded when `topo` is given and it is missing)."""
    from tunix_mcjax.tunix import config_map, data, model

    tunix = pipeline(argv, kwargs)
    config = config_map.plain(tunix.config)
    num_devices = len(topo.global_devices) if topo else config_map.mesh_devices(config)
    not_applied = checked(config, num_devices)
    tokenizer = data.load_tokenizer(tunix)
    stream, test_rows, steps = data.split_rows(tunix, tokenizer)
    directory = model.checkpoint_dir(config["actor_model_config"], topo)
    keys = model.model_keys(config["actor_model_config"], directory)
    cfg = config_map.to_config(config_map.plain(tunix.config), keys, steps)
    return Run(cfg, tunix, tokenizer, stream, test_rows, data.reward_functions(tunix),
               not_applied)


def run(argv: Sequence[str], kwargs: dict, topo: topology.Topology) -> dict | None:
    """Builds the components and runs every step; host 0 returns the summary."""
    from tunix_mcjax.runtime.colocated import ColocatedRuntime

    prep = prepare(argv, kwargs, topo)
    prep.cfg.validate_topology(topo.num_hosts, len(topo.local_devices))
    if topo.is_leader:
        cfg = prep.cfg
        print(f"rl_runtime=mcjax: {cfg.model_name}, {cfg.steps} steps of {cfg.batch_size} "
              f"prompts x {cfg.num_generations} generations, run dir {cfg.run_dir}", flush=True)
        _log_not_applied(prep.not_applied)
        left = len(prep.stream) - cfg.steps * cfg.batch_size
        if 0 < left < cfg.batch_size:
            print(f"rl_runtime=mcjax: the last {left} train rows make a partial batch, which "
                  "Tunix would train as a smaller one; every step here trains batch_size "
                  "prompts, so they are left out", flush=True)
    summary = ColocatedRuntime(prep.cfg, topo, components=lambda: build_components(prep, topo)
                               ).run()
    write_facts(prep, topo)
    return summary


def build_components(prep: Run, topo: topology.Topology) -> Any:
    """Tunix Qwen3 from the checkpoint on the global mesh, Tunix's optimizer, the train task
    and the evaluator (a cross-host build: the runtime runs it under its watchdog)."""
    from tunix_mcjax import models
    from tunix_mcjax.runtime.components import Components
    from tunix_mcjax.train.trainer import qwen3_policy
    from tunix_mcjax.tunix import data

    cfg = prep.cfg
    mesh = topology.trainer_mesh(topo)
    vocab = len(prep.tokenizer)
    model = models.build_model(cfg, models.model_config(cfg, vocab), mesh)
    policy, params = qwen3_policy(model)
    evaluator = data.TunixEvaluator(prep.test_rows, prep.reward_fns, prep.tokenizer, cfg,
                                    topo.host, topo.num_hosts) if prep.test_rows else None
    optimizer = prep.pipeline.create_optimizer("rl_training_config", "actor_optimizer_config")
    return Components(tokenizer=prep.tokenizer,
                      task=data.train_task(prep.stream, prep.reward_fns, cfg), mesh=mesh,
                      policy=policy, params=params,
                      engine_model_config=models.model_config(cfg, vocab, for_sampling=True),
                      optimizer=optimizer, evaluator=evaluator)


def _log_not_applied(not_applied: dict[str, str]) -> None:
    if not_applied:
        lines = "".join(f"\n  {k}: {why}" for k, why in not_applied.items())
        print(f"rl_runtime=mcjax: these Tunix settings do not apply here:{lines}", flush=True)


def write_facts(prep: Run, topo: topology.Topology) -> None:
    """Per host: the Config the run used, the settings that did not apply, and whether another
    rollout engine was ever imported."""
    facts = {
        "host": topo.host,
        "num_hosts": topo.num_hosts,
        "config": dataclasses.asdict(prep.cfg),
        "not_applied": prep.not_applied,
        "train_rows": len(prep.stream),
        "eval_rows": len(prep.test_rows),
        "reward_functions": [f"{f.__module__}:{f.__name__}" for f in prep.reward_fns],
        "modules_imported": {m: m in sys.modules for m in _WATCHED_MODULES},
    }
    path = prep.cfg.run_dir / FACTS_FILE.format(host=topo.host)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(facts, indent=2, default=str) + "\n")
