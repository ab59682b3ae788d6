"""Rollout-engine microbenchmark on one device: JaxEngine vs Tunix's Sampler vs the step floor.

Same random-init Qwen3, prompts and sampling for every arm:

* engine: `JaxEngine.generate` with continuous batching through `decode_batch` rows; on
  decode-heavy profiles also without it, in waves of `decode_batch` rows and in one batch of all;
* tunix: `tunix.generate.sampler.Sampler.__call__`, warmed up, whole batch in one call, its
  cheapest sampling path for plain temperature sampling (`top_p=1.0`, no top-k), logprobs on
  (an RL rollout needs them, and our engine always returns them), a fresh seed per repeat;
* vllm (`--engine vllm`, needs .venv-vllm): `VllmEngine.generate`, in-process vLLM on the same
  weights (published through its reload), warmed up, a fresh seed per repeat;
* floor: our jitted paged decode step alone (batch x 1 token over the page pool, pool donated)
  in a tight loop, and our prefill alone (one chunk of every distinct prompt, as the engine
  prefills them);
* rev (`--rev REV`): the JAX engine of another revision (e.g. the dense engine before pages),
  in a worker process over a copy of that revision's package (`bench.rev_engine_worker`),
  called in turn with the other arms; `--rev-tree DIR` takes that package from DIR (REV's
  `tunix_mcjax`, unpacked from `git archive REV tunix_mcjax`) where no git history is at hand.
  Beside it, engine_worker: this tree's engine in a worker the same way; the rev ratio is
  engine_worker's over rev's, like with like (a worker ran demo-cpu's 3-ms generates 1.14x
  slower than the main process ran the same code);
* engine_xla (profiles with `xla_arm`, or `--xla-arm`): the same engine with its pages pinned
  to `SplitPages`, the XLA path, beside the engine arm's own layout (on a one-device GPU that
  is `GpuPages`: decode steps on JAX's Pallas GPU kernel), with its own floor (floor_xla).
  `--layout` pins the engine arm's layout (`gpu-interpret` runs the GPU kernel in Pallas'
  interpreter: the GPU path, checked on CPU);
* short cap (profiles with `short_cap`): the same engine and requests with the completion cap
  at `short_cap`. Every completion ends on a stop id well before it, so both caps do the same
  work (checked: equal outputs); the wall-time ratio shows what the cap itself costs.

Engine `iteration_ms` = (median generate wall - prefill floor) / decode iterations, so it charges
sampling, stop checks and loop bookkeeping to the iteration; `iteration_vs_floor_ratio` compares
it with the bare step. Spreads are IQRs over repeats; the tokens/s ratio has a bootstrap interval.
`hbm_floor` (in the result): per arm of the paged or dense engine, the least time an iteration
takes if it only streams what it must read from device memory at `--hbm-bandwidth` bytes/s
(on a GPU by default an H200's; elsewhere only when given):
(W + KV / I) / bandwidth, W the weight bytes (every weight once a step; the output head reads
the whole embedding), KV the key and value bytes all decode steps read (the step that samples
token j >= 1 of a request reads its prompt and j tokens: sum over requests and j of
(prompt + j) x per-token KV bytes, its mean over those steps the mean live length), I the
arm's decode iterations. `--no-tunix` leaves Tunix's Sampler out.

`--launches N` runs the whole comparison N times, each launch in fresh processes, and reports
the engine arm's tokens/s over each other arm's across them (Appendix A): per launch, pooled
(launches, then blocks of repeats, resampled: `bench.stats.launch_bootstrap_ratio`) and the Welch
interval on log launch medians. A process's luck (placement, its cores) lasts the launch: one
gsm8k-cpu launch's main process ran 15-20% slow throughout, and the same engine measured 5%
apart in two runs whose intervals over repeats did not overlap, so a single launch's interval
is too narrow for a verdict near 1.

* `--engine maxtext`: the maxtext engine (MaxText's own model, its own random init) with the
  engine arm's loop settings; tokens/s against the JAX engine and Tunix. `--maxtext-model`:
  `qwen3`, MaxText's dense Qwen3 of the same shape, or `qwen3-moe`, MaxText's Qwen3 MoE of that
  shape with 8 experts of a quarter the MLP width, 2 per token (the dense model's active MLP
  width). `--maxtext-rev REV`: also that revision's maxtext engine on the same model (e.g. the
  dense-cache engine before pages), in a worker process like `--rev`'s, against this tree's
  maxtext engine in a worker (maxtext_worker).

    python -m tunix_mcjax.bench.engine [--profile NAME] [--engine maxtext|vllm ...]
        [--maxtext-model qwen3|qwen3-moe] [--maxtext-rev REV] [--rev REV [--rev-tree DIR]]
        [--layout auto|xla|gpu|gpu-interpret] [--[no-]xla-arm] [--no-tunix] [--repeats N]
        [--launches N] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import sampler as tunix_sampler
from tunix.models.qwen3 import model as qwen3

from tunix_mcjax.bench.stats import launch_bootstrap_ratio, welch_log_ratio
from tunix_mcjax.engine import paged_attention, pages
from tunix_mcjax.engine import qwen3_forward as fwd
from tunix_mcjax.engine.base import SamplingParams
from tunix_mcjax.engine.jax_engine import JaxEngine, flatten_tree, pow2_at_least, unflatten_tree
from tunix_mcjax.engine.qwen3_forward import Qwen3PagedModel

PAD_ID, EOS_ID = 0, 1
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding tunix_mcjax
# A revision's arm runs in a worker, so it is compared with this tree's engine in one.
REV_WORKERS = {"rev": "engine_worker", "maxtext_rev": "maxtext_worker"}


@dataclasses.dataclass(frozen=True)
class EngineProfile:
    """A rollout workload: prompts x generations, prompt lengths, completion budget, stops."""

    name: str
    prompts: int
    generations: int
    prompt_lengths: tuple[int, int]  # uniform in [low, high]
    max_new_tokens: int
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]  # with eos, each ends a sequence (~1/vocab each per token)
    decode_batch: int  # rows one replica decodes at once
    repeats: int
    short_cap: int = 0  # also run at this completion cap (same work: stops end every request)
    model: str = "tiny"  # a key of MODELS
    xla_arm: bool = False  # also run the engine with its pages on the XLA path (engine_xla)

    @property
    def requests(self) -> int:
        return self.prompts * self.generations


PROFILES = {
    "gsm8k-cpu": EngineProfile(
        "gsm8k-cpu", prompts=16, generations=4, prompt_lengths=(48, 64), max_new_tokens=64,
        ignore_eos=True, stop_token_ids=(), decode_batch=64, repeats=5,
    ),
    "numina-cpu": EngineProfile(
        "numina-cpu", prompts=16, generations=4, prompt_lengths=(16, 32), max_new_tokens=256,
        ignore_eos=False, stop_token_ids=tuple(range(2, 9)), decode_batch=16, repeats=3,
    ),
    # Decode-heavy RL: a cap far above the typical completion (7 of 1024 ids end a sequence:
    # mean near 150 tokens, a few past 500).
    "eos-cpu": EngineProfile(
        "eos-cpu", prompts=16, generations=4, prompt_lengths=(16, 32), max_new_tokens=1024,
        ignore_eos=False, stop_token_ids=tuple(range(2, 8)), decode_batch=64, repeats=5,
    ),
    # What a cap costs: 25 of 1024 ids end a sequence (mean near 40 tokens, none near 512), at
    # caps of 4096 and 512.
    "eos-cap-cpu": EngineProfile(
        "eos-cap-cpu", prompts=16, generations=4, prompt_lengths=(16, 32), max_new_tokens=4096,
        ignore_eos=False, stop_token_ids=tuple(range(2, 26)), decode_batch=64, repeats=5,
        short_cap=512,
    ),
    # Qwen3-0.6B's shape in bf16 (random init: its 151,936-way distribution meets no stop id,
    # so completions run to the cap and every arm does the same work).
    "qwen3-0.6b-cpu": EngineProfile(
        "qwen3-0.6b-cpu", prompts=4, generations=4, prompt_lengths=(32, 64), max_new_tokens=64,
        ignore_eos=True, stop_token_ids=(), decode_batch=16, repeats=3, model="qwen3-0.6b",
    ),
    # Qwen3-0.6B's shape in bf16 on one GPU: 512 requests through 256 rows, every completion to
    # the cap of 256 (as qwen3-0.6b-cpu), the Pallas decode kernel against the XLA path. On an
    # H200 under jax 0.11.2 the engine's program outran a 2-minute compile (docs/engines.md).
    "qwen3-0.6b-gpu": EngineProfile(
        "qwen3-0.6b-gpu", prompts=64, generations=8, prompt_lengths=(64, 128),
        max_new_tokens=256, ignore_eos=True, stop_token_ids=(), decode_batch=256, repeats=3,
        model="qwen3-0.6b", xla_arm=True,
    ),
    # `make demo`'s share of one replica (recipes/cpu/demo.yml on 2 hosts x 2 devices): 4 prompts
    # x 32 samples of 3 tokens, 2 new tokens, its tiny model: what the loop itself costs.
    # GRPO groups on long prompts: 8 samples of each ~1k-token prompt, short completions, so
    # a row's keys are mostly its group's prompt (which cascade attention reads once a group).
    "long-prompt-cpu": EngineProfile(
        "long-prompt-cpu", prompts=8, generations=8, prompt_lengths=(896, 1024), max_new_tokens=64,
        ignore_eos=True, stop_token_ids=(), decode_batch=64, repeats=7,
    ),
    "demo-cpu": EngineProfile(
        "demo-cpu", prompts=4, generations=32, prompt_lengths=(3, 3), max_new_tokens=2,
        ignore_eos=True, stop_token_ids=(), decode_batch=64, repeats=41, model="demo",
    ),
}  # fmt: skip

# Big enough that compute, not dispatch, dominates a CPU step; small enough for ~5 min total.
MODEL = qwen3.ModelConfig(
    num_layers=4, vocab_size=1024, embed_dim=256, hidden_dim=1024, num_heads=4, head_dim=64,
    num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=True,
    shd_config=qwen3.ShardingConfig.get_default_sharding(is_sampling=True),
)  # fmt: skip
# Model shapes a profile can name: the tiny one above, the demo's, and Qwen3-0.6B's in bf16.
MODELS = {
    "tiny": MODEL,
    "demo": dataclasses.replace(MODEL, num_layers=2, vocab_size=99, embed_dim=64, hidden_dim=128,
                                head_dim=16),
    "qwen3-0.6b": dataclasses.replace(
        qwen3.ModelConfig.qwen3_0p6b(), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
        shd_config=qwen3.ShardingConfig.get_default_sharding(is_sampling=True)),
}
MODEL_FIELDS = ("num_layers", "vocab_size", "embed_dim", "hidden_dim", "num_heads", "head_dim",
                "num_kv_heads", "rope_theta", "norm_eps", "use_tied_embedding")


def model_of(profile: EngineProfile) -> qwen3.ModelConfig:
    return MODELS[profile.model]


class IdTokenizer:
    """Tunix-compatible tokenizer over space-separated ids, so both arms see identical tokens.
    bos_id() is 0 (falsy), so Tunix adds no BOS."""

    def encode(self, text: str, **_: Any) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return " ".join(str(i) for i in ids)

    def bos_id(self) -> int:
        return 0

    def eos_id(self) -> int:
        return EOS_ID

    def pad_id(self) -> int:
        return PAD_ID


def make_prompts(profile: EngineProfile, vocab: int, seed: int = 0) -> list[list[int]]:
    """`prompts` distinct random prompts, each repeated `generations` times (GRPO groups)."""
    rng = np.random.default_rng(seed)
    low, high = profile.prompt_lengths
    distinct = [
        rng.integers(9, vocab, size=int(rng.integers(low, high + 1))).tolist()
        for _ in range(profile.prompts)
    ]
    return [p for p in distinct for _ in range(profile.generations)]


def spread(values: Sequence[float]) -> dict[str, float]:
    v = np.asarray(values, dtype=np.float64)
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return {"median": float(med), "iqr": float(q3 - q1), "n": int(v.size)}


def bootstrap_median(values: Sequence[float], resamples: int = 5000):
    """median(values) with a 95% percentile bootstrap interval."""
    rng = np.random.default_rng(0)
    v = np.asarray(values)
    boot = np.median(v[rng.integers(0, v.size, (resamples, v.size))], axis=1)
    low, high = np.percentile(boot, [2.5, 97.5])
    return float(np.median(v)), float(low), float(high)


def bootstrap_ratio(num: Sequence[float], den: Sequence[float], resamples: int = 5000):
    """median(num)/median(den) with a 95% percentile bootstrap interval."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(num), np.asarray(den)
    ra = np.median(a[rng.integers(0, a.size, (resamples, a.size))], axis=1)
    rb = np.median(b[rng.integers(0, b.size, (resamples, b.size))], axis=1)
    low, high = np.percentile(ra / rb, [2.5, 97.5])
    return float(np.median(a) / np.median(b)), float(low), float(high)


