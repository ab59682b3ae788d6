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
it with the bare step. Spreads are IQRs over repeats; medians and ratios have `bench.stats`'
95% percentile bootstrap intervals (10,000 resamples).
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

Modules: `workload` (profiles, model shapes, prompts, tokenizer), `arms` (the generating arms),
`rev_arms` (another revision's engine in a worker), `floor` (our bare step, the HBM floor),
`runner` (one launch: warm-ups, interleaved repeats), `results` (the figures from the
records), `launches` (fresh processes, ratios across them), `tables` (what it prints), `cli`.

    python -m tunix_mcjax.bench.engine [--profile NAME] [--engine maxtext|vllm ...]
        [--maxtext-model qwen3|qwen3-moe] [--maxtext-rev REV] [--rev REV [--rev-tree DIR]]
        [--layout auto|xla|gpu|gpu-interpret] [--[no-]xla-arm] [--no-tunix] [--repeats N]
        [--launches N] [--json FILE]
"""

# The package's public names: `rev_engine_worker` reads EOS_ID and PAD_ID from whichever
# revision's package it serves, as `tunix_mcjax.bench.engine` (a module before this package).
from tunix_mcjax.bench.engine.cli import main
from tunix_mcjax.bench.engine.launches import across_launches, run_launches
from tunix_mcjax.bench.engine.runner import run
from tunix_mcjax.bench.engine.workload import (
    EOS_ID,
    MAXTEXT_MODELS,
    MODEL,
    PAD_ID,
    PROFILES,
    IdTokenizer,
)

__all__ = ["EOS_ID", "MAXTEXT_MODELS", "MODEL", "PAD_ID", "PROFILES", "IdTokenizer",
           "across_launches", "main", "run", "run_launches"]
