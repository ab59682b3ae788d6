"""One launch of the engine benchmark: build and warm up every arm, then run them interleaved.

Each repeat runs every arm once, in a fresh shuffled order (each record keeps its `position`),
so that load from other processes and the wake of the arm before hit them alike: an arm runs
slower right after some arms (at demo-cpu, 2x after the floor's tight loop), and a fixed order
charged that to one arm alone.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from tunix.models.qwen3 import model as qwen3

from tunix_mcjax.bench.engine import results
from tunix_mcjax.bench.engine.arms import (
    ENGINE_ARMS,
    LAYOUTS,
    Measure,
    engine_arm,
    timed,
    tunix_arm,
)
from tunix_mcjax.bench.engine.floor import floor_arm
from tunix_mcjax.bench.engine.rev_arms import PACKAGE_ROOT, REV_WORKERS, rev_arm
from tunix_mcjax.bench.engine.workload import MAXTEXT_MODELS, EngineProfile, make_prompts, model_of
from tunix_mcjax.engine import paged_attention
from tunix_mcjax.engine.base import SamplingParams

Progress = Callable[[str, dict], None]  # (what just finished, the state so far)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What every arm runs: the profile's model (random init), its prompts and sampling."""

    profile: EngineProfile
    model: Any  # Tunix's Qwen3 module
    params: Any  # its weights, a pure dict
    prompts: list[list[int]]
    sampling: SamplingParams

    @classmethod
    def of(cls, profile: EngineProfile) -> Workload:
        with jax.default_device(jax.devices()[0]):
            model = qwen3.Qwen3(model_of(profile), rngs=nnx.Rngs(0))
        sampling = SamplingParams(
            max_new_tokens=profile.max_new_tokens, temperature=1.0,
            ignore_eos=profile.ignore_eos, stop_token_ids=profile.stop_token_ids,
        )  # fmt: skip
        return cls(profile, model, nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                   make_prompts(profile, model_of(profile).vocab_size), sampling)

    @property
    def args(self) -> tuple:
        """The arguments an arm builder takes first: profile, params, prompts, sampling."""
        return (self.profile, self.params, self.prompts, self.sampling)