def paired_ratio(num: Sequence[float], den: Sequence[float], resamples: int = 5000):
    """Median of per-repeat ratios num[i]/den[i] (the arms ran repeat i on the same seed, so
    the seed's own spread cancels), with a 95% percentile bootstrap interval."""
    rng = np.random.default_rng(0)
    ratios = np.asarray(num) / np.asarray(den)
    boot = np.median(ratios[rng.integers(0, ratios.size, (resamples, ratios.size))], axis=1)
    low, high = np.percentile(boot, [2.5, 97.5])
    return float(np.median(ratios)), float(low), float(high)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


Measure = Callable[[int], dict[str, float]]  # repeat index -> one repeat's measurements

# `--layout`: the engine arm's page layout; auto is what `layout_for` picks for one device.
LAYOUTS: dict[str, Callable[[], Any] | None] = {
    "auto": None,
    "xla": paged_attention.SplitPages,
    "gpu": paged_attention.GpuPages,
    "gpu-interpret": lambda: paged_attention.GpuPages(interpret=True),
}


def resolve_layout(layout: Any = None) -> Any:
    """`layout`, or the one `layout_for` picks for a one-device replica on this platform."""
    return layout or paged_attention.layout_for(jax.devices()[0].platform, 1)


class PinnedLayoutEngine(JaxEngine):
    """JaxEngine whose replicas decode on `layout`, whatever their platform would pick."""

    def __init__(self, *args: Any, layout: Any, **kwargs: Any):
        self.pinned_layout = layout
        super().__init__(*args, **kwargs)

    def _decode_model(self, mesh):
        return Qwen3PagedModel(self.model_config, mesh, self.pinned_layout)


