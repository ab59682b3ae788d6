"""The `tunix-cli` arm: Tunix's own CLI, `tunix.cli.grpo_main`, on a benchmark profile.

The runner turns the profile's recipe into a Tunix CLI config (`<run>/tunix_cli.yaml`) plus
`key=value` overrides in the form of Tunix's `examples/rl/grpo/gsm8k/run_qwen3.sh` (meshes,
LoRA), and calls `grpo_main.main` with them, `rl_runtime=default` (stock Tunix). What the CLI
reads from files is the profile's: the tokenizer (saved as a local Hugging Face tokenizer
dir), the prompts (`data_module`: `create_dataset` below, the rows in the order the other arms
admit them), and the reward (`reward_functions`: `tunix_mcjax.bench.tunix_cli_rewards.<task>`).
The one thing its config cannot say is the model: Tunix's CLI only builds named checkpoint
sizes, so `AutoModel.from_pretrained` returns the profile's model (`models.build_model`, the
same random-init Qwen3 every arm trains). LoRA (`lora_rank` > 0) is Tunix's own: the CLI
applies qwix to the actor with `actor_model_config.lora_config.{rank,alpha,module_path}`.

Timing wraps public methods only, as the `tunix` arm does (`bench.tunix_arm.instrument`):
step s runs from the moment Tunix's learner pulls batch s from its dataset to the moment it
pulls batch s+1 (the last step ends where `RLCluster.close` starts); phases are `generate`,
`reward`, `train` (`update_actor`) and `publish` (`sync_weights`). Tunix's loop, dataset,
LoRA, RLCluster and learner run unchanged; its rollout draws its own seeds.

    python -m tunix_mcjax.bench.tunix_cli_arm --devices 2 --layout fsdp RECIPE.yml key=value ...
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import yaml

from tunix_mcjax.bench import trace
from tunix_mcjax.bench.tunix_arm import StepClock, arm_setup, instrument, timed_reward

REWARDS = {"gsm8k": "tunix_mcjax.bench.tunix_cli_rewards.gsm8k",
           "next_digit": "tunix_mcjax.bench.tunix_cli_rewards.next_digit"}
MESH_AXES = "('fsdp','tp')"
MODEL_ROLES = ("reference_model_config", "rollout_model_config")


def create_dataset(recipe: str, overrides: list[str]):
    """The profile's rows as a grain dataset, in the order the other arms admit them: step s
    holds `global_prompt_indices(..., s, ...)`. Each row keeps its index (`prompt_index`)."""
    import grain

    from tunix_mcjax.admission import global_prompt_indices
    from tunix_mcjax.config import load_config
    from tunix_mcjax.tasks import load_task

    cfg = load_config(recipe, [str(o) for o in overrides])  # Tunix passes a ListConfig
    task = load_task(cfg)
    rows = []
    for step in range(cfg.steps):
        for i in global_prompt_indices(len(task.prompts), cfg.batch_size, cfg.seed, step,
                                       cfg.data_repeat_period).tolist():
            rows.append({"prompts": task.prompts[i], "prompt_index": i,
                         **{k: v[i] for k, v in task.fields.items()}})
    return grain.MapDataset.source(rows)


def lora_overrides(cfg) -> list[str]:
    """Tunix's LoRA keys for the run's LoRA (none when `lora_rank` is 0)."""
    if not cfg.lora_rank:
        return []
    key = "actor_model_config.lora_config"
    return [f"{key}.rank={cfg.lora_rank}", f"{key}.alpha={float(cfg.lora_alpha)}",
            f"{key}.module_path={cfg.lora_module_path}"]


def cli_config(cfg, recipe: str, overrides: list[str], tokenizer_dir: Path) -> dict:
    """The Tunix CLI config of the run's workload (model, tokenizer, data, reward, GRPO,
    rollout, optimizer, steps); meshes and LoRA come as `key=value` (`cli_argv`)."""
    if cfg.dataset_name not in REWARDS:
        raise ValueError(f"tunix-cli arm: dataset_name={cfg.dataset_name!r} has no reward "
                         f"module; use one of {', '.join(REWARDS)}")
    model = {"model_name": "qwen3-tiny", "model_id": "qwen3-tiny", "model_source": "huggingface",
             "model_path": "", "model_download_path": "", "rng_seed": cfg.init_weights_seed,
             "model_display": False, "intermediate_ckpt_dir": str(cfg.run_dir / "unused_ckpt"),
             "use_flash_attention": False, "lora_config": {}}
    if cfg.decode_sampling_strategy != "weighted":
        raise ValueError(f"tunix-cli arm: decode_sampling_strategy={cfg.decode_sampling_strategy}"
                         " has no Tunix CLI key (its rollout samples); use weighted")
    optimizer = {"opt_type": "adamw", "schedule_type": "warmup_constant_schedule",
                 "init_value": 0.0, "peak_value": cfg.learning_rate,
                 "warmup_steps": int(cfg.warmup_steps_fraction * cfg.steps), "b1": cfg.adam_b1,
                 "b2": cfg.adam_b2, "eps": cfg.adam_eps, "weight_decay": cfg.adam_weight_decay}
    rollout = {"total_generation_steps": cfg.max_completion_length,
               "max_prompt_length": cfg.max_prefill_predict_length,
               "temperature": cfg.decode_sampling_temperature,
               "top_p": cfg.decode_sampling_nucleus_p, "top_k": cfg.decode_sampling_top_k or None}
    if cfg.ignore_eos:
        rollout["eos_tokens"] = [-1]  # -1 is never sampled: every completion runs to budget
    return {
        # Reference and rollout have no mesh of their own: they share the actor's.
        "model_config": model, **{role: {"lora_config": {}} for role in MODEL_ROLES},
        "actor_model_config": {"lora_config": {},
                               "mesh": {"shape": "(1,1)", "axis_names": MESH_AXES}},
        "tokenizer_config": {"tokenizer_path": str(tokenizer_dir.resolve()),
                             "tokenizer_type": "huggingface", "add_bos": True, "add_eos": False},
        "data_source": "local", "data_directory": "", "apply_chat_template_to_dataset": False,
        "data_module": "tunix_mcjax.bench.tunix_cli_arm",  # its create_dataset
        "data_config": {"recipe": str(Path(recipe).resolve()), "overrides": list(overrides)},
        "dataset_name": cfg.dataset_name, "batch_size": cfg.batch_size,
        "num_batches": cfg.steps, "num_train_epochs": 1, "train_fraction": 1.0,
        "num_test_batches": 0,
        "rl_training_config": {
            "eval_every_n_steps": cfg.steps + 1, "max_steps": cfg.steps,
            "actor_optimizer_config": optimizer,
            "metrics_logging_options": {"log_dir": str(cfg.run_dir / "tensorboard"),
                                        "flush_every_n_steps": 20},
            "profiler_options": {}, "perf_metrics_options": {},
            "data_sharding_axis": ["fsdp"],
        },
        "grpo_config": {"num_generations": cfg.num_generations, "num_iterations": 1,
                        "beta": cfg.grpo_beta, "epsilon": cfg.grpo_epsilon,
                        "loss_algo": cfg.loss_algo, "loss_agg_mode": cfg.loss_agg_mode,
                        "advantage_estimator": cfg.advantage_estimator},
        "rollout_config": rollout, "rollout_engine": "vanilla", "offload_to_cpu": False,
        "verl_compatible": False, "reward_functions": [REWARDS[cfg.dataset_name]],
        "rl_runtime": "default",
    }


def cli_argv(cfg, config_file: Path, devices: int) -> list[str]:
    """`grpo_main`'s argv: the config file, then the actor's mesh (which the other roles
    share: one colocated mesh, as in the `tunix` arm) and the LoRA keys."""
    mesh = [f"actor_model_config.mesh.shape=({devices},1)",
            f"actor_model_config.mesh.axis_names={MESH_AXES}"]
    return ["grpo_main", str(config_file), *mesh, *lora_overrides(cfg)]


def _pulls(batches: Iterable[dict], clock: StepClock) -> Iterator[dict]:
    """Tunix's dataset as the learner sees it; each pull starts a step on the clock."""
    it = iter(batches)
    while True:
        clock.boundary()
        try:
            batch = next(it)
        except StopIteration:
            return
        clock.info["prompt_indices"] = [int(i) for i in batch["prompt_index"]]
        yield batch


