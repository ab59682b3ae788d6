"""One config object for a run: YAML recipe plus `key=value` overrides, MaxText key names.

Keys that MaxText has keep MaxText's name and meaning (`batch_size` is prompts per step,
`max_target_length` is prompt + completion tokens). Everything is checked up front so that a
bad recipe fails before any process touches a device.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from etils import epath


class ConfigError(ValueError):
    """A recipe or override that cannot run; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Config:
    # Run.
    run_name: str = "run"
    base_output_directory: str = "runs"
    seed: int = 0
    steps: int = 100
    log_period: int = 1
    enable_checkpointing: bool = False
    checkpoint_period: int = 50  # steps between checkpoints (and one after the last step)
    max_num_checkpoints_to_keep: int = 2

    # Model (MaxText `base_*` names for the shape of a tiny Qwen3; `model_name` picks presets).
    model_name: str = "qwen3-tiny"
    base_num_decoder_layers: int = 2
    base_emb_dim: int = 64
    base_mlp_dim: int = 128
    base_num_query_heads: int = 4
    base_num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 0  # 0: taken from the tokenizer
    rope_max_timescale: int = 10_000
    dtype: str = "float32"
    weight_dtype: str = "float32"
    init_weights_seed: int = 0
    load_parameters_path: str = ""  # a local Hugging Face safetensors dir; empty: random init

    # Tokenizer and data.
    tokenizer_type: str = "char"  # char | huggingface
    tokenizer_path: str = ""
    dataset_name: str = "next_digit"  # a built-in task, or `gsm8k` with hf_train_files
    hf_train_files: str = ""
    reward_functions: tuple[str, ...] = ()  # empty: the task's default reward
    data_repeat_period: int = 0  # >0: batches of steps 0..N-1 repeat (benchmark protocol)

    # GRPO batch and lengths.
    batch_size: int = 8  # prompts per step, global
    num_generations: int = 8
    max_prefill_predict_length: int = 8  # prompt budget (tokens)
    max_target_length: int = 12  # prompt + completion budget (tokens)
    ignore_eos: bool = False  # force every completion to its full budget (benchmarks)

    # Sampling.
    decode_sampling_strategy: str = "weighted"  # weighted | greedy
    decode_sampling_temperature: float = 1.0
    decode_sampling_top_k: int = 0  # 0: off
    decode_sampling_nucleus_p: float = 1.0  # 1.0: off

    # Rollout engine.
    # --- MaxText engine (engine/maxtext_engine.py) ---
    # jax: our decode loop over Tunix Qwen3 (dense Qwen3 only); maxtext: the same loop over
    # MaxText's own model in its KV-cache decode modes, any family MaxText trains, with the
    # trainer's own weights (runs under the MaxText adapter, which picks it for non-Qwen3 models).
    rollout_engine: str = "jax"
    # --- end MaxText engine ---
    rollout_tensor_parallelism: int = 1
    rollout_data_parallelism: int = -1  # -1: local devices / TP
    rollout_continuous_batching: bool = True
    rollout_max_batch_size: int = 64  # rows one replica decodes at once

    # --- Real shapes (engine/stops.py, plan.py) ---
    # The engine's weight dtype: float32 | bfloat16; empty: weight_dtype. bf16 halves the
    # engine's copy of the weights (python -m tunix_mcjax.plan shows what it saves).
    rollout_weight_dtype: str = ""
    # --- end real shapes ---

    # --- KV page pool (rollout_engine=jax and vllm; MaxText's key names) ---
    # Share of each device's memory the engine may hold, weights and KV page pool together
    # (the jax engine never takes more pages than every row at the caps could use). vLLM on
    # CPU sizes its pool from VLLM_CPU_KVCACHE_SPACE GiB instead (1 by default).
    hbm_utilization_vllm: float = 0.72
    # Prompt tokens one scheduler step prefills (chunked prefill); 0: the engine's default
    # (jax: 2048; vllm: vLLM's).
    max_num_batched_tokens: int = 0
    # Tokens per KV page; 0: the engine's default (jax: 16; vllm: vLLM's).
    vllm_block_size: int = 0
    # Requests with the same prompt (a GRPO group) share its KV pages, prefilled once.
    enable_prefix_caching: bool = True
    # The jax engine gives its page pool back after each rollout, so the train step has that
    # memory (the pool is zeroed again at the next rollout); false keeps it across steps.
    free_kv_cache_during_weight_sync: bool = True
    # --- end KV page pool ---

    # --- vLLM engine (rollout_engine=vllm, engine/vllm_engine.py); MaxText's key names ---
    # tpu-inference's attention data-parallel mesh axis (TPU only).
    enable_dp_attention: bool = False
    # vLLM's asynchronous scheduling (overlaps scheduling with the model step).
    async_scheduling: bool = False
    # JSON objects: vLLM's `additional_config`, and keys laid over the Hugging Face config vLLM
    # builds its Qwen3 from. Empty: none.
    vllm_additional_config: str = ""
    vllm_hf_overrides: str = ""
    # --- end vLLM engine ---

    # Optimizer (MaxText names).
    learning_rate: float = 3e-3
    warmup_steps_fraction: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.99
    adam_eps: float = 1e-8
    adam_weight_decay: float = 0.0
    gradient_clipping_threshold: float = 1.0

    # --- Trainer memory (trainer.py, memory.py) ---
    # auto | true | false. true: gather the FSDP params once per forward pass (few large
    # collectives, data-parallel compute; best for small models); false: params stay sharded
    # through compute (XLA gathers per layer; less peak memory); auto: `memory.gather_params_once`.
    fsdp_gather_params_once: str = "auto"
    # MaxText's: prompts per micro-batch (the unit of batch_size); the step's packed rows are
    # split into batch_size / train_micro_batch_size micro-batches whose gradients accumulate
    # into one update. <= 0 or == batch_size: no accumulation.
    train_micro_batch_size: int = -1
    # Tokens per device whose fp32 logits exist at once when scoring (sequence chunks, recomputed
    # in the backward); 0: all logits at once.
    train_logits_chunk_tokens: int = 2048
    # MaxText's name: "full" keeps only each decoder layer's input for the backward and
    # recomputes the layer (less activation memory, ~1/3 more compute); "none" keeps all.
    remat_policy: str = "none"
    # --- end trainer memory ---

    # --- LoRA (lora.py; Tunix's lora_config.rank / alpha / module_path, qwix's meaning) ---
    # Adapter rank; 0: full fine-tuning. > 0: only the adapters train (optimizer state for them
    # only), the engine decodes base + adapters, each publish after the first moves only the
    # adapters, and checkpoints hold the adapters (the base comes from load_parameters_path,
    # or init_weights_seed). The reference model (grpo_beta > 0) is the base without adapters.
    lora_rank: int = 0
    # Adapter scale is lora_alpha / lora_rank (qwix).
    lora_alpha: float = 64.0
    # Regex, fully matched against Tunix Qwen3 module paths such as layers/3/attn/q_proj or
    # layers/3/mlp/gate_proj (qwix's module_path). Tunix 0.1.7's run_qwen3.sh value: all seven
    # projections.
    lora_module_path: str = (".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj"
                             "|.*up_proj")
    # --- end LoRA ---

    # GRPO loss (MaxText names; Tunix semantics).
    grpo_beta: float = 0.0
    grpo_epsilon: float = 0.2
    loss_algo: str = "grpo"
    loss_agg_mode: str = "sequence-mean-token-mean"
    advantage_estimator: str = "grpo"

    # --- Shared phases: updates per batch (runtime/phases.py TrainPhase) ---
    # MaxText's rl.num_iterations (GRPO's mu, Tunix's num_iterations): optimizer updates on each
    # step's batch; after the first, off-policy (Tunix's clipped ratio against the engine's
    # logprobs of the sampled tokens). Warm-up counts updates (steps x num_iterations).
    num_iterations: int = 1
    # --- end shared phases ---

    # Runtime and the paper's optimizations O1-O4 (Appendix B).
    rl_runtime: str = "mcjax"
    rl_async_metrics_export: bool = False
    rl_gc_freeze_after_warmup: bool = False
    rl_balance_prompts_by_length: bool = False
    rl_balance_by_expected_output: bool = False
    rl_publish_weights_single_call: bool = False
    rl_metrics_queue_size: int = 1024
    collective_timeout_s: float = 300.0

    # Errors and recovery (README "Errors and recovery").
    # Budget of a cross-host phase that compiles (step 0, the first step at a new rows-per-device
    # K, start-up): compilation of a large model can outlast collective_timeout_s while healthy.
    compile_timeout_s: float = 1800.0
    # Steps whose loss or gradient norm is non-finite are never applied (params and optimizer
    # state stay as they were). 0: the first one stops the run; N: skip up to N, then stop.
    max_nonfinite_steps: int = 0
    # Prompts longer than max_prefill_predict_length are dropped (counted, as MaxText does);
    # false: one such prompt is an error.
    filter_long_prompts: bool = True

    # --- MaxText recipes: evaluation, profiler, TensorBoard (MaxText's names and meanings) ---
    # Evaluation batches (MaxText's num_test_batches; 0: none). Evaluation runs before the first
    # step, every eval_interval steps and after the last; it needs an evaluator (the MaxText
    # adapter builds one from MaxText's eval_* keys).
    num_test_batches: int = 0
    # Steps between evaluations during training; <= 0: only before and after training.
    eval_interval: int = -1
    # "" (off) | xplane: a JAX profiler trace per host under <run dir>/tensorboard/host_<h>.
    profiler: str = ""
    # Steps run before the trace starts, counted from the run's first step (a resume's too).
    skip_first_n_steps_for_profiler: int = 1
    # Steps the trace covers (it ends at the last step at the latest).
    profiler_steps: int = 5
    # Host 0 writes TensorBoard scalars (reward, accuracy, loss, KL, phase times, evaluation)
    # under <run dir>/tensorboard, flushed every log_period steps.
    enable_tensorboard: bool = False
    # --- end MaxText recipes ---

    # --- Disaggregated mode (rl_runtime=mcjax_da, runtime/disaggregated.py; paper §2, §4.4) ---
    # Share of the hosts that train (one jax.distributed group); the rest generate, one step
    # stale. The paper's splits: 0.5, 0.25, 0.125.
    rl_trainer_hosts_fraction: float = 0.5
    # Times each rollout actor may be restarted after it dies; its batch is regenerated with
    # the same policy version and seed. 0: a dead rollout actor ends the run.
    rl_rollout_restarts: int = 0
    # Size of the object store of the local Ray cluster the launcher starts (MiB); it holds one
    # published copy of the weights per version in flight and the rollout batches.
    rl_ray_object_store_mb: int = 512
    # Ray cluster the driver joins ("auto", "HEAD_IP:6379", "ray://HEAD_IP:10001"): one actor
    # per node that offers the "mcjax_host" resource. "": RAY_ADDRESS when set, else the
    # launcher starts a local cluster of its own (development).
    rl_ray_address: str = ""
    # --- end disaggregated mode ---

    # --- Tunix adapter (tunix_mcjax/tunix: Tunix's grpo_main under rl_runtime=mcjax) ---
    # Where checkpoints are saved and resumed from; "": <run dir>/checkpoints. Tunix's
    # rl_training_config.checkpoint_root_directory.
    checkpoint_directory: str = ""
    # When evaluations run (num_test_batches > 0). maxtext: before training, after every
    # eval_interval steps and after the last step (MaxText's RL trainer). tunix: Tunix's RL
    # learner, before each step whose count of finished steps divides by eval_interval (its
    # eval_every_n_steps), so before training and never after the last step.
    eval_schedule: str = "maxtext"
    # --- end Tunix adapter ---

    # Derived sizes.
    @property
    def max_completion_length(self) -> int:
        return self.max_target_length - self.max_prefill_predict_length

    @property
    def global_rows(self) -> int:
        return self.batch_size * self.num_generations

    @property
    def run_dir(self) -> epath.Path:
        """base_output_directory/run_name, through etils.epath (local paths, gs://, ...)."""
        return epath.Path(self.base_output_directory) / self.run_name

    @property
    def checkpoint_dir(self) -> epath.Path:
        if self.checkpoint_directory:
            return epath.Path(self.checkpoint_directory)
        return self.run_dir / "checkpoints"

    def replace(self, **changes: Any) -> Config:
        return load_config(None, overrides=changes, base=self)

    def disaggregated_split(self, num_hosts: int) -> tuple[int, int]:
        """(trainer hosts, rollout hosts) of `num_hosts` under rl_runtime=mcjax_da."""
        trainers = self.rl_trainer_hosts_fraction * num_hosts
        if trainers < 1 or trainers != int(trainers) or num_hosts - trainers < 1:
            raise ConfigError(
                f"rl_trainer_hosts_fraction={self.rl_trainer_hosts_fraction} of {num_hosts} hosts "
                f"is {trainers:g} trainer hosts: it must be a whole number >= 1 that leaves a "
                f"rollout host. Use --hosts {round(1 / self.rl_trainer_hosts_fraction)} or a "
                "multiple of it.")
        rollouts = num_hosts - int(trainers)
        if self.batch_size < rollouts:
            raise ConfigError(
                f"batch_size={self.batch_size} prompts per step leaves some of the {rollouts} "
                f"rollout hosts without a prompt ({num_hosts} hosts, rl_trainer_hosts_fraction="
                f"{self.rl_trainer_hosts_fraction}). Raise batch_size, or use fewer hosts.")
        if self.rl_balance_prompts_by_length and self.batch_size % rollouts:
            raise ConfigError(
                f"rl_balance_prompts_by_length=true gives every host the same number of prompts, "
                f"but batch_size={self.batch_size} does not divide by the {rollouts} rollout "
                f"hosts. Use a multiple of {rollouts}, or turn O3 off (shares then differ by "
                "at most one prompt).")
        return int(trainers), rollouts

    def validate_topology(self, num_hosts: int, local_devices: int) -> None:
        """Divisibility checks that need the cluster shape. Raises ConfigError."""
        if self.rl_runtime == "mcjax_da":
            self.disaggregated_split(num_hosts)
            num_hosts = 1  # the global batch is split over rollout hosts, checked above
        if self.batch_size % num_hosts:
            raise ConfigError(
                f"batch_size={self.batch_size} prompts per step does not divide by {num_hosts} "
                f"hosts: every host needs whole GRPO groups. Use a multiple of {num_hosts}."
            )
        tp = self.rollout_tensor_parallelism
        if local_devices % tp:
            raise ConfigError(
                f"rollout_tensor_parallelism={tp} does not divide the {local_devices} local "
                f"devices of a host. Use a divisor of {local_devices}."
            )
        dp = self.rollout_data_parallelism
        if dp != -1 and dp * tp > local_devices:
            raise ConfigError(
                f"rollout_data_parallelism={dp} x rollout_tensor_parallelism={tp} needs "
                f"{dp * tp} devices but a host has {local_devices}."
            )


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}