class ArmSet:
    """The launch's arms by name, their records, and this process's XLA compiles so far."""

    def __init__(self, progress: Progress | None):
        self.arms: dict[str, tuple[Measure, dict]] = {}
        self.records: results.Records = {}
        self.progress = progress
        self.started = time.perf_counter()
        self.compiles, self.compile_s = [0], 0.0  # a list: `tunix_arm` reads it as it grows
        jax.monitoring.register_event_duration_secs_listener(self.on_duration)

    def on_duration(self, event: str, seconds: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.compiles[0] += 1
            self.compile_s += seconds

    def info(self) -> dict[str, dict]:
        return {name: info for name, (_, info) in self.arms.items()}

    def tell(self, what: str) -> None:
        if self.progress is not None:
            self.progress(what, {"elapsed_s": time.perf_counter() - self.started,
                                 "compile_s": self.compile_s, "arm_info": self.info(),
                                 "records": self.records})

    def add(self, name: str, build: Callable[..., tuple[Measure, dict]], *args, **kwargs
            ) -> None:
        """Build (and warm up) arm `name`, timing it."""
        built, arm = timed(lambda: build(*args, **kwargs))
        arm[1]["warmup_s"] = built
        self.arms[name] = arm
        self.tell(f"warm-up {name} {built:.1f} s")

    def repeat(self, repeats: int) -> None:
        """`repeats` rounds of every arm once, each round in a fresh shuffled order."""
        self.records.update({name: [] for name in self.arms})
        names, order = list(self.arms), np.random.default_rng(0)
        for rep in range(repeats):
            for position, i in enumerate(order.permutation(len(names))):
                measure, _ = self.arms[names[i]]
                self.records[names[i]].append({**measure(rep), "position": position})
            self.tell(f"repeat {rep + 1} of {repeats}")


def pinned_layout(layout: str) -> Any:
    """A fresh instance of `--layout`'s page layout (`LAYOUTS`), or None for the platform's."""
    make = LAYOUTS[layout]
    return make() if make else None


def add_engine_arms(arms: ArmSet, work: Workload, layout: Any) -> None:
    """The JAX engine on `layout` (None: its platform's), and the profile's variants of it:
    the XLA path, a short cap, and without continuous batching (waves, one batch)."""
    profile, batch = work.profile, work.profile.decode_batch
    arms.add("engine", engine_arm, *work.args, continuous=True, batch=batch, layout=layout)
    if profile.xla_arm:
        arms.add("engine_xla", engine_arm, *work.args, continuous=True, batch=batch,
                 layout=paged_attention.SplitPages())
    if profile.short_cap:
        short = dataclasses.replace(work.sampling, max_new_tokens=profile.short_cap)
        arms.add("engine_short_cap", engine_arm, profile, work.params, work.prompts, short,
                 continuous=True, batch=batch)
    if not profile.ignore_eos and batch < profile.requests:
        arms.add("engine_waves", engine_arm, *work.args, continuous=False, batch=batch)
        arms.add("engine_one_batch", engine_arm, *work.args, continuous=False,
                 batch=profile.requests)


def add_other_arms(arms: ArmSet, work: Workload, engines: Sequence[str], rev: str | None,
                   rev_tree: str | None, maxtext_model: str, maxtext_rev: str | None,
                   tunix: bool) -> None:
    """The arms beside the JAX engine: a revision's engine, the `--engine` arms, a revision's
    maxtext engine, Tunix's Sampler. A revision runs in a worker, beside this tree's engine in
    one (`REV_WORKERS`): at demo-cpu's 3-ms generates a worker ran the same code 1.14x slower
    than the main process, so it is compared like with like."""
    request = (work.profile, work.prompts, work.sampling)
    maxtext_args = MAXTEXT_MODELS[maxtext_model]
    if rev:
        arms.add("rev", rev_arm, *request, rev, tree=rev_tree)
        arms.add(REV_WORKERS["rev"], rev_arm, *request, "this tree", tree=PACKAGE_ROOT)
    options = {"maxtext": {"model_args": maxtext_args}}
    for name in engines:
        arms.add(name, ENGINE_ARMS[name], *work.args, **options.get(name, {}))
    if maxtext_rev:
        arms.add("maxtext_rev", rev_arm, *request, maxtext_rev, maxtext=maxtext_args)
        arms.add(REV_WORKERS["maxtext_rev"], rev_arm, *request, "this tree",
                 maxtext=maxtext_args, tree=PACKAGE_ROOT)
    if tunix:
        arms.add("tunix", tunix_arm, work.profile, work.model, work.prompts, work.sampling,
                 arms.compiles)


def add_floor_arms(arms: ArmSet, work: Workload, layout: Any) -> None:
    """Our bare step at the engine arm's batch, on its layout (and on the XLA path's)."""
    decode_batch = arms.arms["engine"][1]["decode_batch"]
    arms.add("floor", floor_arm, work.profile, work.params, decode_batch, layout=layout)
    if work.profile.xla_arm:
        arms.add("floor_xla", floor_arm, work.profile, work.params, decode_batch,
                 layout=paged_attention.SplitPages())


def run(profile: EngineProfile, engines: Sequence[str] = (), rev: str | None = None,
        maxtext_model: str = "qwen3", maxtext_rev: str | None = None, *,
        rev_tree: str | None = None, layout: str = "auto", tunix: bool = True,
        hbm_bandwidth: float | None = None, progress: Progress | None = None
        ) -> dict[str, Any]:
    """Warm every arm up, then run them interleaved (`ArmSet.repeat`). `engines` names
    `ENGINE_ARMS` to add; `rev` adds that revision's JAX engine (its package from `rev_tree`
    if given); `maxtext_model` is the maxtext arm's model (`MAXTEXT_MODELS`), `maxtext_rev`
    adds that revision's maxtext engine on it. `layout` (`LAYOUTS`) is the engine arm's page
    layout; `tunix` runs Tunix's Sampler; `progress` is told after each warm-up and each
    repeat (partial results)."""
    if maxtext_rev and "maxtext" not in engines:
        raise ValueError("--maxtext-rev compares with the maxtext engine: add --engine maxtext")
    load_before = os.getloadavg()
    arms, work = ArmSet(progress), Workload.of(profile)
    add_engine_arms(arms, work, pinned_layout(layout))
    add_other_arms(arms, work, engines, rev, rev_tree, maxtext_model, maxtext_rev, tunix)
    add_floor_arms(arms, work, pinned_layout(layout))
    arms.repeat(profile.repeats)
    return summarize(work, arms, engines, maxtext_model, hbm_bandwidth, load_before)


def summarize(work: Workload, arms: ArmSet, engines: Sequence[str], maxtext_model: str,
              hbm_bandwidth: float | None, load_before: tuple[float, ...]) -> dict[str, Any]:
    """The launch's result: where it ran, its records, and the figures of `results`."""
    records, info = arms.records, arms.info()
    same, lengths = results.take_completions(records)
    return {
        "profile": dataclasses.asdict(work.profile),
        "model": {k: getattr(model_of(work.profile), k)
                  for k in ("num_layers", "vocab_size", "embed_dim", "hidden_dim", "num_heads",
                            "num_kv_heads")},
        "device": str(jax.devices()[0]),
        "jax_version": jax.__version__,
        "loadavg_1_5_15": {"before": load_before, "after": os.getloadavg()},
        **results.iteration_figures(records, info),
        "xla_compile_s": arms.compile_s,  # this process's, all arms (not the rev worker's)
        "arm_info": info,
        "records": records,
        **results.tokens_per_s_figures(records, info),
        **results.xla_figures(records),
        **results.hbm_figures(work.profile, work.params, work.prompts, records, lengths,
                              results.median_of(records["floor"], "prefill_ms"), hbm_bandwidth),
        "same_outputs_as_engine": same,
        **results.ratio_figures(records, engines, maxtext_model),
    }
