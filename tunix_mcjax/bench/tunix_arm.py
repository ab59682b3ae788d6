"""The `tunix` arm: stock Tunix GRPO (GRPOLearner + RLCluster, vanilla rollout), one process.

Same model, tokenizer, task, reward, hyperparameters and prompt batches as our runtime; Tunix's
own loop runs unchanged. We only wrap public methods with timers and feed the batches:

* step s runs from the moment Tunix pulls batch s from our iterator to the moment it pulls batch
  s+1 (the last step ends where `RLCluster.close` starts), so the step covers all of Tunix's loop;
* phases: `generate` = `RLCluster.generate`, `reward` = the reward functions, `train` =
  `RLCluster.update_actor`, `publish` = `RLCluster.sync_weights` (never called when actor and
  rollout share weights). Tunix tokenizes and pads requests inside `generate`, so it has no
  separate admit phase; the rest of the step (advantages, padding, bookkeeping) is `other`;
* each step samples with a fresh seed, set in the rollout config before Tunix reads it.

With `lora_rank` > 0 the actor gets qwix LoRA adapters as Tunix's CLI applies `lora_config`
(rank, alpha, module_path), and Tunix trains only them.

Layouts: `fsdp` (actor and rollout share one FSDP mesh over all devices) and `one-device`
(both on the first device, the others idle).

    python -m tunix_mcjax.bench.tunix_arm --devices 2 --layout fsdp RECIPE.yml key=value ...
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tunix_mcjax.bench import trace

LAYOUTS = ("fsdp", "one-device")


class StepClock:
    """Step boundaries, phase times and compile events of the Tunix loop; writes steps.jsonl.
    With a trace window (`bench.trace`), the window's steps run under the JAX profiler."""

    def __init__(self, out: Path, window: trace.Window | None = None):
        out.parent.mkdir(parents=True, exist_ok=True)
        self._file = out.open("w")
        self.step = -1
        self._start = 0.0
        self._phases: dict[str, float] = {}
        self._compiles = 0
        self.info: dict = {}
        self._window = window
        self._annotation = None

    def on_compile(self, event: str, _duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self._compiles += 1

    def timed(self, phase: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._phases[phase] = self._phases.get(phase, 0.0) + time.perf_counter() - t0
        return wrapper

    def boundary(self) -> None:
        """Ends the current step (if any) and starts the next."""
        now = time.perf_counter()
        if self.step >= 0:
            record = {"step": self.step, "step_s": now - self._start,
                      "phase_s": {p: self._phases.get(p, 0.0)
                                  for p in ("generate", "reward", "train", "publish")},
                      "compiled": self._compiles > 0, **self.info}
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            print(f"tunix step {self.step:3d} | {record['step_s']:.3f}s | "
                  + " ".join(f"{p}={t:.3f}" for p, t in record["phase_s"].items()), flush=True)
        self.step += 1
        self._trace_boundary()
        self._start, self._phases, self._compiles, self.info = now, {}, 0, {}

    def _trace_boundary(self) -> None:
        """Closes the last step's annotation; opens this step's, or stops the profiler after
        the window's last step."""
        w = self._window
        if w is None:
            return
        import jax

        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        if self.step == w.first:
            jax.profiler.start_trace(str(w.out / "host_0"))
        if w.first <= self.step < w.first + w.steps:
            self._annotation = jax.profiler.TraceAnnotation(f"{trace.STEP_EVENT}{self.step}")
            self._annotation.__enter__()
        elif self.step == w.first + w.steps:
            jax.profiler.stop_trace()

    def close(self) -> None:
        self._file.close()


def make_mesh(layout: str):
    import jax
    from jax.sharding import AxisType

    devices = jax.devices() if layout == "fsdp" else jax.devices()[:1]
    return jax.make_mesh((len(devices), 1), ("fsdp", "tp"), devices=devices,
                         axis_types=(AxisType.Auto, AxisType.Auto))


def step_seed(seed: int, step: int) -> int:
    return (seed * 100_003 + step) % 2**31


def instrument(cluster, clock: StepClock, pad_id: int, completion_budget: int) -> None:
    """Wraps the RLCluster's public phase methods with the clock's timers; `generate` also
    records the rollout's lengths. The last step ends where `close` starts."""
    import numpy as np

    generate = clock.timed("generate", cluster.generate)

    def observed_generate(*args, **kwargs):
        output = generate(*args, **kwargs)
        lens = np.array([len(t) for t in output.tokens])
        full = lens >= completion_budget
        lens = np.where(full, lens, lens + 1)  # count the stop token, as our engine does
        prompt_lens = (np.asarray(output.left_padded_prompt_tokens) != pad_id).sum(axis=1)
        clock.info.update(
            prompt_tokens_mean=float(prompt_lens.mean()),
            completion_len_mean=float(lens.mean()), completion_len_max=int(lens.max()),
            truncated_frac=float(full.mean()), tokens_generated=int(lens.sum()),
        )
        return output

    cluster.generate = observed_generate
    cluster.update_actor = clock.timed("train", cluster.update_actor)
    cluster.sync_weights = clock.timed("publish", cluster.sync_weights)
    close = cluster.close

    def closing():
        clock.boundary()
        close()
    cluster.close = closing


def timed_reward(clock: StepClock, fn: Callable, is_accuracy: bool = False) -> Callable:
    """`fn` under the clock's `reward` timer, adding its mean to the step's `reward_mean`."""
    import numpy as np

    def scored(prompts, completions, **fields):
        rewards = fn(prompts=prompts, completions=completions, **fields)
        clock.info["reward_mean"] = clock.info.get("reward_mean", 0.0) + float(np.mean(rewards))
        if is_accuracy:
            clock.info["accuracy"] = float(np.mean(rewards))
        return rewards
    return clock.timed("reward", functools.wraps(fn)(scored))


def tunix_policy(cfg, mesh, vocab: int):
    """The actor (from `load_parameters_path`, else random init; with LoRA adapters when
    `lora_rank` > 0, as Tunix's CLI applies `lora_config`) and, with a KL term, its reference."""
    from flax import nnx

    from tunix_mcjax.models import build_model, model_config

    actor = build_model(cfg, model_config(cfg, vocab), mesh)
    reference = nnx.clone(actor) if cfg.grpo_beta else None
    if cfg.lora_rank:  # as Tunix's CLI applies lora_config (cli/utils/model.py)
        import qwix
        from tunix.rl import reshard

        provider = qwix.LoraProvider(module_path=cfg.lora_module_path, rank=cfg.lora_rank,
                                     alpha=cfg.lora_alpha)
        actor = reshard.reshard_model_to_mesh(
            qwix.apply_lora_to_model(actor, provider, **actor.get_model_input()), mesh)
    return actor, reference


def tunix_cluster(cfg, mesh, actor, reference, tokenizer):
    """Tunix's RLCluster with every role on `mesh`, a vanilla rollout of the recipe's sampling
    (with `ignore_eos`, to the full completion budget) and its optimizer."""
    from tunix.rl import rl_cluster as rlc
    from tunix.rl.rollout import base_rollout

    from tunix_mcjax.train.trainer import make_optimizer

    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=cfg.max_completion_length,
        max_prompt_length=cfg.max_prefill_predict_length,
        kv_cache_size=cfg.max_target_length,
        temperature=cfg.decode_sampling_temperature,
        top_p=cfg.decode_sampling_nucleus_p,
        top_k=cfg.decode_sampling_top_k or None,
        eos_tokens=[-1] if cfg.ignore_eos else None,  # -1 is never sampled: full budget
    )
    training_config = rlc.RLTrainingConfig(
        actor_optimizer=make_optimizer(cfg),
        eval_every_n_steps=cfg.steps + 1,
        max_steps=cfg.steps,
    )
    return rlc.RLCluster(
        actor=actor, reference=reference, tokenizer=tokenizer,
        cluster_config=rlc.ClusterConfig(
            role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
            rollout_engine="vanilla",
            training_config=training_config,
            rollout_config=rollout_config,
        ),
    )


def step_batches(cfg, task, cluster, clock: StepClock) -> Iterator[dict]:
    """Our runtime's prompt batches, step by step, each pull a step boundary on `clock`, each
    step's rollout seeded as ours is."""
    import numpy as np

    from tunix_mcjax.admission import global_prompt_indices

    fields = {k: np.asarray(v, dtype=object) for k, v in task.fields.items()}
    prompts = np.asarray(task.prompts, dtype=object)
    for step in range(cfg.steps):
        clock.boundary()
        idx = global_prompt_indices(len(task.prompts), cfg.batch_size, cfg.seed, step,
                                    cfg.data_repeat_period)
        cluster.cluster_config.rollout_config.seed = step_seed(cfg.seed, step)
        clock.info["prompt_indices"] = idx.tolist()
        yield {"prompts": prompts[idx], **{k: v[idx] for k, v in fields.items()}}


def run(cfg, layout: str) -> Path:
    """Trains `cfg.steps` GRPO steps with stock Tunix; returns the steps.jsonl path."""
    import jax
    from tunix.rl.grpo import grpo_learner

    from tunix_mcjax.tasks import load_task
    from tunix_mcjax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
    task = load_task(cfg)
    mesh = make_mesh(layout)
    actor, reference = tunix_policy(cfg, mesh, len(tokenizer))
    cluster = tunix_cluster(cfg, mesh, actor, reference, tokenizer)
    algo = grpo_learner.GRPOConfig(
        num_generations=cfg.num_generations, num_iterations=1, beta=cfg.grpo_beta,
        epsilon=cfg.grpo_epsilon, loss_algo=cfg.loss_algo, loss_agg_mode=cfg.loss_agg_mode,
        advantage_estimator=cfg.advantage_estimator,
    )

    out = cfg.run_dir / "steps.jsonl"
    clock = StepClock(out, trace.Window.from_env())
    jax.monitoring.register_event_duration_secs_listener(clock.on_compile)
    instrument(cluster, clock, tokenizer.pad_token_id, cfg.max_completion_length)

    reward_fns = [timed_reward(clock, f, f is task.accuracy_fn) for f in task.reward_fns]
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=reward_fns)
    print(f"tunix arm: layout={layout} devices={mesh.devices.size} shared_weights="
          f"{not learner.should_sync_weights}", flush=True)
    learner.train(step_batches(cfg, task, cluster, clock))
    clock.close()
    return out


def arm_setup(arm: str, description: str, argv: list[str] | None):
    """(args, config) of a one-process Tunix arm: `--devices` forced CPU devices (plus the
    trace window's XLA flags) set before JAX starts, then the recipe and overrides loaded."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--devices", type=int, required=True, help="CPU devices in the process")
    parser.add_argument("--layout", choices=LAYOUTS, default="fsdp",
                        help="fsdp: the meshes span every device; one-device: the first only")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    window = trace.Window.from_env()
    if window is not None:
        flag += " " + window.xla_flags(0)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

    import jax

    from tunix_mcjax.config import load_config

    if jax.device_count() != args.devices:
        sys.exit(f"{arm} arm: wanted {args.devices} devices, jax sees {jax.device_count()}")
    return args, load_config(args.recipe, args.overrides)


def main(argv: list[str] | None = None) -> None:
    args, cfg = arm_setup("tunix", __doc__.split("\n\n")[0], argv)
    print(f"tunix arm: wrote {run(cfg, args.layout)}", flush=True)


if __name__ == "__main__":
    main()