def engine_arm(
    profile, params, prompts, sampling, *, continuous: bool, batch: int, layout: Any = None
) -> tuple[Measure, dict]:
    """A warmed-up JaxEngine decoding at most `batch` rows at once (CB or waves), its
    completion cap `sampling.max_new_tokens`, its pages on `layout` (None: its platform's)."""
    options = {"layout": layout} if layout is not None else {}
    engine = (PinnedLayoutEngine if layout is not None else JaxEngine)(
        model_of(profile), jax.devices()[:1], pad_id=PAD_ID, eos_ids=(EOS_ID,),
        max_prompt_length=pow2_at_least(profile.prompt_lengths[1]),
        max_new_tokens=sampling.max_new_tokens, continuous_batching=continuous,
        max_batch_size=batch, **options,
    )  # fmt: skip
    engine.load_weights(params)
    engine.generate(prompts, sampling, seed=0)  # compile
    info = {"decode_batch": min(batch, pow2_at_least(profile.requests)),
            "pool_pages": engine.num_pages, "page_size": engine.page_size,
            "layout": type(resolve_layout(layout)).__name__}

    def measure(rep: int) -> dict[str, float]:
        wall, out = timed(lambda: engine.generate(prompts, sampling, seed=rep + 1))
        info["compile_count"] = engine.compile_count
        stats = engine.last_stats
        return {
            "wall_s": wall,
            "tokens": sum(len(c.tokens) for c in out),
            "iterations": sum(s["iterations"] for s in stats),
            "peak_pages": max(s["peak_pages"] for s in stats),
            "shared_pages": sum(s["shared_pages"] for s in stats),
            "preemptions": sum(s["preemptions"] for s in stats),
            "packed_steps": sum(s["packed_steps"] for s in stats),
            "completions": [c.tokens.tolist() for c in out],
        }

    return measure, info


def rev_worker(rev: str, tree: str | None = None) -> Callable[[dict], dict]:
    """A worker process (`bench.rev_engine_worker`) over `git archive` of revision `rev`'s
    package, or over `tree` (a folder holding that package, `tree/tunix_mcjax`); returns the
    function that sends it one request and reads its answer."""
    import atexit
    import shutil
    import subprocess
    import tempfile

    if tree is None:
        tree = tempfile.mkdtemp(prefix="rev-engine-")
        atexit.register(shutil.rmtree, tree, ignore_errors=True)
        archive = subprocess.run(["git", "archive", rev, "tunix_mcjax"], check=True,
                                 capture_output=True, timeout=120).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True, timeout=120)
    elif not (Path(tree) / "tunix_mcjax" / "engine" / "jax_engine.py").is_file():
        raise ValueError(f"--rev-tree {tree} holds no tunix_mcjax package")
    worker = Path(__file__).with_name("rev_engine_worker.py")
    # The revision's package first, then whatever path this process was given (where its
    # dependencies may live).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, str(worker)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    atexit.register(proc.kill)

    def ask(request: dict) -> dict:
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {rev} engine worker exited with {proc.wait()}")
        return json.loads(line)

    return ask


def rev_arm(profile, prompts, sampling, rev: str, maxtext: Sequence[str] | None = None,
            tree: str | None = None) -> tuple[Measure, dict]:
    """Revision `rev`'s engine in a worker process (`rev_worker`, its package from `tree` if
    given), with the engine arm's settings: its JaxEngine over Tunix's Qwen3 of the profile's
    shape, or with `maxtext` (MaxText arguments) its MaxTextEngine over that model; asked for
    one generate per repeat."""
    ask = rev_worker(rev, tree)
    if maxtext is None:
        mc = model_of(profile)
        built = {"model": {**{k: getattr(mc, k) for k in MODEL_FIELDS},
                           "dtype": np.dtype(mc.dtype).name}}
    else:
        built = {"maxtext": list(maxtext)}
    info = ask({**built,
                "prompts": prompts, "max_prompt_length": pow2_at_least(profile.prompt_lengths[1]),
                "max_new_tokens": sampling.max_new_tokens, "max_batch_size": profile.decode_batch,
                "sampling": dataclasses.asdict(sampling)})
    info.update(rev=rev, decode_batch=min(profile.decode_batch, pow2_at_least(profile.requests)))
    return lambda rep: ask({"seed": rep + 1}), info


# MaxText's Qwen3 at MODEL's shape, CPU kernels, fp32 (`--engine maxtext`).
MAXTEXT_SHAPE = [
    "override_model_config=true",
    f"base_num_decoder_layers={MODEL.num_layers}", f"vocab_size={MODEL.vocab_size}",
    f"base_emb_dim={MODEL.embed_dim}", f"base_mlp_dim={MODEL.hidden_dim}",
    f"base_num_query_heads={MODEL.num_heads}", f"base_num_kv_heads={MODEL.num_kv_heads}",
    f"head_dim={MODEL.head_dim}", "logits_via_embedding=true", "dtype=float32",
    "weight_dtype=float32", "hardware=cpu", "attention=dot_product",
    "convert_checkpoint_if_possible=false", "log_config=false",
]  # fmt: skip
# `--maxtext-model` -> MaxText's arguments: dense Qwen3, or Qwen3 MoE whose 2 active experts
# of 8 have the dense model's MLP width between them (MaxText's own expert computation, its
# CPU path: no megablox, no sparse matmul).
MAXTEXT_MODELS = {
    "qwen3": ["model_name=qwen3-0.6b", *MAXTEXT_SHAPE],
    "qwen3-moe": ["model_name=qwen3-30b-a3b", *MAXTEXT_SHAPE, "num_experts=8",
                  "num_experts_per_tok=2", f"base_moe_mlp_dim={MODEL.hidden_dim // 2}",
                  "megablox=false", "sparse_matmul=false"],
}


