"""Writes a MaxText-format parameter checkpoint of a recipe's model, random-initialised, for its
`load_parameters_path` (recipes/maxtext/cpu/upstream/prepare.sh).

`python -m tunix_mcjax.maxtext.make_checkpoint OUT_DIR RECIPE` builds the model of
RECIPE's command plus its .args (see `recipes.cpu_command`) with MaxText's own model creation,
and saves its params with MaxText's `checkpointing.save_params_to_path`: OUT_DIR/0/items holds
`params/params/...`, the layout MaxText's checkpoint conversion writes and `load_parameters_path`
reads. Does nothing when OUT_DIR/0/items exists.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(out: Path, recipe: str) -> None:
    if (out / "0" / "items").exists():
        print(f"{out}/0/items exists: kept")
        return
    import jax
    from flax import nnx
    from maxtext.common import checkpointing
    from maxtext.configs import pyconfig, types
    from maxtext.trainers.post_train.rl import train_rl
    from maxtext.utils import model_creation_utils

    from tunix_mcjax.maxtext import recipes

    _, args = recipes.cpu_command(recipe)
    config = pyconfig.initialize_pydantic(
        [train_rl.__file__, *args, "load_parameters_path=''", "log_config=false"],
        config_class=types.RLConfig)
    model, _ = model_creation_utils.from_pretrained(config, devices=jax.devices()[:1])
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    checkpointing.save_params_to_path(str(out.absolute() / "0"), {"params": params})
    print(f"wrote {config.model_name}'s params to {out}/0/items")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2])
