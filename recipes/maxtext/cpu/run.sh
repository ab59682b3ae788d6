#!/bin/bash
# MaxText's RL trainer on CPU under rl_runtime=mcjax: 2 local JAX processes x 1 device, MaxText's
# rl.yml plus the overrides in qwen3_tiny.args (RECIPE_ARGS: another .args file here, e.g.
# qwen3_tiny_agentic.args). Run from the repo root; extra key=value arguments are appended (e.g.
# rl_publish_weights_single_call=true). PYTHON, HOSTS, DEVICES override the defaults.
set -euo pipefail
HERE="$(dirname "$0")"
mapfile -t ARGS < <(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$HERE/${RECIPE_ARGS:-qwen3_tiny.args}")
exec "${PYTHON:-python}" -m tunix_mcjax.maxtext.launch --hosts "${HOSTS:-2}" --devices-per-host "${DEVICES:-1}" \
  src/maxtext/configs/post_train/rl.yml "${ARGS[@]}" "$@"
