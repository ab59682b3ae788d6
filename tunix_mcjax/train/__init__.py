"""The training side: the global FSDP update (`trainer`), the pure GRPO math (`loss`), packed
rows (`packing`), the trainer's Qwen3 forward (`packed_qwen3`, `segment_attention`) over the
Qwen3 layer the engine computes too (`qwen3_layer`), the flat FSDP gather (`fsdp_flat`), LoRA
(`lora`) and checkpoints (`checkpoint`)."""
