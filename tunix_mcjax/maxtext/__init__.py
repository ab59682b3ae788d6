"""MaxText adapter: `rl_runtime=mcjax` on MaxText's RL trainer runs GRPO on this runtime.

MaxText's `train_rl.main` (patched, see patches/maxtext/0002) hands the run to the entry point
`mcjax` of the `maxtext.rl_runtimes` group, `main` below, before any JAX backend exists. On every
host: `jax.distributed` first, then MaxText's RL config, checked key by key (`config_map`), then
MaxText's model as the trainer's policy (`policy`), MaxText's data and rewards (`data`), and the
colocated step loop with a per-host engine decoding the same weights as Tunix Qwen3. With
`rl.use_agentic_rollout=true` the rollouts are multi-turn (`agentic`): MaxText's chat parser
renders the conversations of each host's agents and environments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from tunix_mcjax import logs, topology
from tunix_mcjax.config import Config

FACTS_FILE = "maxtext_adapter_host{host}.json"
_WATCHED_MODULES = ("vllm", "tpu_inference")


def main(argv: Sequence[str], kwargs: dict | None = None) -> None:
    """MaxText's `rl_runtime=mcjax`: `argv` is train_rl's (program, [config.yml], key=value...)."""
    from tunix_mcjax.run import guarded

    quiet = not full_logs(argv, kwargs or {})
    if quiet:
        logs.quiet_library_logs()
    topo = topology.initialize_from_env()
    if quiet and not topo.is_leader:
        logs.quiet_library_logs(errors_only=True)
    code = guarded(topo, lambda: run(argv, kwargs or {}, topo))
    if code:
        sys.exit(code)


def full_logs(argv: Sequence[str], kwargs: dict) -> bool:
    """MaxText's `debug=true`: every library's logs, as MaxText prints them (see `logs`)."""
    from maxtext.configs import pyconfig

    return str(pyconfig.read_raw_key(list(argv), "debug", **kwargs)).lower() == "true"


def load_maxtext_config(argv: Sequence[str], kwargs: dict) -> tuple[Any, Any]:
    """(MaxText's RLConfig for this run, MaxText's defaults for the same model)."""
    from maxtext.configs import pyconfig, types
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    config = pyconfig.initialize_pydantic(list(argv), config_class=types.RLConfig, **kwargs)
    config = config.model_copy(update={
        "load_parameters_path": absolute_path(config.load_parameters_path)})
    rl_yml = os.path.join(MAXTEXT_CONFIGS_DIR, "post_train", "rl.yml")
    with _without_maxtext_env():
        default = pyconfig.initialize_pydantic(
            ["", rl_yml, f"model_name={config.model_name}", "log_config=false",
             f"base_output_directory={config.base_output_directory}"],
            config_class=types.RLConfig)
    return config, default


def absolute_path(path: str) -> str:
    """A local path made absolute (Orbax reads absolute paths only); URLs (gs://...) and ""
    as they are. Paths go through etils.epath, as MaxText and Orbax read them."""
    from etils import epath

    if not path or "://" in path:
        return path
    return str(epath.Path(path).absolute())


@contextlib.contextmanager
def _without_maxtext_env() -> Iterator[None]:
    """Hides `M_<KEY>` overrides, so that keys set through them count as changed."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("M_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def checked_config(argv: Sequence[str], kwargs: dict,
                   num_hosts: int) -> tuple[Any, Config, dict[str, Any]]:
    """(MaxText's config, our Config, the changed settings that do not apply here). Raises
    ConfigError naming every setting this runtime cannot honour, before anything is built."""
    from tunix_mcjax.maxtext import adapter_keys, config_map
    from tunix_mcjax.tokenizer import resolve_tokenizer_path

    config_map.refuse_lora(argv, kwargs)
    argv, kwargs, engine = config_map.pop_rollout_engine(argv, kwargs)
    argv, kwargs, agentic = config_map.pop_agentic_keys(argv, kwargs)
    argv, kwargs, corrections = config_map.pop_correction_keys(argv, kwargs)
    argv, kwargs, rollout = config_map.pop_keys(argv, kwargs, config_map.ROLLOUT_ADAPTER_KEYS)
    adapter_keys.check_rollout_env(os.environ)
    config, default = load_maxtext_config(argv, kwargs)
    engine = engine or config_map.rollout_engine_for(config)
    adapter_keys.check_rollout_quantization(config, engine, rollout)
    changed = config_map.changed_keys(config, default)
    not_applied = config_map.check_keys(changed, engine)
    config_map.check_agentic(changed, agentic)
    config_map.check_model(config, engine)
    config_map.check_router_replay(config, corrections)
    tokenizer_path = resolve_tokenizer_path(config.tokenizer_path)
    return config, config_map.to_config(config, num_hosts, tokenizer_path, changed,
                                        engine, agentic, corrections, rollout), not_applied


def run(argv: Sequence[str], kwargs: dict, topo: topology.Topology) -> dict | None:
    """Checks MaxText's config, builds the components, runs every step; host 0 returns the
    summary."""
    from tunix_mcjax.maxtext import data
    from tunix_mcjax.runtime.colocated import ColocatedRuntime

    config, cfg, not_applied = checked_config(argv, kwargs, topo.num_hosts)
    cfg.validate_topology(topo.num_hosts, len(topo.local_devices))
    if topo.is_leader:
        _log_start(config, cfg, not_applied)
    # Built by the runtime under its watchdog: the model build waits on every host.
    summary = ColocatedRuntime(
        cfg, topo,
        components=lambda: build_components(config, data.load_tokenizer(config), topo,
                                            cfg.rollout_engine)).run()
    write_facts(cfg, topo, not_applied)
    return summary


def build_components(config: Any, tokenizer: Any, topo: topology.Topology,
                     engine: str | None = None) -> Any:
    """MaxText's model, mesh, optimizer, data, rewards and evaluation as the runtime's
    components, for `engine` (None: the model's default engine)."""
    from maxtext.trainers.post_train.rl import utils_rl

    from tunix_mcjax.maxtext import agentic, data, policy
    from tunix_mcjax.maxtext.evaluation import MaxTextEvaluator
    from tunix_mcjax.runtime.components import Components

    train_rows, test_rows = data.dataset_rows(config, tokenizer)
    task = data.maxtext_task(config, train_rows)
    evaluator = None if test_rows is None else MaxTextEvaluator(
        config, test_rows, task.reward_fns, tokenizer, topo.host, topo.num_hosts)
    model, mesh = policy.build_model(config, tokenizer.pad_token_id)
    trainer_policy, params = policy.maxtext_policy(model, config, engine)
    return Components(tokenizer=tokenizer, task=task, mesh=mesh, policy=trainer_policy,
                      params=params, engine_model_config=policy.engine_model_config(config, engine),
                      optimizer=utils_rl.get_optimizer(config), evaluator=evaluator,
                      chat_parser=agentic.chat_parser(config, tokenizer)
                      if config.rl.use_agentic_rollout else None)


def _log_start(config: Any, cfg: Config, not_applied: dict[str, Any]) -> None:
    print(f"rl_runtime=mcjax: {config.model_name}, {cfg.steps} steps of {cfg.batch_size} prompts "
          f"x {cfg.num_generations} generations, run dir {cfg.run_dir}", flush=True)
    if not_applied:
        print("rl_runtime=mcjax: these settings are for the Pathways/vLLM path and do not apply "
              f"here: {', '.join(not_applied)}", flush=True)


def write_facts(cfg: Config, topo: topology.Topology, not_applied: dict[str, Any]) -> None:
    """Per host: the Config the run used, the settings that did not apply, and whether vLLM or
    tpu-inference were ever imported."""
    facts = {
        "host": topo.host,
        "num_hosts": topo.num_hosts,
        "config": dataclasses.asdict(cfg),
        "not_applied": not_applied,
        "modules_imported": {m: m in sys.modules for m in _WATCHED_MODULES},
    }
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    path = cfg.run_dir / FACTS_FILE.format(host=topo.host)
    path.write_text(json.dumps(facts, indent=2, default=str) + "\n")
