"""Check for patch 0005: Tunix's Sampler on params that span processes (run as every process).

A tiny random Qwen3 is FSDP-sharded over all devices of all processes; each process samples its
own prompts greedily. argv[1] picks the stops: `equal` (every row runs to the budget) or
`uneven` (process 1's rows stop at their first token, process 0's run to the budget). Each
process also decodes its prompts with a local copy of the same weights, the reference its
completions must equal (with 4 prompts per process, and with `equal` also with 2). Prints
one "REPORT <json>" line per process.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3

from tests.tunix_checks.tiny import VOCAB, IdTokenizer, tiny_config
from tunix_mcjax import topology

NEW_TOKENS, PROMPT_LENGTH = 12, 8
CONFIG = tiny_config()


@nnx.jit
def make_model():
    model = qwen3.Qwen3(CONFIG, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return model


def sample(model, eos: list[int], prompts: list[str]) -> list[list[int]]:
    cache = sampler_lib.CacheConfig(cache_size=PROMPT_LENGTH + NEW_TOKENS,
                                    num_layers=CONFIG.num_layers,
                                    num_kv_heads=CONFIG.num_kv_heads, head_dim=CONFIG.head_dim)
    out = sampler_lib.Sampler(model, IdTokenizer(), cache)(
        prompts, max_generation_steps=NEW_TOKENS, max_prompt_length=PROMPT_LENGTH,
        eos_tokens=eos, temperature=0.0, top_p=None, seed=0)
    return [[int(t) for t in tokens] for tokens in out.tokens]


topo = topology.initialize_from_env()
mesh = Mesh(np.array(jax.devices()).reshape(-1, 1), ("fsdp", "tp"),
            axis_types=(AxisType.Auto, AxisType.Auto))
with jax.set_mesh(mesh):
    model = make_model()
graphdef, state = nnx.split(model)
local_model = nnx.merge(graphdef, jax.tree.map(
    lambda x: jnp.asarray(multihost_utils.process_allgather(x, tiled=True)), state))

prompts = [f"{5 + 20 * topo.host} 6 7", f"{9 + 20 * topo.host} 10 11 12",
           f"{13 + 20 * topo.host} 14", "15 16 17"]
stop_early = sys.argv[1] == "uneven" and topo.host == 1
eos = list(range(VOCAB)) if stop_early else [VOCAB]
report = {"host": topo.host, "sampler": sampler_lib.__file__,
          "reference": sample(local_model, eos, prompts)}
with jax.set_mesh(mesh):
    report["completions"] = sample(model, eos, prompts)
if sys.argv[1] == "equal":
    # Two rows per process: the rows then match the shape of a PRNG key, which must stay as is.
    # (Not after uneven stops: before the fix, a process that left the first decode early would
    # meet the other's first decode with its second and gloo would abort, hiding the hang.)
    report["reference_2_rows"] = sample(local_model, eos, prompts[:2])
    with jax.set_mesh(mesh):
        report["completions_2_rows"] = sample(model, eos, prompts[:2])
print("REPORT " + json.dumps(report), flush=True)