def maxtext_arm(profile, _params, prompts, sampling,
                model_args: Sequence[str] = tuple(MAXTEXT_MODELS["qwen3"])
                ) -> tuple[Measure, dict]:
    """The maxtext engine (MaxText's own model of `model_args`, random init, MODEL's shape)
    with the same loop settings as the `engine` arm: continuous batching through
    `decode_batch` rows. It has its own params (MaxText's init), not the JAX engine's."""
    if profile.model != "tiny":
        raise ValueError(f"--engine maxtext builds the tiny shape only; profile {profile.name} "
                         f"is {profile.model}")
    batch = profile.decode_batch
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    from tunix_mcjax.engine.maxtext_engine import MaxTextEngine
    from tunix_mcjax.maxtext import load_maxtext_config, policy

    rl_yml = f"{MAXTEXT_CONFIGS_DIR}/post_train/rl.yml"
    config, _ = load_maxtext_config(["", rl_yml, *model_args], {})
    model, _ = policy.build_model(config, pad_id=PAD_ID)
    _, params = policy.maxtext_policy(model, config)
    engine = MaxTextEngine(
        config, jax.devices()[:1], pad_id=PAD_ID, eos_ids=(EOS_ID,),
        max_prompt_length=pow2_at_least(profile.prompt_lengths[1]),
        max_new_tokens=profile.max_new_tokens, max_batch_size=batch,
    )  # fmt: skip
    engine.load_weights(policy.maxtext_tree(params))
    engine.generate(prompts, sampling, seed=0)  # compile
    info = {"decode_batch": min(batch, pow2_at_least(profile.requests))}

    def measure(rep: int) -> dict[str, float]:
        wall, out = timed(lambda: engine.generate(prompts, sampling, seed=rep + 1))
        info["compile_count"] = engine.compile_count
        return {"wall_s": wall, "tokens": sum(len(c.tokens) for c in out),
                "iterations": sum(engine.last_iterations),
                "completions": [c.tokens.tolist() for c in out]}

    return measure, info


def tunix_arm(profile, model, prompts, sampling, compiles: list[int]) -> tuple[Measure, dict]:
    """A warmed-up Tunix Sampler over the same model, whole batch per call."""
    prompt_bucket = pow2_at_least(profile.prompt_lengths[1])
    cache = tunix_sampler.CacheConfig(
        cache_size=prompt_bucket + profile.max_new_tokens, num_layers=model_of(profile).num_layers,
        num_kv_heads=model_of(profile).num_kv_heads, head_dim=model_of(profile).head_dim,
    )  # fmt: skip
    sampler = tunix_sampler.Sampler(model, IdTokenizer(), cache)
    texts = [" ".join(map(str, p)) for p in prompts]
    ends = [model_of(profile).vocab_size] if sampling.ignore_eos \
        else [EOS_ID, *sampling.stop_token_ids]

    def call(seed: int):
        return sampler(
            texts, max_generation_steps=profile.max_new_tokens, max_prompt_length=prompt_bucket,
            eos_tokens=ends, temperature=sampling.temperature, top_p=1.0, top_k=None,
            seed=seed, return_logprobs=True,
        )  # fmt: skip

    before = compiles[0]
    call(0)  # compile
    info = {"compile_count": compiles[0] - before}

    def measure(rep: int) -> dict[str, float]:
        wall, out = timed(lambda: call(rep + 1))
        # Tunix drops the stop token from its output; count it as generated, as we do.
        tokens = sum(min(len(t) + 1, profile.max_new_tokens) for t in out.tokens)
        return {"wall_s": wall, "tokens": tokens}

    return measure, info


def vllm_arm(profile, params, prompts, sampling) -> tuple[Measure, dict]:
    """A warmed-up VllmEngine (vLLM in-process) over the same weights, whole batch per call."""
    from tunix_mcjax.engine.vllm_engine import VllmEngine

    engine = VllmEngine(
        model_of(profile), jax.devices()[:1], pad_id=PAD_ID, eos_ids=(EOS_ID,),
        max_prompt_length=pow2_at_least(profile.prompt_lengths[1]),
        max_new_tokens=profile.max_new_tokens, max_num_seqs=profile.decode_batch)
    publish_s, _ = timed(lambda: engine.load_weights(params))
    engine.generate(prompts, sampling, seed=0)  # warm-up
    info = {"compile_count": engine.compile_count, "decode_batch": profile.decode_batch,
            "publish_s": publish_s}

    def measure(rep: int) -> dict[str, float]:
        wall, out = timed(lambda: engine.generate(prompts, sampling, seed=rep + 1))
        return {"wall_s": wall, "tokens": sum(len(c.tokens) for c in out)}

    return measure, info


# `--engine` arms beside the JAX engine (which always runs): name -> arm builder.
ENGINE_ARMS = {"maxtext": maxtext_arm, "vllm": vllm_arm}