def allocate_in_order(requirements, devices=None, *, allocation_policy=None):
    """Tunix's `allocate_named_mesh_device_slices` for devices without physical coords (CPU):
    each named mesh takes the next devices in order. Tunix 0.1.7 only allocates coord boxes,
    and raises on CPU devices."""
    import jax

    devices = list(devices if devices is not None else jax.devices())
    out, start = {}, 0
    for name, count in requirements:
        if start + count > len(devices):
            raise ValueError(f"{name} needs {count} devices; {len(devices) - start} are left")
        out[name], start = devices[start:start + count], start + count
    return out


def param_counts(model) -> dict[str, int]:
    """The actor's parameter count and how many of them are LoRA adapters (what trains)."""
    import jax
    from flax import nnx

    def count(state) -> int:
        return sum(x.size for x in jax.tree.leaves(state))
    return {"params": count(nnx.state(model, nnx.Param)),
            "lora_params": count(nnx.state(model, nnx.LoRAParam))}


def install_hooks(cfg, clock: StepClock, vocab_size: int) -> None:
    """Wraps the public methods of Tunix's CLI pipeline and learner that the clock needs; the
    CLI's model source builds the profile's model, and on CPU its meshes take devices in
    order (`allocate_in_order`)."""
    from tunix.cli import grpo_main
    from tunix.models import automodel
    from tunix.rl.grpo import grpo_learner
    from tunix.utils import mesh as mesh_lib

    from tunix_mcjax.models import build_model, model_config

    pipeline = grpo_main.GrpoPipeline
    create_cluster, obtain_rewards = pipeline.create_rl_cluster, pipeline.obtain_reward_fn
    train = grpo_learner.GrpoLearner.train

    def from_pretrained(model_id, mesh, **_):
        return build_model(cfg, model_config(cfg, vocab_size), mesh), ""

    def create_rl_cluster(self, tokenizer):
        cluster = create_cluster(self, tokenizer)
        instrument(cluster, clock, tokenizer.pad_id(), cfg.max_completion_length)
        (cfg.run_dir / "tunix_cli_model.json").write_text(
            json.dumps(param_counts(cluster.actor_trainer.model)) + "\n")
        return cluster

    def obtain_reward_fn(self):  # each task's one reward is its accuracy
        return [timed_reward(clock, fn, True) for fn in obtain_rewards(self)]

    def timed_train(self, train_ds, eval_ds=None, skip_jit=False):
        return train(self, _pulls(train_ds, clock), eval_ds, skip_jit)

    automodel.AutoModel.from_pretrained = staticmethod(from_pretrained)
    allocate = mesh_lib.allocate_named_mesh_device_slices

    def allocate_named_mesh_device_slices(requirements, devices=None, **kwargs):
        if mesh_lib.get_coord_topology(list(devices or [])) is None:
            return allocate_in_order(requirements, devices)
        return allocate(requirements, devices, **kwargs)

    mesh_lib.allocate_named_mesh_device_slices = allocate_named_mesh_device_slices
    pipeline.create_rl_cluster = create_rl_cluster
    pipeline.obtain_reward_fn = obtain_reward_fn
    grpo_learner.GrpoLearner.train = timed_train


