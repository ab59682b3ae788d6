#!/bin/bash
# Makes what the CPU variants of MaxText's RL recipes read (the .args beside this file): the tiny
# OpenMathInstruct-2-format parquet and, per recipe, a MaxText-format checkpoint of its shrunk
# model for load_parameters_path. Idempotent: what exists is kept. Run from the repo root;
# PYTHON overrides the interpreter.
set -euo pipefail
PY="${PYTHON:-python}"
HERE="recipes/maxtext/cpu/upstream"
OUT="$HERE/build"
mkdir -p "$OUT"
[ -f "$OUT/openmath_tiny.parquet" ] || "$PY" "$HERE/make_openmath_tiny.py" "$OUT/openmath_tiny.parquet"
for recipe in "${@:-run_qwen3_30b_rl run_gptoss_20b_rl run_gemma4_26b_rl run_gemma4_e4b_rl}"; do
  for r in $recipe; do
    JAX_PLATFORMS=cpu "$PY" -m tunix_mcjax.maxtext.make_checkpoint "$OUT/$r" "$r"
  done
done