# Keys that change how a run executes or reports, not what it computes: a resume may change
# them. Every other key is part of a checkpoint's fingerprint (`algorithm_fingerprint`).
RUNTIME_ONLY_KEYS = frozenset({
    "run_name", "base_output_directory", "steps", "log_period", "enable_checkpointing",
    "checkpoint_period", "max_num_checkpoints_to_keep", "rl_async_metrics_export",
    "rl_gc_freeze_after_warmup", "rl_balance_prompts_by_length", "rl_balance_by_expected_output",
    "rl_publish_weights_single_call", "rl_metrics_queue_size",
    "collective_timeout_s", "compile_timeout_s", "max_nonfinite_steps",
    "rollout_continuous_batching", "rollout_max_batch_size", "rollout_data_parallelism",
    "fsdp_gather_params_once", "num_test_batches", "eval_interval", "profiler",
    "skip_first_n_steps_for_profiler", "profiler_steps", "enable_tensorboard",
    "rl_rollout_restarts", "rl_ray_object_store_mb", "rl_ray_address",
    "checkpoint_directory", "eval_schedule",
    "hbm_utilization_vllm", "max_num_batched_tokens", "vllm_block_size", "enable_prefix_caching",
    "free_kv_cache_during_weight_sync",
})


def algorithm_fingerprint(cfg: Config) -> dict[str, Any]:
    """The keys a checkpoint's state depends on, with their values (JSON-safe). `steps` may
    change on resume, but not the warm-up length it implies."""
    keys = {k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(cfg).items() if k not in RUNTIME_ONLY_KEYS}
    keys["warmup_steps"] = warmup_updates(cfg)
    return keys


