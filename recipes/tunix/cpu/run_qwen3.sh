# Copyright 2025 Google LLC
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.


# Tunix's examples/rl/grpo/gsm8k/run_qwen3.sh (google-tunix 0.1.7) on CPU under
# rl_runtime=mcjax: only the model size, mesh, batch and step counts differ, plus what a CPU box
# without network needs (a local tiny checkpoint with the Qwen3 tokenizer, local GSM8K-format
# data, this directory's copy of Tunix's base_config.yaml, which the wheel does not ship).
# 2 local JAX processes x 1 CPU device (HOSTS, DEVICES); PYTHON picks the interpreter. Run from
# anywhere; extra key=value arguments are appended.
set -euo pipefail
set -x # Enable xtrace
HERE="$(cd "$(dirname "$0")" && pwd)"
PYTHON=${PYTHON:-python3}

# specify at cmd line to override defaults, e.g.
model_name=${model_name:-"qwen3-tiny"}
batch_size=${batch_size:-2}
train_micro_batch_size=${train_micro_batch_size:-2}
total_generation_steps=${total_generation_steps:-16}
max_steps=${max_steps:-3}
num_test_batches=${num_test_batches:-1}
max_prompt_length=${max_prompt_length:-128}
num_train_epochs=${num_train_epochs:-1}
warmup_ratio=${warmup_ratio:-0.1}
train_fraction=${train_fraction:-0.8}
checkpoint_dir=${checkpoint_dir:-"/tmp/grpo_checkpoints/${model_name}_$RANDOM"}
model_dir=${model_dir:-"/tmp/models/${model_name}"}
"$PYTHON" -m tunix_mcjax.tunix.make_checkpoint "$model_dir"

echo "Using parameters:"
echo "  Batch Size: $batch_size"
echo "  Train Micro Batch Size: $train_micro_batch_size"
echo "  Total Generation Steps: $total_generation_steps"
echo "  Max Prompt Length: $max_prompt_length"
echo "  Num Epochs: $num_train_epochs"
echo "  Warmup Ratio: $warmup_ratio"
echo "  Train Fraction: $train_fraction"
echo "  Checkpoint Directory: $checkpoint_dir"

TUNIX_MCJAX_HOSTS=${HOSTS:-2} TUNIX_MCJAX_DEVICES_PER_HOST=${DEVICES:-1} \
"$PYTHON" -m tunix.cli.grpo_main \
  "$HERE/../base_config.yaml" \
  model_config.model_name=${model_name} \
  model_config.model_id=Qwen/${model_name} \
  model_config.model_source=huggingface \
  model_config.use_flash_attention=true \
  model_config.flash_attention_block_size=256 \
  model_config.intermediate_ckpt_dir="/tmp/intermediate_ckpt/${model_name}" \
  model_config.model_download_path="$model_dir" \
  model_config.mesh.shape="(2,1)" \
  model_config.mesh.axis_names="('fsdp','tp')" \
  model_config.rng_seed=42 \
  model_config.remat_config=3 \
  actor_model_config.lora_config.rank=64 \
  actor_model_config.lora_config.alpha=64.0 \
  actor_model_config.lora_config.module_path=".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj" \
  actor_model_config.mesh.shape="(2,1)" \
  actor_model_config.mesh.axis_names="('fsdp','tp')" \
  reference_model_config.mesh=null \
  reference_model_config.same_mesh_as="actor" \
  rollout_model_config.mesh=null \
  rollout_model_config.same_mesh_as="actor" \
  tokenizer_config.tokenizer_path="$model_dir" \
  tokenizer_config.tokenizer_type=huggingface \
  tokenizer_config.add_bos=false \
  data_source="huggingface" \
  dataset_name="$HERE/gsm8k_tiny" \
  batch_size=$batch_size \
  num_test_batches=$num_test_batches \
  num_train_epochs=$num_train_epochs \
  train_fraction=$train_fraction \
  rl_training_config.actor_optimizer_config.opt_type="adamw" \
  rl_training_config.actor_optimizer_config.peak_value=3e-6 \
  rl_training_config.actor_optimizer_config.schedule_type="warmup_cosine_decay_schedule" \
  rl_training_config.actor_optimizer_config.init_value=0.0 \
  rl_training_config.actor_optimizer_config.end_value=0.0 \
  rl_training_config.actor_optimizer_config.warmup_ratio=$warmup_ratio \
  rl_training_config.actor_optimizer_config.b1=0.9 \
  rl_training_config.actor_optimizer_config.b2=0.99 \
  rl_training_config.actor_optimizer_config.weight_decay=0.1 \
  rl_training_config.actor_optimizer_config.max_grad_norm=0.1 \
  rl_training_config.eval_every_n_steps=10 \
  rl_training_config.max_steps=$max_steps \
  rl_training_config.metrics_logging_options.log_dir="/tmp/tensorboard/${model_name}" \
  rl_training_config.metrics_logging_options.flush_every_n_steps=20 \
  rl_training_config.checkpoint_root_directory="$checkpoint_dir" \
  rl_training_config.checkpointing_options.save_interval_steps=500 \
  rl_training_config.checkpointing_options.max_to_keep=4 \
  rl_training_config.profiler_options={} \
  rl_training_config.mini_batch_size=$batch_size \
  rl_training_config.train_micro_batch_size=$train_micro_batch_size \
  rollout_config.total_generation_steps=$total_generation_steps \
  rollout_config.max_prompt_length=$max_prompt_length \
  rollout_config.temperature=0.9 \
  rollout_config.top_p=1.0 \
  rollout_config.top_k=50 \
  rollout_engine="vanilla" \
  offload_to_cpu=false \
  grpo_config.num_generations=4 \
  grpo_config.num_iterations=1 \
  grpo_config.beta=0.08 \
  grpo_config.epsilon=0.2 \
  reward_functions="['tunix/cli/reward_fn/gsm8k.py']" \
  rl_runtime=mcjax \
  "$@"

