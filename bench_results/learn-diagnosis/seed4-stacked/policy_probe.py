"""The demo policy's answer to each prompt "d=", at every checkpoint of a run.

For each digit d: p(right first character | "d=") from the trainer's params, with `<pad>` masked
as the engine samples, and the likeliest character where it is not the right one.

    python bench_results/learn-diagnosis/seed4-stacked/policy_probe.py RUN/checkpoints \
        [recipes/cpu/demo.yml] [key=value ...]

RUN is a demo run made with `enable_checkpointing=true checkpoint_period=10
max_num_checkpoints_to_keep=20`; the recipe and overrides give the model's shape.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from tunix_mcjax import models, tokenizer
from tunix_mcjax.config.core import load_config


def saved_params(manager: ocp.CheckpointManager, step: int) -> dict[tuple[str, ...], np.ndarray]:
    """The checkpoint's params as {path: array}, restored onto one device."""
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                            dict(manager.item_metadata(step).items()))
    params = manager.restore(step, args=ocp.args.StandardRestore(abstract))["params"]
    return {tuple(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def load_into(model: nnx.Module, saved: dict[tuple[str, ...], np.ndarray]) -> None:
    """Sets the model's per-layer params from the trainer's stacked ones (layers/from_0)."""
    state = nnx.state(model, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        names = tuple(str(p) for p in path)
        if names[0] == "layers":
            value = saved[("layers", "from_0", *names[2:], "value")][int(names[1])]
        else:
            value = saved[(*names, "value")]
        var.set_value(jnp.asarray(value))
    nnx.update(model, state)


def answer_probs(model: nnx.Module, tok, temperature: float) -> np.ndarray:
    """[10, vocab]: the first completion token's distribution after "d=", pad masked."""
    ids = [[tok.bos_token_id, *tok.convert_tokens_to_ids([str(d), "="])] for d in range(10)]
    tokens = jnp.array(ids)
    positions = jnp.broadcast_to(jnp.arange(3), (10, 3))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((3, 3), bool)), (10, 3, 3))
    logits, _ = model(tokens, positions, None, mask)
    last = logits[:, -1].astype(jnp.float32).at[:, tok.pad_token_id].set(-jnp.inf)
    return np.asarray(jax.nn.softmax(last / temperature, axis=-1))


def line(step: int, probs: np.ndarray, tok) -> str:
    cells = []
    for d in range(10):
        right = tok.convert_tokens_to_ids(str((d + 1) % 10))
        top = int(probs[d].argmax())
        cell = f"{d}:{probs[d, right]:.2g}"
        cells.append(cell if top == right else
                     f"{cell}[{tok.convert_ids_to_tokens(top)} {probs[d, top]:.2f}]")
    return f"after step {step + 1:3d}  " + " ".join(cells)


def main(argv: list[str]) -> None:
    directory, recipe = argv[0], argv[1] if len(argv) > 1 else "recipes/cpu/demo.yml"
    cfg = load_config(recipe, argv[2:])
    tok = tokenizer.char_tokenizer()
    model = models.create_model(models.model_config(cfg, len(tok.get_vocab())), 0)
    manager = ocp.CheckpointManager(epath.Path(directory).absolute(),
                                    item_handlers=ocp.StandardCheckpointHandler())
    print("p(right answer | 'd=') per digit d; [likeliest, its p] where that is wrong")
    for step in sorted(manager.all_steps()):
        load_into(model, saved_params(manager, step))
        print(line(step, answer_probs(model, tok, cfg.decode_sampling_temperature), tok),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