def warmup_updates(cfg: Config) -> int:
    """Optimizer updates of the learning-rate warm-up: a fraction of all updates (steps x
    num_iterations), as MaxText's RL optimizer counts them."""
    return int(cfg.warmup_steps_fraction * cfg.steps * cfg.num_iterations)


def fingerprint_mismatch(saved: dict[str, Any], cfg: Config) -> list[str]:
    """'key: saved -> now' for each fingerprinted key whose value differs from `saved`."""
    now = algorithm_fingerprint(cfg)
    return [f"{k}: {saved.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}"
            for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
_CHOICES = {
    "tokenizer_type": ("char", "huggingface"),
    "decode_sampling_strategy": ("weighted", "greedy"),
    "rollout_engine": ("jax", "maxtext", "vllm"),
    "loss_algo": ("grpo", "gspo-token"),  # on-policy they are the same update (trainer.py)
    "loss_agg_mode": ("token-mean", "sequence-mean-token-mean"),
    "advantage_estimator": ("grpo",),
    "rl_runtime": ("mcjax", "single", "mcjax_da"),
    "dtype": ("float32", "bfloat16"),
    "weight_dtype": ("float32", "bfloat16"),
    "rollout_weight_dtype": ("", "float32", "bfloat16"),
    "fsdp_gather_params_once": ("auto", "true", "false"),
    "remat_policy": ("none", "full"),
    "profiler": ("", "xplane"),
    "eval_schedule": ("maxtext", "tunix"),
}
# String keys that also take a YAML boolean (true/false), read as "true"/"false".
_BOOL_OR_CHOICE = ("fsdp_gather_params_once",)


def _coerce(key: str, value: Any) -> Any:
    """Checks one value against the field's type; ints widen to floats, lists to tuples."""
    hint = typing.get_type_hints(Config)[key]
    if key in _BOOL_OR_CHOICE and isinstance(value, bool):
        return str(value).lower()
    origin = typing.get_origin(hint)
    if origin is tuple or hint is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} must be a list of strings, got {value!r}")
        return tuple(value)
    if isinstance(hint, types.UnionType):
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(
        f"{key} must be {hint.__name__}, got {type(value).__name__} {value!r}. "
        f"Example: {key}={_FIELDS[key].default!r}"
    )


