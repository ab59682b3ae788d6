"""Publish sizes with LoRA: the first publish (base + adapters) against every later one (the
adapters only), per Qwen3 preset, from the engine's param shapes (no weights are built).

    python -m tunix_mcjax.bench.lora_sizes --json bench_results/lora-publish-sizes.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
from flax import nnx
from tunix.models.qwen3 import model as qwen3

from tunix_mcjax import models
from tunix_mcjax.config import Config, load_config
from tunix_mcjax.publish import tree_bytes
from tunix_mcjax.train import lora

# run_qwen3.sh's module path before Tunix 0.1.7: Gemma's attention names, so on Qwen3 it adapts
# the MLP projections only.
GEMMA_NAMES_MODULE_PATH = (".*q_einsum|.*kv_einsum|.*gate_proj|.*down_proj|.*up_proj"
                           "|.*attn_vec_einsum")


def sizes(model_name: str, rank: int, alpha: float, module_path: str, dtype: str) -> dict:
    """Params and bytes of the first and of every later publish to the engine."""
    cfg = load_config(None, [f"model_name={model_name}", f"lora_rank={rank}",
                             f"lora_alpha={alpha}", f"lora_module_path={module_path}",
                             f"weight_dtype={dtype}"])
    mc = models.model_config(cfg, 0, for_sampling=True)
    abstract = nnx.eval_shape(lambda: lora.add_adapters(qwen3.Qwen3(mc, rngs=nnx.Rngs(0))))
    full = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    adapters = nnx.to_pure_dict(nnx.state(abstract, nnx.LoRAParam))
    return {"model": model_name, "rank": rank, "module_path": module_path, "dtype": dtype,
            "first_publish_params": _count(full), "later_publish_params": _count(adapters),
            "first_publish_bytes": tree_bytes(full), "later_publish_bytes": tree_bytes(adapters),
            "later_over_first": tree_bytes(adapters) / tree_bytes(full)}


def _count(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"])
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=64.0)
    parser.add_argument("--module-paths", nargs="+",
                        default=[Config.lora_module_path, GEMMA_NAMES_MODULE_PATH])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [sizes(m, args.rank, args.alpha, p, args.dtype)
            for m in args.models for p in args.module_paths]
    for r in rows:
        print(f"{r['model']:<11} {r['module_path'][:24]:<24} "
              f"first {r['first_publish_bytes'] / 1e6:9.1f} MB  "
              f"later {r['later_publish_bytes'] / 1e6:7.1f} MB  "
              f"({100 * r['later_over_first']:.1f}%)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