def floor_arm(profile, params, batch: int, steps: int = 32,
              layout: Any = None) -> tuple[Measure, dict]:
    """Our paged decode step alone (every row at the prompt bucket, each group of
    `generations` rows on its prompt's pages as in the engine, pool donated) in a tight loop,
    and our prefill alone (one chunk of each distinct prompt), jitted, on `layout` (None: the
    one the engine picks on this platform)."""
    prompt_bucket = pow2_at_least(profile.prompt_lengths[1])
    page = pages.DEFAULT_PAGE_SIZE
    table = pages.cdiv(prompt_bucket + steps, page)
    device = jax.devices()[0]
    num_pages = (batch + profile.prompts) * table
    layout = resolve_layout(layout)
    mc = model_of(profile)
    params = jax.device_put(fwd.stack_layers(unflatten_tree(flatten_tree(params)),
                                             mc.num_layers), device)
    pool = jax.device_put(layout.empty(num_pages, page, mc.num_kv_heads, mc.head_dim, mc.dtype,
                                       layers=mc.num_layers), device)

    def rows(tokens, positions, tables, prefix=None):
        n, c = tokens.shape
        return fwd.PagedRows(
            tokens=tokens, positions=positions,
            write_pages=jnp.take_along_axis(tables, positions // page, axis=1),
            write_offsets=positions % page, tables=tables,
            kv_lens=positions[:, -1] + 1, q_lens=jnp.full((n,), c, jnp.int32),
            logit_cols=jnp.full((n,), c - 1, jnp.int32), prefix=prefix)

    step = jax.jit(lambda p, pool, r: fwd.paged_forward(mc, p, pool, r, layout),
                   donate_argnums=1)
    groups, width = pages.cdiv(batch, profile.generations), prompt_bucket // page
    prompt_tables = jnp.arange(groups * width, dtype=jnp.int32).reshape(groups, width)
    row_prompt = jnp.arange(batch, dtype=jnp.int32) // profile.generations
    own = groups * width + jnp.arange(batch * (table - width), dtype=jnp.int32)
    tables = jnp.concatenate([prompt_tables[row_prompt], own.reshape(batch, -1)], axis=1)
    prefix = paged_attention.SharedPrefix(prompt_tables, jnp.full((groups,), width, jnp.int32),
                                          row_prompt, group=profile.generations)
    decode_rows = [rows(jnp.full((batch, 1), 5, jnp.int32),
                        jnp.full((batch, 1), prompt_bucket + i, jnp.int32), tables,
                        prefix if profile.generations > 1 and width else None)
                   for i in range(steps)]
    n = profile.prompts  # the engine prefills each distinct prompt once
    prefill_tables = batch * table + jnp.arange(n * table, dtype=jnp.int32).reshape(n, table)
    prefill = rows(jnp.full((n, prompt_bucket), 5, jnp.int32),
                   jnp.broadcast_to(jnp.arange(prompt_bucket, dtype=jnp.int32),
                                    (n, prompt_bucket)), prefill_tables)
    state = {"pool": pool}

    def run(calls) -> None:
        pool = state["pool"]
        for r in calls:
            logits, pool = step(params, pool, r)
        state["pool"] = pool
        logits.block_until_ready()

    run(decode_rows[:1])  # compile
    run([prefill])

    def measure(rep: int) -> dict[str, float]:
        return {
            "step_ms": timed(lambda: run(decode_rows))[0] / steps * 1e3,
            "prefill_ms": timed(lambda: run([prefill]))[0] * 1e3,
        }

    return measure, {"batch": batch, "layout": type(layout).__name__}


def tokens_per_s(records: list[dict[str, float]]) -> list[float]:
    return [r["tokens"] / r["wall_s"] for r in records]


def column(records: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in records]


def same_outputs(records: list[dict], reference: list[dict]) -> float:
    """Share of requests, over all repeats, whose completion equals the reference arm's."""
    pairs = [(a, b) for r, q in zip(records, reference, strict=True)
             for a, b in zip(r["completions"], q["completions"], strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


HBM_BANDWIDTH = 4.8e12  # bytes/s: an H200's HBM3e, by its datasheet (`--hbm-bandwidth`)
HBM_FLOOR_FORMULA = (
    "floor_iteration_ms = (W + KV / I) / bandwidth * 1e3: W = weight bytes (every weight read "
    "once a step, the tied output head the whole embedding), KV = sum over requests r and "
    "their tokens j >= 1 of (prompt_len_r + j) x kv_bytes_per_token (the step that samples "
    "token j reads its prompt's and j tokens' keys and values; token 0 comes from prefill), "
    "I = the arm's decode iterations; kv_bytes_per_token = 2 x layers x kv_heads x head_dim "
    "x dtype bytes; mean_live_length = KV / kv_bytes_per_token / decode steps")


def hbm_floor(profile: EngineProfile, params, prompts: Sequence[Sequence[int]],
              lengths: Sequence[int], iterations: float, bandwidth: float) -> dict[str, float]:
    """The least time a decode iteration takes if it streams only what it must read from
    device memory (HBM_FLOOR_FORMULA), for requests `prompts` whose completions have `lengths`
    tokens, decoded in `iterations` iterations."""
    mc = model_of(profile)
    weight_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                       for x in jax.tree.leaves(params))
    kv_token_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * np.dtype(
        mc.dtype).itemsize
    steps = sum(max(n - 1, 0) for n in lengths)
    kv_tokens = sum(max(n - 1, 0) * len(p) + n * max(n - 1, 0) / 2
                    for p, n in zip(prompts, lengths, strict=True))
    floor_s = (weight_bytes + kv_tokens * kv_token_bytes / iterations) / bandwidth
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_token_bytes,
            "kv_bytes_read": kv_tokens * kv_token_bytes, "decode_steps": steps,
            "mean_live_length": kv_tokens / max(steps, 1), "iterations": iterations,
            "floor_iteration_ms": floor_s * 1e3}


Progress = Callable[[str, dict], None]  # (what just finished, the state so far)


def run(profile: EngineProfile, engines: Sequence[str] = (), rev: str | None = None,
        maxtext_model: str = "qwen3", maxtext_rev: str | None = None, *,
        rev_tree: str | None = None, layout: str = "auto", tunix: bool = True,
        hbm_bandwidth: float | None = None, progress: Progress | None = None
        ) -> dict[str, Any]:
    """Warm every arm up, then run the arms interleaved, once each per repeat in a shuffled
    order (each record keeps its `position`), so that load from other processes and the wake
    of the arm before hit them alike. `engines` names `ENGINE_ARMS` to add; `rev` adds
    that revision's JAX engine (its package from `rev_tree` if given); `maxtext_model` is the
    maxtext arm's model (`MAXTEXT_MODELS`), `maxtext_rev` adds that revision's maxtext engine
    on it. `layout` (`LAYOUTS`) is the engine arm's page layout; `tunix` runs Tunix's Sampler;
    `progress` is told after each warm-up and each repeat (partial results)."""
    if maxtext_rev and "maxtext" not in engines:
        raise ValueError("--maxtext-rev compares with the maxtext engine: add --engine maxtext")
    load_before = os.getloadavg()
    started = time.perf_counter()
    compiles, compile_s = [0], [0.0]  # XLA compiles so far, and their seconds

    def on_duration(event: str, seconds: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1
            compile_s[0] += seconds

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    with jax.default_device(jax.devices()[0]):
        model = qwen3.Qwen3(model_of(profile), rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    prompts = make_prompts(profile, model_of(profile).vocab_size)
    sampling = SamplingParams(
        max_new_tokens=profile.max_new_tokens, temperature=1.0, ignore_eos=profile.ignore_eos,
        stop_token_ids=profile.stop_token_ids,
    )  # fmt: skip
    workload = (profile, params, prompts, sampling)
    arms: dict[str, tuple[Measure, dict]] = {}
    records: dict[str, list[dict[str, float]]] = {}

    def tell(what: str) -> None:
        if progress is not None:
            progress(what, {"elapsed_s": time.perf_counter() - started,
                            "compile_s": compile_s[0],
                            "arm_info": {n: i for n, (_, i) in arms.items()},
                            "records": records})

    def add(name: str, build: Callable[..., tuple[Measure, dict]], *args, **kwargs) -> None:
        """Build (and warm up) arm `name`, timing it."""
        built, arm = timed(lambda: build(*args, **kwargs))
        arm[1]["warmup_s"] = built
        arms[name] = arm
        tell(f"warm-up {name} {built:.1f} s")

    pinned = LAYOUTS[layout]
    add("engine", engine_arm, *workload, continuous=True, batch=profile.decode_batch,
        layout=pinned() if pinned else None)
    if profile.xla_arm:
        add("engine_xla", engine_arm, *workload, continuous=True, batch=profile.decode_batch,
            layout=paged_attention.SplitPages())
    if profile.short_cap:
        short = dataclasses.replace(sampling, max_new_tokens=profile.short_cap)
        add("engine_short_cap", engine_arm, profile, params, prompts, short, continuous=True,
            batch=profile.decode_batch)
    if not profile.ignore_eos and profile.decode_batch < profile.requests:
        add("engine_waves", engine_arm, *workload, continuous=False, batch=profile.decode_batch)
        add("engine_one_batch", engine_arm, *workload, continuous=False, batch=profile.requests)
    if rev:
        add("rev", rev_arm, profile, prompts, sampling, rev, tree=rev_tree)
        # This tree's engine in a worker too: at demo-cpu's 3-ms generates a worker ran the same
        # code 1.14x slower than the main process, so `rev` is compared like with like.
        add(REV_WORKERS["rev"], rev_arm, profile, prompts, sampling, "this tree",
            tree=PACKAGE_ROOT)
    options = {"maxtext": {"model_args": MAXTEXT_MODELS[maxtext_model]}}
    for name in engines:
        add(name, ENGINE_ARMS[name], *workload, **options.get(name, {}))
    if maxtext_rev:  # against this tree's maxtext engine in a worker, as for `rev`
        add("maxtext_rev", rev_arm, profile, prompts, sampling, maxtext_rev,
            maxtext=MAXTEXT_MODELS[maxtext_model])
        add(REV_WORKERS["maxtext_rev"], rev_arm, profile, prompts, sampling, "this tree",
            maxtext=MAXTEXT_MODELS[maxtext_model], tree=PACKAGE_ROOT)
    if tunix:
        add("tunix", tunix_arm, profile, model, prompts, sampling, compiles)
    decode_batch = arms["engine"][1]["decode_batch"]
    add("floor", floor_arm, profile, params, decode_batch, layout=pinned() if pinned else None)
    if profile.xla_arm:
        add("floor_xla", floor_arm, profile, params, decode_batch,
            layout=paged_attention.SplitPages())
    records.update({name: [] for name in arms})
    names, order = list(arms), np.random.default_rng(0)
    for rep in range(profile.repeats):
        # A fresh order each repeat: an arm runs slower right after some arms (at demo-cpu,
        # 2x after the floor's tight loop), and a fixed order charged that to one arm alone.
        for position, i in enumerate(order.permutation(len(names))):
            measure, _ = arms[names[i]]
            records[names[i]].append({**measure(rep), "position": position})
        tell(f"repeat {rep + 1} of {profile.repeats}")
    same = {name: same_outputs(records[name], records["engine"])
            for name in ("engine_short_cap", "engine_xla", "rev", "engine_worker")
            if name in records}
    if "maxtext_rev" in records:
        same["maxtext_rev_vs_maxtext"] = same_outputs(records["maxtext_rev"], records["maxtext"])
    lengths = {name: [len(c) for c in records[name][0]["completions"]]
               for name in ("engine", "engine_xla", "rev") if name in records}
    for arm_records in records.values():
        for record in arm_records:
            record.pop("completions", None)
    engine, floor = records["engine"], records["floor"]
    prefill_ms = float(np.median(column(floor, "prefill_ms")))
    iterations = float(np.median(column(engine, "iterations")))
    engine_iteration = (np.median(column(engine, "wall_s")) * 1e3 - prefill_ms) / iterations
    floor_iteration = float(np.median(column(floor, "step_ms")))
    result = {
        "profile": dataclasses.asdict(profile),
        "model": {k: getattr(model_of(profile), k) for k in ("num_layers", "vocab_size",
                                                            "embed_dim",
                                                 "hidden_dim", "num_heads", "num_kv_heads")},
        "device": str(jax.devices()[0]),
        "jax_version": jax.__version__,
        "loadavg_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "engine_tokens_per_s": spread(tokens_per_s(engine))["median"],
        "engine_tokens_per_s_spread": spread(tokens_per_s(engine)),
        "iteration_ms": float(engine_iteration),
        "floor_iteration_ms": floor_iteration,
        "floor_iteration_ms_spread": spread(column(floor, "step_ms")),
        "iteration_vs_floor_ratio": float(engine_iteration / floor_iteration),
        "prefill_ms": prefill_ms,
        "engine_decode_iterations": iterations,
        "engine_compile_count": arms["engine"][1]["compile_count"],
        "xla_compile_s": compile_s[0],  # this process's, all arms (not the rev worker's)
        "arm_info": {name: info for name, (_, info) in arms.items()},
        "records": records,
    }  # fmt: skip
    # Every generating arm's tokens/s (median, 95% bootstrap interval of the median) and its
    # ratio to the engine arm's (95% bootstrap interval).
    result["tokens_per_s"] = {
        name: {"median_ci95": bootstrap_median(tokens_per_s(arm)),
               "vs_engine_ci95": bootstrap_ratio(tokens_per_s(arm), tokens_per_s(engine))}
        for name, arm in records.items() if not name.startswith("floor")}
    if "tunix" in records:
        tunix_records = records["tunix"]
        ratio, low, high = bootstrap_ratio(tokens_per_s(engine), tokens_per_s(tunix_records))
        result.update({
            "tunix_sampler_tokens_per_s": spread(tokens_per_s(tunix_records))["median"],
            "tunix_sampler_tokens_per_s_spread": spread(tokens_per_s(tunix_records)),
            "tokens_per_s_ratio_vs_tunix": ratio,
            "tokens_per_s_ratio_vs_tunix_ci95": [low, high],
            "tunix_compile_count": arms["tunix"][1]["compile_count"],
        })
    if "floor_xla" in records:
        xla_floor = records["floor_xla"]
        xla_iterations = float(np.median(column(records["engine_xla"], "iterations")))
        xla_prefill = float(np.median(column(xla_floor, "prefill_ms")))
        xla_iteration = (np.median(column(records["engine_xla"], "wall_s")) * 1e3
                         - xla_prefill) / xla_iterations
        result.update({
            "xla_iteration_ms": float(xla_iteration),
            "xla_floor_iteration_ms": float(np.median(column(xla_floor, "step_ms"))),
            "xla_floor_iteration_ms_spread": spread(column(xla_floor, "step_ms")),
            "xla_prefill_ms": xla_prefill,
            "xla_decode_iterations": xla_iterations,
        })
    # Each engine arm's iteration (wall less our prefill floor, over its iterations) against
    # the HBM floor of the same work.
    floors = {}
    if hbm_bandwidth is None and jax.devices()[0].platform == "gpu":
        hbm_bandwidth = HBM_BANDWIDTH
    for name, arm_lengths in (lengths if hbm_bandwidth else {}).items():
        arm_iterations = float(np.median(column(records[name], "iterations")))
        floors[name] = hbm_floor(profile, params, prompts, arm_lengths, arm_iterations,
                                 hbm_bandwidth)
        wall_ms = float(np.median(column(records[name], "wall_s"))) * 1e3
        floors[name]["iteration_ms"] = (wall_ms - prefill_ms) / arm_iterations
        floors[name]["iteration_vs_hbm_floor"] = (floors[name]["iteration_ms"]
                                                  / floors[name]["floor_iteration_ms"])
    if floors:
        result["hbm_floor"] = {"bandwidth_bytes_per_s": hbm_bandwidth,
                               "formula": HBM_FLOOR_FORMULA, "arms": floors}
    result["same_outputs_as_engine"] = same
    if "engine_short_cap" in records:
        result["cap_wall_ratio"] = paired_ratio(column(engine, "wall_s"),
                                                column(records["engine_short_cap"], "wall_s"))
    if "rev" in records:
        result["rev_tokens_per_s_spread"] = spread(tokens_per_s(records["rev"]))
        result["tokens_per_s_ratio_vs_rev"] = bootstrap_ratio(
            tokens_per_s(records[REV_WORKERS["rev"]]), tokens_per_s(records["rev"]))
    if "maxtext" in records:
        result["maxtext_model"] = maxtext_model
    if "maxtext_rev" in records:
        result["maxtext_rev_tokens_per_s_spread"] = spread(tokens_per_s(records["maxtext_rev"]))
        result["maxtext_tokens_per_s_ratio_vs_maxtext_rev"] = bootstrap_ratio(
            tokens_per_s(records[REV_WORKERS["maxtext_rev"]]), tokens_per_s(records["maxtext_rev"]))
    for name in engines:
        result[f"{name}_tokens_per_s_spread"] = spread(tokens_per_s(records[name]))
        result[f"{name}_tokens_per_s_ratio_vs_engine"] = bootstrap_ratio(
            tokens_per_s(records[name]), tokens_per_s(engine))
        if "tunix" in records:
            result[f"{name}_tokens_per_s_ratio_vs_tunix"] = bootstrap_ratio(
                tokens_per_s(records[name]), tokens_per_s(records["tunix"]))
    for variant in ("engine_waves", "engine_one_batch"):
        if variant in records:
            result[f"{variant}_tokens_per_s"] = spread(tokens_per_s(records[variant]))["median"]
            result[f"{variant}_decode_iterations"] = float(
                np.median(column(records[variant], "iterations"))
            )
            result[f"cb_speedup_vs_{variant}"] = bootstrap_ratio(
                tokens_per_s(engine), tokens_per_s(records[variant])
            )
    return result


def print_table(result: dict[str, Any]) -> None:
    records, info = result["records"], result["arm_info"]
    rows = [
        (f"engine {info['engine']['layout']}"[:16], "engine"),
        ("engine XLA path", "engine_xla"),
        (f"cap {result['profile']['short_cap']}", "engine_short_cap"),
        (f"rev {info.get('rev', {}).get('rev', '')}"[:16], "rev"),
        ("engine, a worker", "engine_worker"),
        ("no CB, waves", "engine_waves"),
        ("no CB, 1 batch", "engine_one_batch"),
        *((f"{name} engine", name) for name in ENGINE_ARMS),
        (f"maxtext {info.get('maxtext_rev', {}).get('rev', '')}"[:16], "maxtext_rev"),
        ("maxtext, worker", "maxtext_worker"),
        ("tunix Sampler", "tunix"),
    ]
    print(f"profile {result['profile']['name']}  model {result['model']}  {result['device']}")
    print(f"{'arm':<16}{'tokens/s':>10}{'IQR':>8}{'wall s':>9}{'tokens':>8}{'compiles':>10}")
    for label, name in rows:
        if name not in records:
            continue
        tps = spread(tokens_per_s(records[name]))
        print(
            f"{label:<16}{tps['median']:>10.0f}{tps['iqr']:>8.0f}"
            f"{np.median(column(records[name], 'wall_s')):>9.3f}"
            f"{np.median(column(records[name], 'tokens')):>8.0f}{info[name]['compile_count']:>10}"
        )
    if "tokens_per_s_ratio_vs_tunix" in result:
        low, high = result["tokens_per_s_ratio_vs_tunix_ci95"]
        ratio = result["tokens_per_s_ratio_vs_tunix"]
        print(f"tokens/s ratio vs tunix {ratio:.2f} [95% CI {low:.2f}, {high:.2f}]")
    if "engine_xla" in records:
        ratio, low, high = result["tokens_per_s"]["engine_xla"]["vs_engine_ci95"]
        print(f"XLA path tokens/s vs {info['engine']['layout']}: {ratio:.2f} [95% CI {low:.2f}, "
              f"{high:.2f}], same outputs {result['same_outputs_as_engine']['engine_xla']:.0%}; "
              f"its iteration {result['xla_iteration_ms']:.2f} ms, floor step "
              f"{result['xla_floor_iteration_ms']:.2f} ms")
    for name, floor in result.get("hbm_floor", {}).get("arms", {}).items():
        print(f"{name}: iteration {floor['iteration_ms']:.2f} ms over {floor['iterations']:.0f}, "
              f"HBM floor {floor['floor_iteration_ms']:.2f} ms (mean live length "
              f"{floor['mean_live_length']:.0f}): {floor['iteration_vs_hbm_floor']:.2f}x")
    print(
        f"iteration {result['iteration_ms']:.2f} ms over {result['engine_decode_iterations']:.0f} "
        f"iterations; floor step {result['floor_iteration_ms']:.2f} ms "
        f"(IQR {result['floor_iteration_ms_spread']['iqr']:.2f}, batch {info['floor']['batch']}); "
        f"ratio {result['iteration_vs_floor_ratio']:.2f}; "
        f"prefill floor {result['prefill_ms']:.1f} ms"
    )
    if "cap_wall_ratio" in result:
        ratio, low, high = result["cap_wall_ratio"]
        print(f"generate wall at cap {result['profile']['max_new_tokens']} over cap "
              f"{result['profile']['short_cap']}: {ratio:.2f} [95% CI {low:.2f}, {high:.2f}], "
              f"same outputs {result['same_outputs_as_engine']['engine_short_cap']:.0%}")
    if "tokens_per_s_ratio_vs_rev" in result:
        ratio, low, high = result["tokens_per_s_ratio_vs_rev"]
        print(f"engine tokens/s vs rev {info['rev']['rev']}, both in workers: {ratio:.2f} "
              f"[95% CI {low:.2f}, {high:.2f}], same outputs "
              f"{result['same_outputs_as_engine']['rev']:.0%}")
    for name in ENGINE_ARMS:
        for other in ("engine", "tunix"):
            if f"{name}_tokens_per_s_ratio_vs_{other}" in result:
                ratio, low, high = result[f"{name}_tokens_per_s_ratio_vs_{other}"]
                print(f"{name} engine tokens/s vs {other}: {ratio:.2f} "
                      f"[95% CI {low:.2f}, {high:.2f}]")
    if "maxtext_tokens_per_s_ratio_vs_maxtext_rev" in result:
        ratio, low, high = result["maxtext_tokens_per_s_ratio_vs_maxtext_rev"]
        print(f"maxtext engine ({result['maxtext_model']}) tokens/s vs rev "
              f"{info['maxtext_rev']['rev']}'s, both in workers: {ratio:.2f} "
              f"[95% CI {low:.2f}, {high:.2f}], "
              f"same outputs {result['same_outputs_as_engine']['maxtext_rev_vs_maxtext']:.0%}")
    for variant in ("waves", "one_batch"):
        if f"cb_speedup_vs_{variant}" in result:
            speedup, low, high = result[f"cb_speedup_vs_{variant}"]
            print(
                f"continuous batching vs {variant.replace('_', ' ')}: {speedup:.2f}x "
                f"[95% CI {low:.2f}, {high:.2f}] ({result['engine_decode_iterations']:.0f} vs "
                f"{result[f'engine_{variant}_decode_iterations']:.0f} iterations)"
            )


@dataclasses.dataclass(frozen=True)
class ProgressPrinter:
    """`run`'s progress on stderr; with `json_path`, what has run so far (no completions) in
    `json_path`.partial, in case the run is cut short. A dataclass, so a launch can take it."""

    profile: EngineProfile
    json_path: str | None = None

    def __call__(self, what: str, state: dict) -> None:
        print(f"[{state['elapsed_s']:7.1f} s] {what} (XLA compiles so far "
              f"{state['compile_s']:.1f} s)", file=sys.stderr, flush=True)
        if self.json_path:
            records = {name: [{k: v for k, v in r.items() if k != "completions"} for r in rs]
                       for name, rs in state["records"].items()}
            with open(f"{self.json_path}.partial", "w") as f:
                json.dump({"profile": dataclasses.asdict(self.profile), "done": what, **state,
                           "records": records}, f, indent=1)


LAUNCH_TIMEOUT_S = 4 * 3600  # one launch of the slowest profile with every arm takes < 1 h


def one_launch(run_args: dict[str, Any], out: str) -> None:
    """A launch, in a fresh process: `run(**run_args)`, its table, its result in `out`."""
    result = run(**run_args)
    print_table(result)
    with open(out, "w") as f:
        json.dump(result, f)


def run_launches(launches: int, run_args: dict[str, Any]) -> dict[str, Any]:
    """`run(**run_args)` `launches` times, one after another, each in a fresh process (its rev
    workers too): each launch's result, and `across_launches` of them."""
    spawn = multiprocessing.get_context("spawn")
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(launches):
            print(f"launch {i + 1} of {launches}", file=sys.stderr, flush=True)
            out = os.path.join(folder, f"launch-{i}.json")
            proc = spawn.Process(target=one_launch, args=(run_args, out))
            proc.start()
            proc.join(LAUNCH_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                raise TimeoutError(f"launch {i + 1} ran past {LAUNCH_TIMEOUT_S} s")
            if proc.exitcode != 0:
                raise RuntimeError(f"launch {i + 1} of {launches} exited with {proc.exitcode} "
                                   "(its error is above)")
            with open(out) as f:
                results.append(json.load(f))
    return {"launches": results, "across_launches": across_launches(results)}


def across_launches(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each generating arm of the launches' `results`: the engine arm's tokens/s over the
    arm's (for `rev` and `maxtext_rev`, their worker's of this tree); with a short cap, also
    `cap_wall_ratio` (the engine's generate wall over the short-cap arm's). Each per launch
    (ratio of medians), pooled (`launch_bootstrap_ratio`: launches, then blocks of repeats,
    resampled) and over launch medians (`welch_log_ratio`)."""
    if len(results) < 2:
        raise ValueError(f"a comparison across launches needs >= 2 of them, got {len(results)}")

    def ratios(numerator: list[list[float]], denominator: list[list[float]]) -> dict[str, Any]:
        return {
            "per_launch": [float(np.median(n) / np.median(d))
                           for n, d in zip(numerator, denominator, strict=True)],
            "pooled_ci95": launch_bootstrap_ratio(numerator, denominator).as_dict(),
            "welch_ci95": welch_log_ratio([np.median(n) for n in numerator],
                                          [np.median(d) for d in denominator]).as_dict(),
        }

    def launches_of(arm: str, measure: Callable[[list[dict]], list[float]]) -> list[list[float]]:
        return [measure(r["records"][arm]) for r in results]

    def numerator(name: str) -> str:  # a revision's worker of this tree, where it ran
        worker = REV_WORKERS.get(name)
        return worker if worker in results[0]["records"] else "engine"

    out = {name: ratios(launches_of(numerator(name), tokens_per_s),
                        launches_of(name, tokens_per_s))
           for name in results[0]["tokens_per_s"] if name != "engine"}
    if "engine_short_cap" in results[0]["records"]:
        def walls(records: list[dict]) -> list[float]:
            return column(records, "wall_s")
        out["cap_wall_ratio"] = ratios(launches_of("engine", walls),
                                       launches_of("engine_short_cap", walls))
    return out


def print_launches(combined: dict[str, Any]) -> None:
    results = combined["launches"]
    print(f"across {len(results)} launches, engine tokens/s over each arm's (cap_wall_ratio: "
          "generate wall at the cap over the short cap):")
    for name, ratios in combined["across_launches"].items():
        pooled, welch = ratios["pooled_ci95"], ratios["welch_ci95"]
        each = " ".join(f"{r:.2f}" for r in ratios["per_launch"])
        print(f"  {name:<16} per launch {each}; pooled {pooled['median']:.2f} [95% CI "
              f"{pooled['ci_low']:.2f}, {pooled['ci_high']:.2f}]; over launch medians "
              f"{welch['median']:.2f} [Welch {welch['ci_low']:.2f}, {welch['ci_high']:.2f}]")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="gsm8k-cpu")
    parser.add_argument("--json", help="write the full result here")
    parser.add_argument("--engine", action="append", choices=sorted(ENGINE_ARMS), default=[],
                        help="also run this engine beside the JAX engine (repeatable)")
    parser.add_argument("--rev", help="also run this git revision's JAX engine (e.g. the "
                        "commit before the paged engine), in a worker process")
    parser.add_argument("--maxtext-model", choices=sorted(MAXTEXT_MODELS), default="qwen3",
                        help="the maxtext engine's model: MaxText's dense Qwen3 or a tiny Qwen3 "
                        "MoE, of the JAX engine's shape (default: qwen3)")
    parser.add_argument("--maxtext-rev", help="also run this git revision's maxtext engine on "
                        "the same model (e.g. 360faf4, before it was paged), in a worker "
                        "process; needs --engine maxtext")
    parser.add_argument("--rev-tree", help="--rev's package from this folder (holding "
                        "tunix_mcjax, as `git archive REV tunix_mcjax` unpacks) instead of git")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="auto",
                        help="the engine arm's page layout (default: its platform's)")
    parser.add_argument("--xla-arm", action=argparse.BooleanOptionalAction, help="also run "
                        "the engine with its pages on the XLA path, SplitPages (default: the "
                        "profile's xla_arm)")
    parser.add_argument("--no-tunix", action="store_true", help="leave Tunix's Sampler out")
    parser.add_argument("--hbm-bandwidth", type=float, help="bytes/s of the HBM floor "
                        "(default: an H200's 4.8e12 on a GPU, none elsewhere)")
    parser.add_argument("--repeats", type=int, help="timed repeats per arm (default: the "
                        "profile's); more narrow the intervals on a loaded machine")
    parser.add_argument("--launches", type=int, default=1, help="run the comparison this many "
                        "times, each in fresh processes, and report the ratios across them "
                        "(default 1; 3 or more for a verdict near 1)")
    args = parser.parse_args(argv)
    if args.launches < 1:
        parser.error(f"--launches must be >= 1, got {args.launches}")
    if args.rev_tree and not args.rev:
        parser.error("--rev-tree needs --rev (the revision it holds)")
    profile = PROFILES[args.profile]
    if args.repeats:
        profile = dataclasses.replace(profile, repeats=args.repeats)
    if args.xla_arm is not None:
        profile = dataclasses.replace(profile, xla_arm=args.xla_arm)

    run_args = {"profile": profile, "engines": args.engine, "rev": args.rev,
                "maxtext_model": args.maxtext_model, "maxtext_rev": args.maxtext_rev,
                "rev_tree": args.rev_tree, "layout": args.layout, "tunix": not args.no_tunix,
                "hbm_bandwidth": args.hbm_bandwidth}
    if args.launches > 1:
        result = run_launches(args.launches, {**run_args, "progress": ProgressPrinter(profile)})
        print_launches(result)
    else:
        result = run(**run_args, progress=ProgressPrinter(profile, args.json))
        print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        if os.path.exists(f"{args.json}.partial"):
            os.remove(f"{args.json}.partial")


if __name__ == "__main__":
    main()