def unknown_key_error(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(_FIELDS), n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key {key!r}.{hint}")


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`key=value` strings to a dict; values are parsed as YAML scalars, as MaxText does."""
    out: dict[str, Any] = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"override {arg!r} is not key=value")
        key, raw = arg.split("=", 1)
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def load_config(
    path: str | Path | None,
    overrides: dict[str, Any] | list[str] | None = None,
    base: Config | None = None,
) -> Config:
    """Builds a Config from a YAML file (or `base`) and overrides, then validates it."""
    values: dict[str, Any] = dataclasses.asdict(base) if base else {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe {path} not found")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"recipe {path} must be a YAML mapping of key: value")
        values.update(loaded)
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    values.update(overrides or {})
    for key in values:
        if key not in _FIELDS:
            raise unknown_key_error(key)
    cfg = Config(**{k: _coerce(k, v) for k, v in values.items()})
    _validate(cfg)
    return cfg


VLLM_KEYS = ("enable_dp_attention", "async_scheduling", "vllm_additional_config",
             "vllm_hf_overrides")
# The engines with a KV page pool, and the keys that size it.
PAGED_ENGINES = ("jax", "vllm")
KV_POOL_KEYS = ("hbm_utilization_vllm", "max_num_batched_tokens", "vllm_block_size",
                "enable_prefix_caching")


def json_object(cfg: Config, key: str) -> dict[str, Any]:
    """The JSON object a string key holds ({} when empty)."""
    import json

    raw = getattr(cfg, key)
    try:
        value = json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key} must be a JSON object, e.g. {key}='{{\"k\": 1}}': {e}") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a JSON object, got {raw!r}")
    return value


def _validate_vllm(cfg: Config) -> None:
    if cfg.rollout_engine != "vllm":
        changed = [k for k in VLLM_KEYS if getattr(cfg, k) != _FIELDS[k].default]
        if changed:
            raise ConfigError(f"{', '.join(changed)} configure the vLLM engine, but "
                              f"rollout_engine={cfg.rollout_engine}: set rollout_engine=vllm "
                              "or drop them")
        return
    if not cfg.rl_publish_weights_single_call:
        raise ConfigError("rollout_engine=vllm publishes the whole param tree in one call (a "
                          "partial publish is an error): set rl_publish_weights_single_call=true")
    if cfg.rl_runtime == "single":
        raise ConfigError("rl_runtime=single is the lockstep JAX baseline: use "
                          "rollout_engine=jax with it")
    for key in ("vllm_additional_config", "vllm_hf_overrides"):
        json_object(cfg, key)


def _validate_kv_pool(cfg: Config) -> None:
    if cfg.rollout_engine not in PAGED_ENGINES:
        changed = [k for k in KV_POOL_KEYS if getattr(cfg, k) != _FIELDS[k].default]
        if changed:
            raise ConfigError(f"{', '.join(changed)} size a KV page pool, but "
                              f"rollout_engine={cfg.rollout_engine} decodes MaxText's model "
                              "over a dense cache (no pool yet): drop them, or use "
                              f"rollout_engine={' or '.join(PAGED_ENGINES)}")
    if not cfg.free_kv_cache_during_weight_sync and cfg.rollout_engine != "jax":
        raise ConfigError(f"free_kv_cache_during_weight_sync=false keeps the jax engine's page "
                          f"pool across steps; rollout_engine={cfg.rollout_engine} has no such "
                          "choice here (vLLM keeps its pool): drop it")
    if not 0 < cfg.hbm_utilization_vllm <= 1:
        raise ConfigError(f"hbm_utilization_vllm must be in (0, 1] (the share of each device "
                          f"the engine may hold), got {cfg.hbm_utilization_vllm}")
    for key in ("max_num_batched_tokens", "vllm_block_size"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0 (0: the engine's default), got "
                              f"{getattr(cfg, key)}")


# --- Disaggregated mode ---
DA_KEYS = ("rl_trainer_hosts_fraction", "rl_rollout_restarts", "rl_ray_object_store_mb",
           "rl_ray_address")
DA_SPLITS = (0.5, 0.25, 0.125)
# What rl_runtime=mcjax_da does not do (yet), with the fix.
DA_REFUSED = {
    "num_test_batches": "evaluation runs in the colocated runtime only",
    "profiler": "the JAX profiler is wired into the colocated step only",
    "rl_async_metrics_export": "O1 moves the colocated metrics barrier off the step; "
                               "disaggregated metrics are written by the Ray driver, off every "
                               "actor's step already",
    "rl_balance_by_expected_output": "the output-length history lives in the colocated runtime",
}


def _validate_disaggregated(cfg: Config) -> None:
    if cfg.rl_runtime != "mcjax_da":
        changed = [k for k in DA_KEYS if getattr(cfg, k) != _FIELDS[k].default]
        if changed:
            raise ConfigError(f"{', '.join(changed)} configure rl_runtime=mcjax_da, but "
                              f"rl_runtime={cfg.rl_runtime}: set rl_runtime=mcjax_da or drop them")
        return
    if cfg.rl_trainer_hosts_fraction not in DA_SPLITS:
        raise ConfigError(f"rl_trainer_hosts_fraction={cfg.rl_trainer_hosts_fraction} is not one "
                          f"of the paper's splits {', '.join(map(str, DA_SPLITS))}")
    if cfg.rl_rollout_restarts < 0 or cfg.rl_ray_object_store_mb < 75:
        raise ConfigError("rl_rollout_restarts must be >= 0 and rl_ray_object_store_mb >= 75 "
                          "(Ray's smallest object store is 75 MB)")
    refused = [k for k in DA_REFUSED if getattr(cfg, k) != _FIELDS[k].default]
    if refused:
        raise ConfigError("rl_runtime=mcjax_da cannot honour "
                          + "; ".join(f"{k} ({DA_REFUSED[k]})" for k in refused)
                          + ". Drop them, or use rl_runtime=mcjax.")
    if cfg.rollout_engine != "jax":
        raise ConfigError(f"rl_runtime=mcjax_da runs rollout_engine=jax in its rollout actors; "
                          f"rollout_engine={cfg.rollout_engine} is colocated-only for now")
# --- end disaggregated mode ---


def _validate(cfg: Config) -> None:
    _validate_vllm(cfg)
    _validate_kv_pool(cfg)
    _validate_disaggregated(cfg)
    for key, choices in _CHOICES.items():
        if getattr(cfg, key) not in choices:
            raise ConfigError(f"{key}={getattr(cfg, key)!r} is not one of {', '.join(choices)}")
    positive = ("steps", "batch_size", "num_generations", "max_prefill_predict_length",
                "rollout_tensor_parallelism", "rl_metrics_queue_size", "checkpoint_period",
                "max_num_checkpoints_to_keep", "rollout_max_batch_size", "log_period",
                "learning_rate", "collective_timeout_s", "compile_timeout_s", "adam_eps",
                "base_num_decoder_layers", "base_emb_dim", "base_mlp_dim",
                "base_num_query_heads", "base_num_kv_heads", "head_dim")
    for key in positive:
        value = getattr(cfg, key)
        if not value > 0 or value == float("inf"):  # also refuses nan and inf
            raise ConfigError(f"{key} must be a finite number > 0, got {value}. "
                              f"Example: {key}={_FIELDS[key].default!r}")
    non_negative = ("grpo_beta", "gradient_clipping_threshold", "adam_weight_decay",
                    "max_nonfinite_steps", "data_repeat_period", "decode_sampling_top_k",
                    "vocab_size")
    for key in non_negative:
        value = getattr(cfg, key)
        if not value >= 0 or value == float("inf"):
            raise ConfigError(f"{key} must be a finite number >= 0, got {value}")
    # --- shared phases ---
    if cfg.num_iterations < 1:
        raise ConfigError(f"num_iterations must be >= 1 optimizer updates per batch (1: "
                          f"on-policy GRPO, MaxText's default), got {cfg.num_iterations}")
    # --- end shared phases ---
    if not 0 < cfg.grpo_epsilon < 1:
        raise ConfigError(f"grpo_epsilon must be in (0, 1) (the ratio is clipped to "
                          f"[1 - eps, 1 + eps]), got {cfg.grpo_epsilon}. Tunix's default: 0.2")
    if not 0 <= cfg.warmup_steps_fraction < 1:
        raise ConfigError(f"warmup_steps_fraction must be in [0, 1) (a fraction of steps), got "
                          f"{cfg.warmup_steps_fraction}")
    for key in ("adam_b1", "adam_b2"):
        if not 0 <= getattr(cfg, key) < 1:
            raise ConfigError(f"{key} must be in [0, 1), got {getattr(cfg, key)}")
    dp = cfg.rollout_data_parallelism
    if dp != -1 and dp < 1:
        raise ConfigError(f"rollout_data_parallelism must be >= 1 replicas, or -1 for local "
                          f"devices / rollout_tensor_parallelism; got {dp}")
    if cfg.rl_balance_by_expected_output and not cfg.rl_balance_prompts_by_length:
        raise ConfigError("rl_balance_by_expected_output=true refines O3's length balance, which "
                          "is off: also set rl_balance_prompts_by_length=true (or drop it)")
    if cfg.max_completion_length <= 0:
        raise ConfigError(
            f"completion budget max_target_length - max_prefill_predict_length = "
            f"{cfg.max_target_length} - {cfg.max_prefill_predict_length} = "
            f"{cfg.max_completion_length} must be > 0. Raise max_target_length."
        )
    if cfg.num_generations < 2:
        raise ConfigError("num_generations must be >= 2: GRPO advantages need a group")
    if cfg.rollout_engine == "maxtext" and cfg.rl_runtime == "single":
        raise ConfigError("rollout_engine=maxtext runs one engine per host (rl_runtime=mcjax); "
                          "rl_runtime=single's lockstep baseline is rollout_engine=jax's")
    if cfg.decode_sampling_temperature <= 0 and cfg.decode_sampling_strategy != "greedy":
        raise ConfigError("decode_sampling_temperature must be > 0 (or use "
                          "decode_sampling_strategy=greedy)")
    if not 0 < cfg.decode_sampling_nucleus_p <= 1:
        raise ConfigError("decode_sampling_nucleus_p must be in (0, 1]")
    if cfg.base_num_query_heads % cfg.base_num_kv_heads:
        raise ConfigError("base_num_query_heads must be a multiple of base_num_kv_heads")
    mb = cfg.train_micro_batch_size
    if mb > 0 and (mb > cfg.batch_size or cfg.batch_size % mb):
        raise ConfigError(
            f"train_micro_batch_size={mb} prompts per micro-batch must divide batch_size="
            f"{cfg.batch_size} (as in MaxText/Tunix). Use a divisor of {cfg.batch_size}, or -1 "
            "for no gradient accumulation.")
    if cfg.train_logits_chunk_tokens < 0:
        raise ConfigError(f"train_logits_chunk_tokens must be >= 0 (0: no chunking), got "
                          f"{cfg.train_logits_chunk_tokens}")
    _validate_lora(cfg)
    _validate_recipe_keys(cfg)
    if cfg.tokenizer_type == "huggingface" and not cfg.tokenizer_path:
        raise ConfigError("tokenizer_type=huggingface needs tokenizer_path=<dir with tokenizer>")


def _validate_lora(cfg: Config) -> None:
    """LoRA keys (lora.py): rank, scale, a regex that compiles, an engine that decodes them."""
    if cfg.lora_rank < 0:
        raise ConfigError(f"lora_rank must be >= 0 (0: full fine-tuning), got {cfg.lora_rank}")
    if not cfg.lora_rank:
        changed = [k for k in ("lora_alpha", "lora_module_path")
                   if getattr(cfg, k) != _FIELDS[k].default]
        if changed:
            raise ConfigError(f"{', '.join(changed)} configure LoRA, but lora_rank=0 (full "
                              "fine-tuning): set lora_rank > 0, or drop them")
        return
    if not cfg.lora_alpha > 0 or cfg.lora_alpha == float("inf"):
        raise ConfigError(f"lora_alpha must be a finite number > 0 (scale = alpha / rank), got "
                          f"{cfg.lora_alpha}. Tunix's run_qwen3.sh: lora_alpha=64.0")
    try:
        re.compile(cfg.lora_module_path)
    except re.error as e:
        raise ConfigError(f"lora_module_path={cfg.lora_module_path!r} is not a regex: {e}") from e
    if cfg.rollout_engine != "jax":
        raise ConfigError(f"lora_rank={cfg.lora_rank}: rollout_engine={cfg.rollout_engine} does "
                          "not decode LoRA adapters; use rollout_engine=jax")


def _validate_recipe_keys(cfg: Config) -> None:
    """Evaluation and profiler keys (MaxText's checks, with the fix named)."""
    if cfg.num_test_batches < 0:
        raise ConfigError(f"num_test_batches must be >= 0 (0: no evaluation), got "
                          f"{cfg.num_test_batches}")
    if cfg.eval_schedule == "tunix" and cfg.num_test_batches > 0 and cfg.eval_interval <= 0:
        raise ConfigError(f"eval_schedule=tunix evaluates every eval_interval steps (Tunix's "
                          f"eval_every_n_steps), which must be >= 1; got {cfg.eval_interval}")
    if cfg.profiler:
        if cfg.skip_first_n_steps_for_profiler < 0 or cfg.profiler_steps < 1:
            raise ConfigError(
                f"profiler={cfg.profiler} needs skip_first_n_steps_for_profiler >= 0 and "
                f"profiler_steps >= 1, got {cfg.skip_first_n_steps_for_profiler} and "
                f"{cfg.profiler_steps}")
        if cfg.skip_first_n_steps_for_profiler >= cfg.steps:
            raise ConfigError(
                f"profiler={cfg.profiler}: skip_first_n_steps_for_profiler="
                f"{cfg.skip_first_n_steps_for_profiler} starts the trace past the last of "
                f"steps={cfg.steps} (MaxText refuses this too). Lower it below {cfg.steps}.")
