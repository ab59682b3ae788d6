"""Serves `generate` calls of another revision's engine, for `bench.engine --rev` and
`--maxtext-rev`.

Run as a file with that revision's package first on the path (PYTHONPATH=<its tree>), so that
`tunix_mcjax` is the other revision's. It uses only what every revision's engines and benchmark
have: `JaxEngine(...)` over Tunix's Qwen3 of the shape it is given (random init from seed 0, as
the benchmark's other arms), or `MaxTextEngine(...)` over MaxText's model of the MaxText
arguments it is given (MaxText's own init, as the benchmark's maxtext arm, through
`tunix_mcjax.maxtext.load_maxtext_config` and `policy`); then `load_weights`, `generate`,
`last_iterations`. One JSON object per line on stdin, one answer per line on stdout:

    {"model": {...ModelConfig fields, "dtype": "float32" | "bfloat16"}
     | "maxtext": [key=value, ...], "prompts": [[...]],
     "max_prompt_length": P, "max_new_tokens": M, "max_batch_size": B,
     "sampling": {...SamplingParams fields...}}      -> {"compile_count": n}  (built, warmed up)
    {"seed": s}                                       -> {"wall_s", "tokens", "iterations",
                                                          "completions"}
"""

from __future__ import annotations

import json
import sys
import time


def jax_engine(request: dict, options: dict):
    """The revision's JaxEngine over Tunix's Qwen3 of `request["model"]`'s shape, loaded."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    from tunix_mcjax.engine.jax_engine import JaxEngine

    fields = dict(request["model"])
    dtype = jnp.dtype(fields.pop("dtype"))
    config = qwen3.ModelConfig(
        **fields, dtype=dtype, param_dtype=dtype,
        shd_config=qwen3.ShardingConfig.get_default_sharding(is_sampling=True))
    with jax.default_device(jax.devices()[0]):
        model = qwen3.Qwen3(config, rngs=nnx.Rngs(0))
    engine = JaxEngine(config, jax.devices()[:1], **options)
    engine.load_weights(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return engine


def maxtext_engine(request: dict, options: dict):
    """The revision's MaxTextEngine over MaxText's model of `request["maxtext"]`, loaded."""
    import jax
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    from tunix_mcjax.engine.maxtext_engine import MaxTextEngine
    from tunix_mcjax.maxtext import load_maxtext_config, policy

    rl_yml = f"{MAXTEXT_CONFIGS_DIR}/post_train/rl.yml"
    config, _ = load_maxtext_config(["", rl_yml, *request["maxtext"]], {})
    model, _ = policy.build_model(config, pad_id=options["pad_id"])
    _, params = policy.maxtext_policy(model, config)
    engine = MaxTextEngine(config, jax.devices()[:1], **options)
    engine.load_weights(policy.maxtext_tree(params))
    return engine


def main() -> None:
    from tunix_mcjax.bench.engine import EOS_ID, PAD_ID
    from tunix_mcjax.engine.base import SamplingParams

    engine = sampling = prompts = None
    for line in sys.stdin:
        request = json.loads(line)
        if "prompts" in request:
            prompts = request["prompts"]
            sampling = SamplingParams(**{k: tuple(v) if isinstance(v, list) else v
                                         for k, v in request["sampling"].items()})
            options = {"pad_id": PAD_ID, "eos_ids": (EOS_ID,),
                       **{k: request[k] for k in ("max_prompt_length", "max_new_tokens",
                                                  "max_batch_size")}}
            build = maxtext_engine if "maxtext" in request else jax_engine
            engine = build(request, options)
            engine.generate(prompts, sampling, seed=0)  # compile
            answer = {"compile_count": engine.compile_count}
        else:
            start = time.perf_counter()
            out = engine.generate(prompts, sampling, seed=request["seed"])
            answer = {"wall_s": time.perf_counter() - start,
                      "tokens": sum(len(c.tokens) for c in out),
                      "iterations": sum(engine.last_iterations),
                      "completions": [c.tokens.tolist() for c in out]}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
