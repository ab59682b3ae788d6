"""Cross-key rules of the agentic keys (sections.Agentic) and dynamic sampling: MaxText's and
Tunix's meanings, or a refusal that names the fix."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tunix_mcjax.config.fields import ConfigError

if TYPE_CHECKING:
    from tunix_mcjax.config.keys import Keys

# Keys whose meaning exists only with use_agentic_rollout=true (MaxText passes them only to
# Tunix's agentic learner); off_policy_steps is also rl_runtime=mcjax_da's staleness bound.
AGENTIC_ONLY = ("off_policy_steps", "use_rollout_logps", "force_on_policy_ratio",
                "agentic_environment", "system_prompt", "data_template_path", "max_concurrency",
                "agentic_max_turn_tokens", "agentic_tool_timeout_s", "agentic_keep_pages")


def check(cfg: Keys) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    if cfg.dynamic_sampling and cfg.rl_runtime != "mcjax":
        raise ConfigError(f"dynamic_sampling=true refills steps in the colocated runtime only; "
                          f"rl_runtime={cfg.rl_runtime}: use rl_runtime=mcjax")
    if not cfg.dynamic_sampling and cfg.dynamic_sampling_max_rounds != \
            defaults["dynamic_sampling_max_rounds"]:
        raise ConfigError("dynamic_sampling_max_rounds bounds dynamic sampling, which is off: "
                          "set dynamic_sampling=true, or drop it")
    if not cfg.use_agentic_rollout:
        _check_non_agentic(cfg, defaults)
        return
    if not cfg.agentic_environment:
        raise ConfigError(
            "use_agentic_rollout=true needs agentic_environment=package.module:function, the "
            "builder of each trajectory's agent and environment (the tool demo's: "
            "tunix_mcjax.agentic.demo:lookup_conversation)")
    if cfg.force_on_policy_ratio and cfg.num_iterations > 1:
        raise ConfigError(
            f"force_on_policy_ratio=true pins the ratio to 1, which holds for one update per "
            f"batch only (MaxText's rule): set num_iterations=1 (got {cfg.num_iterations})")
    if not cfg.use_rollout_logps and cfg.num_iterations > 1:
        raise ConfigError(
            "use_rollout_logps=false takes old logps from the trainer at the step's start, "
            "which this runtime does not recompute for later updates: set num_iterations=1 or "
            "use_rollout_logps=true (the engine's logprobs)")
    if cfg.rl_runtime != "mcjax":
        raise ConfigError(f"use_agentic_rollout=true runs in the colocated runtime only; "
                          f"rl_runtime={cfg.rl_runtime}: use rl_runtime=mcjax")
    if cfg.rollout_engine == "vllm":
        raise ConfigError("use_agentic_rollout=true decodes turns on our decode loop: use "
                          "rollout_engine=jax or maxtext")


def _check_non_agentic(cfg: Keys, defaults: dict) -> None:
    """Refuses the agentic keys set without agentic rollouts, but off_policy_steps under
    rl_runtime=mcjax_da, where it is the staleness k its schedule runs at."""
    keys = [k for k in AGENTIC_ONLY if getattr(cfg, k) != defaults[k]
            and not (k == "off_policy_steps" and cfg.rl_runtime == "mcjax_da")]
    if keys:
        also = (" and, as the staleness bound k, to rl_runtime=mcjax_da"
                if "off_policy_steps" in keys else "")
        raise ConfigError(
            f"{', '.join(keys)} apply to agentic rollouts only in the colocated runtime "
            f"(MaxText passes them to Tunix's agentic learner alone){also}: set "
            "use_agentic_rollout=true, or drop them")
