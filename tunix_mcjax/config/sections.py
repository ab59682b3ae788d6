"""The config's keys, one frozen dataclass per concern; `Config` joins them in `SECTIONS` order.

Keys that MaxText has keep MaxText's name and meaning (`batch_size` is prompts per step,
`max_target_length` is prompt + completion tokens). Each section's docstring heads its part of
the generated reference (docs/configuration-reference.md): a title line, then an introduction.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from tunix_mcjax.config.fields import Check, at_least, between, key, non_negative, positive

section = dataclasses.dataclass(frozen=True)
Dtype = Literal["float32", "bfloat16"]


@section
class Run:
    """Run

    Where a run writes, how long it is, and which runtime runs it."""

    run_name: str = key("run", "Name of the run; its directory is base_output_directory/run_name.",
                        runtime_only=True)
    base_output_directory: str = key(
        "runs", "Parent of the run directory: any path etils.epath opens (local, gs://).",
        runtime_only=True)
    seed: int = key(0, "Seed of the prompt order, sampling and evaluation.")
    jax_cache_dir: str = key(
        "", "JAX's persistent compilation cache, set in every process of the run (each host; "
        "each Ray actor under mcjax_da), so a rerun loads its programs instead of compiling "
        "them: a directory (~ expanded); empty: JAX's own setting (JAX_COMPILATION_CACHE_DIR). "
        "MaxText's key of the same name maps here, with its default ~/jax_cache.",
        runtime_only=True)
    steps: int = key(100, "Training steps (one batch and its updates each).", check=positive(),
                     runtime_only=True)
    rl_runtime: Literal["mcjax", "single", "mcjax_da"] = key(
        "mcjax", "mcjax: colocated, one process per host; single: the lockstep JAX baseline; "
        "mcjax_da: disaggregated trainer and rollout hosts on Ray.")


@section
class Data:
    """Data and rewards

    The task, its tokenizer and reward functions, and what happens to over-long prompts."""

    tokenizer_type: Literal["char", "huggingface"] = key(
        "char", "char: the built-in character tokenizer; huggingface: the one in tokenizer_path.")
    tokenizer_path: str = key(
        "", "Directory of a Hugging Face tokenizer (tokenizer_type=huggingface).")
    dataset_name: str = key(
        "next_digit", "A built-in task (next_digit), or gsm8k with hf_train_files.")
    hf_train_files: str = key("", "Local .jsonl, .json or .parquet file of question/answer rows.")
    reward_functions: tuple[str, ...] = key(
        (), "package.module:function names, called as fn(prompts=, completions=, **fields); "
        "empty: the task's default reward.")
    reward_num_workers: int = key(
        0, "Threads that score whole groups (MaxText's and Tunix's key): each group as soon as "
        "it is sampled, while the rest decode (docs/performance.md); 0: the batch after "
        "generation, in the step's thread; -1: one per CPU.", check=at_least(-1),
        runtime_only=True)
    reward_worker_timeout_seconds: float = key(
        180.0, "Budget of one group's reward functions on a worker (MaxText's and Tunix's key); "
        "a group past it ends the step with an error naming the group.", check=positive(),
        runtime_only=True)
    data_repeat_period: int = key(
        0, "N > 0: the batches of steps 0..N-1 repeat (the benchmark protocol); 0: no repeat.",
        check=non_negative())
    filter_long_prompts: bool = key(
        True, "Prompts over max_prefill_predict_length are dropped and counted, as MaxText does; "
        "false: one is an error.")


@section
class Model:
    """Model

    MaxText's `base_*` names for the model's shape (a tiny Qwen3 by default), its dtypes and
    weights."""

    model_name: str = key("qwen3-tiny", "Model preset; qwen3-tiny takes the shape keys below.")
    base_num_decoder_layers: int = key(2, "Decoder layers.", check=positive())
    base_emb_dim: int = key(64, "Embedding (hidden) width.", check=positive())
    base_mlp_dim: int = key(128, "MLP hidden width.", check=positive())
    base_num_query_heads: int = key(
        4, "Query heads; a multiple of base_num_kv_heads.", check=positive())
    base_num_kv_heads: int = key(2, "Key/value heads.", check=positive())
    head_dim: int = key(16, "Width of one attention head.", check=positive())
    vocab_size: int = key(0, "Vocabulary size; 0: taken from the tokenizer.", check=non_negative())
    rope_max_timescale: int = key(10_000, "RoPE's maximum timescale (theta).")
    dtype: Dtype = key("float32", "Activation dtype.")
    weight_dtype: Dtype = key("float32", "The trainer's weight dtype.")
    init_weights_seed: int = key(0, "Seed of the random initial weights.")
    load_parameters_path: str = key(
        "", "A local Hugging Face safetensors directory to load; empty: random init.")


@section
class Batch:
    """Batch and lengths

    The GRPO batch of a step and its token budgets."""

    batch_size: int = key(8, "Prompts per step, global.", check=positive())
    num_generations: int = key(8, "Completions per prompt (a GRPO group).",
                               check=at_least(2, "(GRPO advantages need a group)"))
    max_prefill_predict_length: int = key(8, "Prompt budget (tokens).", check=positive())
    max_target_length: int = key(
        12, "Prompt + completion budget (tokens); above max_prefill_predict_length.")
    ignore_eos: bool = key(False, "Force every completion to its full budget (benchmarks).")


@section
class Sampling:
    """Sampling

    How completions are sampled (MaxText's `decode_sampling_*` keys)."""

    decode_sampling_strategy: Literal["weighted", "greedy"] = key(
        "weighted", "weighted: sample from the (filtered) distribution; greedy: argmax.")
    decode_sampling_temperature: float = key(
        1.0, "Softmax temperature; > 0 unless decode_sampling_strategy=greedy.")
    decode_sampling_top_k: int = key(0, "Keep the k likeliest tokens; 0: off.",
                                     check=non_negative())
    decode_sampling_nucleus_p: float = key(
        1.0, "Keep the smallest set of tokens with this much probability; 1.0: off.",
        check=between(0, 1, "(]"))


@section
class Rollout:
    """Rollout engine

    The per-host engine that generates completions ([Engines](engines.md))."""

    rollout_engine: Literal["jax", "maxtext", "vllm"] = key(
        "jax", "jax: our decode loop over Tunix Qwen3 (dense Qwen3 only); maxtext: the same loop "
        "over MaxText's own model, any family MaxText trains (MaxText adapter); vllm: vLLM.")
    rollout_tensor_parallelism: int = key(
        1, "Devices one engine replica shards over; divides a host's devices.", check=positive())
    rollout_data_parallelism: int = key(
        -1, "Engine replicas per host; -1: local devices / rollout_tensor_parallelism.",
        check=Check(lambda v: v == -1 or v >= 1, ">= 1 or -1",
                    ">= 1 replicas, or -1 for local devices / rollout_tensor_parallelism"),
        runtime_only=True)
    rollout_continuous_batching: bool = key(
        True, "Decode the host's requests as one stream, refilling finished rows; false: in waves"
        " of rollout_max_batch_size.", runtime_only=True)
    rollout_max_batch_size: int = key(
        64, "Rows one replica decodes at once.", check=positive(), runtime_only=True)
    rollout_weight_dtype: Literal["", "float32", "bfloat16"] = key(
        "", "The engine's weight dtype; empty: weight_dtype. bfloat16 halves the engine's copy "
        "(python -m tunix_mcjax.plan shows what it saves).")
    quantization: Literal["", "int8", "fp8"] = key(
        "", "MaxText's name; here the rollout engine's weights only: the jax engine holds each "
        "layer's projection matrices per output channel in int8 or fp8 (e4m3) with float32 "
        "scales, quantized as a publish loads them, and an untied lm head too (embeddings and "
        "norms stay in rollout_weight_dtype). The trainer keeps full precision; under "
        "mcjax_da its leader quantizes before the put (projections: half of bf16's bytes). "
        "rollout_engine=jax, and maxtext for dense Qwen3 (its MaxText kernels; other families "
        "refused).")
    quantize_kvcache: bool = key(
        False, "MaxText's name; here the engine's KV page pool: keys and values stored in "
        "kv_quant_dtype, scaled as kv_quant_axis says. dkv: a bfloat16 absmax scale per token "
        "and kv head, dequantized by the XLA attention path, refused on TPU (the kernel cannot "
        "read those scales); tensor: fp8 under one static scale, read by the TPU kernel and by "
        "the XLA path elsewhere. rollout_engine=jax or maxtext.")
    kv_quant_dtype: Literal["int8", "fp8"] = key(
        "int8", "The KV pages' dtype under quantize_kvcache: int8, or fp8 (e4m3). MaxText's "
        "int4 is not taken.")
    kv_quant_axis: Literal["dkv", "tensor"] = key(
        "dkv", "MaxText's name: the axes one KV scale spans. dkv: one absmax scale per token and "
        "kv head, over head_dim. tensor (ours; MaxText has no such value): one static scale for "
        "all keys and one for all values, 1.0 each (vLLM's kv_cache_dtype=fp8 without "
        "calibrated scales), values clipped to fp8's +-448; fp8 only (int8 would need a "
        "calibrated scale). MaxText's heads_and_dkv is refused.")


@section
class KvPool:
    """KV page pool

    The paged KV cache of rollout_engine=jax, maxtext and vllm (MaxText's key names)."""

    hbm_utilization_vllm: float = key(
        0.72, "Share of each device the engine may hold, weights and page pool together (vLLM on "
        "CPU: VLLM_CPU_KVCACHE_SPACE GiB instead).",
        check=between(0, 1, "(]", "(the share of each device the engine may hold)"),
        runtime_only=True)
    max_num_batched_tokens: int = key(
        0, "Prompt tokens one scheduler step prefills (chunked prefill); 0: the engine's default "
        "(jax, maxtext: 2048).", check=at_least(0, "(0: the engine's default)"), runtime_only=True)
    vllm_block_size: int = key(
        0, "Tokens per KV page; 0: the engine's default (jax, maxtext: 16).",
        check=at_least(0, "(0: the engine's default)"), runtime_only=True)
    enable_prefix_caching: bool = key(
        True, "Requests with the same prompt (a GRPO group) share its KV pages, prefilled once.",
        runtime_only=True)
    free_kv_cache_during_weight_sync: bool = key(
        True, "The jax and maxtext engines give their page pool back after each rollout, so the "
        "train step has that memory; false keeps it across steps (vLLM keeps its pool).",
        runtime_only=True)


@section
class Vllm:
    """vLLM engine

    Keys of rollout_engine=vllm only (MaxText's key names)."""

    enable_dp_attention: bool = key(
        False, "tpu-inference's attention data-parallel mesh axis (TPU only).")
    async_scheduling: bool = key(False, "vLLM's asynchronous scheduling (overlaps scheduling "
                                 "with the model step).")
    vllm_additional_config: str = key("", "JSON object: vLLM's additional_config; empty: none.")
    vllm_hf_overrides: str = key(
        "", "JSON object laid over the Hugging Face config vLLM builds its Qwen3 from; "
        "empty: none.")


@section
class Algorithm:
    """Algorithm

    The GRPO loss (MaxText's names, Tunix's semantics) and the updates per batch."""

    grpo_beta: float = key(0.0, "KL penalty weight against the reference model; 0: none.",
                           check=non_negative())
    grpo_epsilon: float = key(
        0.2, "Clip range: the ratio is clipped to [1 - eps, 1 + eps] (Tunix's default 0.2).",
        check=between(0, 1, "()", "(the ratio is clipped to [1 - eps, 1 + eps])"))
    epsilon_high: float = key(
        -1.0, "Upper clip: the ratio is clipped to [1 - grpo_epsilon, 1 + epsilon_high] (DAPO's "
        "clip-higher, Tunix's epsilon_high; DAPO uses 0.28); -1: grpo_epsilon.",
        check=Check(lambda v: v == -1 or 0 < v < math.inf, "> 0 or -1",
                    "> 0 (the upper clip), or -1 for grpo_epsilon"))
    loss_algo: Literal["grpo", "gspo-token"] = key(
        "grpo", "Token-level (grpo) or sequence-level (gspo-token) importance ratio; on-policy "
        "they are the same update.")
    loss_agg_mode: Literal["token-mean", "sequence-mean-token-mean"] = key(
        "sequence-mean-token-mean", "How per-token losses are averaged into the step's loss.")
    advantage_estimator: Literal["grpo"] = key("grpo", "Group-normalised advantages (GRPO's).")
    dynamic_sampling: bool = key(
        False, "DAPO's dynamic sampling (Tunix's DAPO key): groups whose rewards are all equal "
        "are dropped and the step refills from further prompts; a step left with none is "
        "skipped.")
    dynamic_sampling_max_rounds: int = key(
        4, "Rollout rounds of a step under dynamic_sampling, the first included.",
        check=at_least(1))
    num_iterations: int = key(
        1, "Optimizer updates on each step's batch (MaxText's rl.num_iterations, GRPO's mu); "
        "after the first, off-policy against the engine's logprobs.",
        check=at_least(1, "optimizer updates per batch (1: on-policy GRPO, MaxText's default)"))


@section
class RolloutCorrection:
    """Rollout correction

    Corrections of the policy term for the engine's and the trainer's logprobs differing
    (Tunix main's `sampler_is` keys, verl's `rollout_rs` keys; [Rollout and trainer
    mismatch](mismatch.md)). All off by default; the mismatch itself is measured every step."""

    sampler_is: Literal["none", "token", "sequence"] = key(
        "none", "Truncated importance sampling (TIS): the policy term of each token is weighted "
        "by min(p_trainer / p_rollout, sampler_is_threshold), the ratio of the token (Tunix's "
        "\"token\") or of its whole sequence (verl's rollout_is=\"sequence\"), and the "
        "clipped ratio is taken against the trainer's own logprobs; none: off.")
    sampler_is_threshold: float = key(
        2.0, "The TIS cap: the largest weight (Tunix's default 2.0).", check=positive())
    rollout_rs: Literal["none", "token", "sequence"] = key(
        "none", "Masked importance sampling (MIS, verl's rollout rejection sampling): no policy "
        "gradient for a token (token) or whole sequence (sequence) whose p_trainer / p_rollout "
        "leaves [rollout_rs_threshold_lower, rollout_rs_threshold]; ratio as TIS's; none: off.")
    rollout_rs_threshold: float = key(
        2.0, "MIS's upper bound of the ratio (verl's rollout_rs_threshold).",
        check=Check(lambda v: 1 < v < math.inf, "> 1", "> 1 (the upper bound of the ratio)"))
    rollout_rs_threshold_lower: float = key(
        -1.0, "MIS's lower bound of the ratio; -1: 1 / rollout_rs_threshold (verl's default).",
        check=Check(lambda v: v == -1 or 0 <= v < 1, "in [0, 1) or -1",
                    "in [0, 1) (the lower bound of the ratio), or -1 for "
                    "1 / rollout_rs_threshold"))
    moe_router_replay: bool = key(
        False, "Router replay (MaxText's MoE families, rollout_engine=maxtext): the engine "
        "records the top-k experts of every prompt and completion token per MoE layer, and "
        "the trainer's forward routes those tokens with them instead of its own top-k "
        "(patches/maxtext/0004). Refused for a dense model, the jax and vllm engines and "
        "agentic rollouts.")


@section
class Agentic:
    """Agentic rollouts

    Multi-turn, tool-using rollouts and their importance ratio (MaxText's `rl.*` keys, Tunix's
    agentic GRPO learner; [Agentic rollouts](agentic.md))."""

    use_agentic_rollout: bool = key(
        False, "Multi-turn rollouts: the model's turns alternate with tool or environment "
        "observations, which carry no loss.")
    off_policy_steps: int = key(
        1, "Updates a batch's policy may lag the trainer's (Tunix's max_staleness). "
        "rl_runtime=mcjax_da runs at this bound: k batches in flight, each k updates stale once "
        "the pipeline is full, its ratio taken against the engine's logprobs (0: on-policy, no "
        "overlap). Colocated rollouts lag 0, inside any bound; there the key is for agentic "
        "runs (use_rollout_logps).", check=non_negative())
    use_rollout_logps: bool = key(
        True, "Agentic runs: the ratio's old logps are the engine's logprobs from the first "
        "update on (Tunix's agentic learner); false: the trainer's own at the step's start.")
    force_on_policy_ratio: bool = key(
        False, "Agentic runs: old logps = stop_gradient(current), the ratio exactly 1 "
        "(num_iterations=1 only).")
    agentic_environment: str = key(
        "", "package.module:function building one trajectory's Tunix agent and environment, "
        "called as fn(prompt, fields, seed=, system_prompt=) -> (agent, env); required with "
        "use_agentic_rollout=true (the MaxText adapter sets its task's).")
    system_prompt: str = key("", "The agent's system prompt (MaxText's rl.system_prompt).")
    data_template_path: str = key(
        "", "JSON chat template of the conversation: role formats for system, user, "
        "assistant, tool and generation; empty: plain lines.")
    max_concurrency: int = key(
        256, "Conversations of a host decoded in one engine call (MaxText's).", check=positive())
    agentic_max_turn_tokens: int = key(
        0, "Tokens of one model turn; 0: max_target_length - max_prefill_predict_length.",
        check=non_negative())
    agentic_tool_timeout_s: float = key(
        30.0, "Budget of one round's environment steps; a step past it ends its trajectory "
        "(status tool_timeout, reward 0).", check=positive())
    agentic_keep_pages: bool = key(
        False, "A conversation keeps its KV pages between turns (jax and maxtext engines), so "
        "a turn prefills only its new tokens; off by default: the tokens saved have not yet "
        "made a step faster (docs/agentic.md).", runtime_only=True)


@section
class Optimizer:
    """Optimizer

    AdamW with linear warm-up and gradient clipping (MaxText's names)."""

    learning_rate: float = key(3e-3, "Peak learning rate.", check=positive())
    warmup_steps_fraction: float = key(
        0.0, "Warm-up length as a fraction of all updates (steps x num_iterations).",
        check=between(0, 1, "[)", "(a fraction of steps)"))
    adam_b1: float = key(0.9, "Adam's beta1.", check=between(0, 1, "[)"))
    adam_b2: float = key(0.99, "Adam's beta2.", check=between(0, 1, "[)"))
    adam_eps: float = key(1e-8, "Adam's epsilon.", check=positive())
    adam_weight_decay: float = key(0.0, "Decoupled weight decay.", check=non_negative())
    gradient_clipping_threshold: float = key(
        1.0, "Global gradient-norm clip; 0: off.", check=non_negative())


@section
class TrainMemory:
    """Train-step memory

    How the FSDP update trades memory for compute
    ([Train-step memory](configuration.md#train-step-memory))."""

    fsdp_gather_params_once: Literal["auto", "true", "false"] = key(
        "auto", "true: gather the FSDP params once per forward pass; false: keep them sharded "
        "through compute; auto: memory.gather_params_once decides.", runtime_only=True)
    train_micro_batch_size: int = key(
        -1, "Prompts per micro-batch (MaxText's); its gradients accumulate into one update; "
        "<= 0 or batch_size: no accumulation.")
    train_logits_chunk_tokens: int = key(
        2048, "Tokens per device whose fp32 logits exist at once when scoring; 0: all at once.",
        check=at_least(0, "(0: no chunking)"))
    remat_policy: Literal["none", "full"] = key(
        "none", "full: keep only each decoder layer's input for the backward and recompute the "
        "layer (MaxText's key); none: keep its projections' outputs and recompute the ops "
        "between them (norms, RoPE, SiLU, attention's products) in the Tunix Qwen3 trainer "
        "(train/packed_qwen3.py); MaxText's model applies its own remat_policy.")


@section
class Lora:
    """LoRA

    Tunix's lora_config.rank, alpha and module_path, with qwix's meaning
    ([LoRA](configuration.md#lora-tunix_mcjaxtrainlorapy))."""

    lora_rank: int = key(
        0, "Adapter rank; 0: full fine-tuning. > 0: only the adapters train, publish and "
        "checkpoint.", check=at_least(0, "(0: full fine-tuning)"))
    lora_alpha: float = key(64.0, "Adapter scale is lora_alpha / lora_rank (qwix); Tunix's "
                            "run_qwen3.sh value.", check=positive("(scale = alpha / rank)"))
    lora_module_path: str = key(
        ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj",
        "Regex fully matched against Tunix Qwen3 module paths (layers/3/attn/q_proj); the "
        "default, Tunix 0.1.7's run_qwen3.sh value, adapts all seven projections.")


@section
class Checkpoints:
    """Checkpoints

    Saving and resuming ([Reliability](reliability.md))."""

    enable_checkpointing: bool = key(False, "Save checkpoints and resume from the latest.",
                                     runtime_only=True)
    checkpoint_period: int = key(
        50, "Steps between checkpoints (and one after the last step).", check=positive(),
        runtime_only=True)
    max_num_checkpoints_to_keep: int = key(2, "Checkpoints kept; older ones are deleted.",
                                           check=positive(), runtime_only=True)
    checkpoint_directory: str = key(
        "", "Where checkpoints are saved and resumed from; empty: `<run dir>/checkpoints` "
        "(Tunix's checkpoint_root_directory).", runtime_only=True)


@section
class Evaluation:
    """Evaluation

    MaxText's evaluation schedule; it needs an evaluator, which the MaxText and Tunix adapters
    build from their eval keys and `dataset_name=next_digit` has built in (its held-out prompts,
    scored on the rollout actors under `mcjax_da`)."""

    num_test_batches: int = key(
        0, "Evaluation batches (MaxText's); 0: no evaluation.",
        check=at_least(0, "(0: no evaluation)"), runtime_only=True)
    eval_interval: int = key(
        -1, "Steps between evaluations during training; <= 0: only before and after training.",
        runtime_only=True)
    eval_schedule: Literal["maxtext", "tunix"] = key(
        "maxtext", "maxtext: before training, every eval_interval steps and after the last; "
        "tunix: Tunix's learner, before each step whose finished count divides by eval_interval.",
        runtime_only=True)


@section
class Reporting:
    """Logging and profiler

    Metrics, TensorBoard and JAX traces (MaxText's names and meanings)."""

    log_period: int = key(1, "Steps between metric records.", check=positive(), runtime_only=True)
    enable_tensorboard: bool = key(
        False, "Host 0 writes TensorBoard scalars under `<run dir>/tensorboard`, flushed every "
        "log_period steps.", runtime_only=True)
    profiler: Literal["", "xplane"] = key(
        "", "xplane: a JAX profiler trace per host under `<run dir>/tensorboard/host_<h>`; "
        "empty: off.", runtime_only=True)
    skip_first_n_steps_for_profiler: int = key(
        1, "Steps before the trace starts, counted from the run's (or resume's) first step.",
        runtime_only=True)
    profiler_steps: int = key(
        5, "Steps the trace covers (it ends at the last step at the latest).", runtime_only=True)


@section
class Optimizations:
    """Optimizations O1-O4

    The paper's four optimizations (Appendix B), each off by default
    ([Design](design.md#optimizations-o1o4-paper-appendix-b-each-off-by-default))."""

    rl_async_metrics_export: bool = key(
        False, "O1: host 0 exports the records through a bounded queue and a background "
        "thread, not inline in the step.", runtime_only=True)
    rl_gc_freeze_after_warmup: bool = key(
        False, "O2: after the warm-up step, gc.collect(), gc.freeze(), automatic GC off.",
        runtime_only=True)
    rl_balance_prompts_by_length: bool = key(
        False, "O3: assign prompts to hosts longest-processing-time-first by prompt length.",
        runtime_only=True)
    rl_balance_by_expected_output: bool = key(
        False, "O3+: also weigh each prompt's mean completion length from earlier epochs "
        "(needs rl_balance_prompts_by_length).", runtime_only=True)
    rl_publish_weights_single_call: bool = key(
        False, "O4: one gather and one engine load for the whole param tree, not one per leaf.",
        runtime_only=True)
    rl_metrics_queue_size: int = key(1024, "Bound of O1's queue of pending records.",
                                     check=positive(), runtime_only=True)


@section
class Recovery:
    """Errors and timeouts

    Watchdogs and the non-finite step policy ([Reliability](reliability.md))."""

    collective_timeout_s: float = key(
        300.0, "Budget of a cross-host phase before the run aborts (seconds).", check=positive(),
        runtime_only=True)
    compile_timeout_s: float = key(
        1800.0, "Budget of a cross-host phase that compiles (step 0, a new rows-per-device K, "
        "start-up): compiling a large model can outlast collective_timeout_s.",
        check=positive(), runtime_only=True)
    max_nonfinite_steps: int = key(
        0, "Steps with a non-finite loss or gradient norm are never applied; 0: the first stops "
        "the run; N: skip up to N, then stop.", check=non_negative(), runtime_only=True)


@section
class Disaggregated:
    """Disaggregated mode

    Keys of rl_runtime=mcjax_da: trainer and rollout hosts apart, on Ray
    ([Disaggregated mode](disaggregated.md))."""

    rl_trainer_hosts_fraction: float = key(
        0.5, "Share of the hosts that train; the rest generate, one step stale. The paper's "
        "splits: 0.5, 0.25, 0.125; any share that makes a whole number of hosts runs (0.33 of "
        "3 hosts: 1).")
    rl_rollout_restarts: int = key(
        0, "Times each rollout actor may be restarted after it dies (its batch is regenerated); "
        "0: a dead rollout actor ends the run.", check=at_least(0), runtime_only=True)
    rl_ray_object_store_mb: int = key(
        512, "Object store of the local Ray cluster (MiB): a published copy of the weights per "
        "version in flight, and the rollout batches.",
        check=at_least(75, "(Ray's smallest object store is 75 MB)"), runtime_only=True)
    in_flight_weight_updates: bool = key(
        False, "A rollout host takes the next version in the middle of a batch (NeMo-RL's "
        "key): after in_flight_update_iterations decode iterations with the version the batch "
        "was issued with, it waits for the update then running to publish, loads it, and its "
        "sequences in progress go on with it. Every token records its version. Needs "
        "off_policy_steps >= 1.")
    in_flight_update_iterations: int = key(
        16, "With in_flight_weight_updates: the decode loop iterations of each batch before "
        "its rollout host loads the next version (a fixed point, so a resumed run decodes as "
        "an uninterrupted one).", check=at_least(1))
    rl_ray_address: str = key(
        "", "Ray cluster the driver joins (\"auto\", \"HEAD_IP:6379\", \"ray://HEAD_IP:10001\"): "
        "one actor per node that offers the mcjax_host resource. Empty: RAY_ADDRESS when set, "
        "else the launcher starts a local cluster of its own (development).", runtime_only=True)


SECTIONS = (Run, Data, Model, Batch, Sampling, Rollout, KvPool, Vllm, Algorithm,
            RolloutCorrection, Agentic,
            Optimizer, TrainMemory, Lora, Checkpoints, Evaluation, Reporting, Optimizations,
            Recovery, Disaggregated)