def run(cfg, recipe: str, overrides: list[str], devices: int) -> Path:
    """Runs `grpo_main` on the run's workload; returns the steps.jsonl path."""
    import jax
    from absl import flags
    from tunix.cli import grpo_main

    from tunix_mcjax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
    tokenizer_dir = cfg.run_dir / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    config_file = cfg.run_dir / "tunix_cli.yaml"
    config_file.write_text(yaml.safe_dump(cli_config(cfg, recipe, overrides, tokenizer_dir),
                                          sort_keys=False))
    argv = cli_argv(cfg, config_file, devices)
    (cfg.run_dir / "tunix_cli_argv.json").write_text(json.dumps(argv) + "\n")
    out = cfg.run_dir / "steps.jsonl"
    clock = StepClock(out, trace.Window.from_env())
    jax.monitoring.register_event_duration_secs_listener(clock.on_compile)
    install_hooks(cfg, clock, len(tokenizer))
    print("tunix-cli arm: python -m tunix.cli." + " ".join(argv), flush=True)
    flags.FLAGS(["grpo_main"])
    grpo_main.main(argv)
    clock.close()
    return out


def main(argv: list[str] | None = None) -> None:
    args, cfg = arm_setup("tunix-cli", __doc__.split("\n\n")[0], argv)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    mesh_devices = args.devices if args.layout == "fsdp" else 1
    print(f"tunix-cli arm: wrote {run(cfg, args.recipe, args.overrides, mesh_devices)}",
          flush=True)


if __name__ == "__main__":
    main()
