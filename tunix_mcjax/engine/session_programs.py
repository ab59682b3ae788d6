"""The compiled programs of a decode session (`engine.session`), per replica and shape: start
(the initial `LoopState` over the replica's pool), join (requests waiting afresh), release
(kept conversations' pages freed) and advance (a slice of the loop). Each donates the state it
takes, so the state stays in place on the replica's devices; each compiles once per (replica,
shape) and counts in the engine's `compile_count`."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from tunix_mcjax.engine import decode_loop
from tunix_mcjax.engine.loop_state import Inputs, LoopState, Outputs, ProgramShape
from tunix_mcjax.engine.sampling import SamplerSpec


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)


class SessionPrograms:
    """`engine`'s session programs for `shape` and sampler `spec`, compiled on first use into
    the engine's program cache."""

    def __init__(self, engine: Any, shape: ProgramShape, spec: SamplerSpec):
        self.engine, self.shape, self.spec = engine, shape, spec

    def _compiled(self, kind: str, mesh_index: int, build: Any, *args: Any) -> Any:
        key = ("session", kind, mesh_index, self.shape, self.spec if kind == "advance" else None)
        programs = self.engine._programs
        if key not in programs:
            programs[key] = build(*args).lower(*args).compile()
        return programs[key]

    def start(self, mesh_index: int, pool: Any, inputs: Inputs) -> LoopState:
        """Every request slot free, no prompt resident, every page free; donates `pool`."""
        shape, vocab = self.shape, self.engine.model_config.vocab_size

        def build(pool, inputs):
            return jax.jit(lambda pool, inp: decode_loop.initial_state(shape, inp, pool, vocab),
                           donate_argnums=0)

        return self._compiled("start", mesh_index, build, pool, inputs)(pool, inputs)

    def join(self, mesh_index: int, state: LoopState, inputs: Inputs,
             joined: np.ndarray, keep: np.ndarray) -> LoopState:
        """`decode_loop.join`: the requests where `joined` wait afresh, those where `keep`
        keeping their pages when done; donates `state`."""
        def build(state, inputs, joined, keep):
            return jax.jit(decode_loop.join, donate_argnums=0,
                           out_shardings=_shardings(state))

        return self._compiled("join", mesh_index, build, state, inputs, joined, keep)(
            state, inputs, joined, keep)

    def release(self, mesh_index: int, state: LoopState, released: np.ndarray) -> LoopState:
        """`decode_loop.release`: the KEPT prompt slots where `released` give their pages
        back; donates `state`."""
        def build(state, released):
            return jax.jit(decode_loop.release, donate_argnums=0,
                           out_shardings=_shardings(state))

        return self._compiled("release", mesh_index, build, state, released)(state, released)

    def advance(self, mesh_index: int, state: LoopState, inputs: Inputs,
                max_iterations: np.int32, groups: np.ndarray
                ) -> tuple[LoopState, Outputs, jax.Array]:
        """At most `max_iterations` more iterations, ending once one more of `groups` [N] is
        whole (each request slot's group, -1: none): (state, outputs, each request's done);
        donates `state`."""
        engine = self.engine
        model = engine._replica_model(mesh_index)
        fn = decode_loop.build_advance(model, self.shape, self.spec, engine.masked_id)

        def run(params, state, inp, n, groups):
            state, outputs = fn(params, state, inp, n, groups)
            return state, outputs, state.requests.done

        def build(params, state, inputs, n, groups):
            return jax.jit(run, donate_argnums=1,
                           out_shardings=(_shardings(state), None, None))

        params = engine._tree(engine._params[mesh_index])
        return self._compiled("advance", mesh_index, build, params, state, inputs,
                              max_iterations, groups)(params, state, inputs, max_iterations,
                                                      groups)
