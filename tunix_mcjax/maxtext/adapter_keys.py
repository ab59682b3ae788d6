"""Our keys that MaxText has none for, given on train_rl's command line and read by the MaxText
adapter (`rollout_engine`, the agentic environment's, the rollout-trainer corrections', the
rollout engine's quantization), and the refusal of LoRA keys there."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tunix_mcjax.config import ConfigError, parse_overrides

ROLLOUT_ENGINE_KEY = "rollout_engine"


def _pop_key(argv: Sequence[str], kwargs: dict, key: str
             ) -> tuple[list[str], dict, str | None]:
    """(argv, kwargs) without `key=...`, and its last value (None if unset)."""
    prefix = f"{key}="
    values = [a[len(prefix):] for a in argv if a.startswith(prefix)]
    kwargs = dict(kwargs)
    if key in kwargs:
        values.append(str(kwargs.pop(key)))
    return [a for a in argv if not a.startswith(prefix)], kwargs, (values[-1] if values else None)


def pop_rollout_engine(argv: Sequence[str], kwargs: dict
                       ) -> tuple[list[str], dict, str | None]:
    """(argv, kwargs) without `rollout_engine=...`, and its value (None if unset: then the
    adapter picks the engine by model, `rollout_engine_for`)."""
    return _pop_key(argv, kwargs, ROLLOUT_ENGINE_KEY)


# Our agentic keys that MaxText has none for, given on train_rl's command line and read by this
# adapter: the conversation's agent and environment (default: MaxText's own, a ModelAgent and a
# TaskEnvironment, `maxtext.agentic.task_conversation`), one turn's tokens, the tools' budget.
DEFAULT_ENVIRONMENT = "tunix_mcjax.maxtext.agentic:task_conversation"
AGENTIC_ADAPTER_KEYS = ("agentic_environment", "agentic_max_turn_tokens",
                        "agentic_tool_timeout_s", "agentic_keep_pages")


def pop_keys(argv: Sequence[str], kwargs: dict, keys: tuple[str, ...]
              ) -> tuple[list[str], dict, dict[str, Any]]:
    """(argv, kwargs) without `keys`, and the values given for them (parsed as YAML scalars,
    as MaxText parses its own)."""
    argv, found = list(argv), []
    for key in keys:
        argv, kwargs, value = _pop_key(argv, kwargs, key)
        if value is not None:
            found.append(f"{key}={value}")
    return argv, kwargs, parse_overrides(found)


def pop_agentic_keys(argv: Sequence[str], kwargs: dict
                     ) -> tuple[list[str], dict, dict[str, Any]]:
    """(argv, kwargs) without `AGENTIC_ADAPTER_KEYS`, and the values given for them."""
    return pop_keys(argv, kwargs, AGENTIC_ADAPTER_KEYS)


# Our rollout-trainer corrections, which MaxText has no keys for (docs/mismatch.md), given on
# train_rl's command line under our names and read by this adapter.
CORRECTION_ADAPTER_KEYS = ("sampler_is", "sampler_is_threshold", "rollout_rs",
                           "rollout_rs_threshold", "rollout_rs_threshold_lower",
                           "moe_router_replay")


# Taken off MaxText's config (it would quantize the trainer, its KV cache): the engine's only.
ROLLOUT_ADAPTER_KEYS = ("quantization", "quantize_kvcache", "kv_quant_dtype", "kv_quant_axis")


def check_rollout_env(environ: Mapping[str, str]) -> None:
    """Raises ConfigError for MaxText's `M_<KEY>` override of a `ROLLOUT_ADAPTER_KEYS` key.
    MaxText 0.2.5 applies an `M_<KEY>` only to a key that a YAML file of the run sets (rl.yml
    sets none of these, so MaxText drops it without a word); where one does, it would quantize
    MaxText's trainer too."""
    given = [f"{env}={environ[env]}" for key in ROLLOUT_ADAPTER_KEYS
             if (env := f"M_{key.upper()}") in environ]
    if given:
        raise ConfigError(
            f"{', '.join(given)}: MaxText applies an M_<KEY> override only to a key its YAML "
            "files set (rl.yml sets none of these: it would be dropped), and there it would "
            "quantize the trainer too. Pass them on train_rl's command line instead "
            "(quantization=..., quantize_kvcache=true, kv_quant_dtype=...): the rollout "
            "engine's only")


def check_rollout_quantization(config: Any, rollout_engine: str,
                               rollout: Mapping[str, Any]) -> None:
    """Raises ConfigError for `quantization` on a model whose kernels the maxtext engine does
    not quantize (`engine.maxtext_quantize.check_family`), before anything is built."""
    from tunix_mcjax.engine import maxtext_quantize

    if rollout_engine == "maxtext" and rollout.get("quantization"):
        try:
            maxtext_quantize.check_family(config, str(rollout["quantization"]))
        except ValueError as e:
            raise ConfigError(str(e)) from e


def check_router_replay(config: Any, corrections: dict[str, Any]) -> None:
    """Raises ConfigError for moe_router_replay on a model without routed experts."""
    if corrections.get("moe_router_replay") and int(config.num_experts) <= 1:
        raise ConfigError(f"moe_router_replay=true, but model_name={config.model_name} is "
                          "dense (num_experts=1): there is no routing to replay; drop it")


def pop_correction_keys(argv: Sequence[str], kwargs: dict
                        ) -> tuple[list[str], dict, dict[str, Any]]:
    """(argv, kwargs) without `CORRECTION_ADAPTER_KEYS`, and the values given for them."""
    return pop_keys(argv, kwargs, CORRECTION_ADAPTER_KEYS)


# LoRA: MaxText's RL config has no LoRA keys (its SFT's `lora.*` section, or ours).
LORA_KEYS = ("lora.", "lora_rank=", "lora_alpha=", "lora_module_path=")


def refuse_lora(argv: Sequence[str], kwargs: dict) -> None:
    """Raises ConfigError when the MaxText command line asks for LoRA (MaxText's policy
    trains every param here; LoRA runs through Tunix's CLI or tunix_mcjax.launch)."""
    asked = [a for a in argv if a.startswith(LORA_KEYS)] + \
        [f"{k}={v}" for k, v in kwargs.items() if f"{k}=".startswith(LORA_KEYS)]
    if asked:
        raise ConfigError(
            f"{', '.join(asked)}: LoRA is not supported under the MaxText adapter (MaxText's "
            "policy trains every param). Run LoRA through Tunix's CLI (python -m "
            "tunix.cli.grpo_main ... rl_runtime=mcjax with lora_config.*) or tunix_mcjax.launch "
            "with lora_rank, lora_alpha, lora_module_path.")
