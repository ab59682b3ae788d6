"""The per-host rollout engine interface. An engine only ever touches its host's devices."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

FinishReason = Literal["eos", "stop", "length"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. `greedy` (or top_k=1) picks argmax; top_k=0 and top_p=1.0 are off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclasses.dataclass(frozen=True)
class Completion:
    """One generated sequence: sampled tokens (stop token included), logprobs, why it ended."""

    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n], log p(token) under the sampling distribution's logits
    finish_reason: FinishReason
    # int32 [prompt + n, MoE layers, k]: the experts each prompt and completion token went to,
    # -1 where none ran (the last completion token); None unless the engine records routing.
    routing: np.ndarray | None = None


class Engine(abc.ABC):
    """Generates completions on local devices and takes new weights between steps."""

    @abc.abstractmethod
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        """Completions in request order. Same (requests, sampling, seed) -> same output."""

    @abc.abstractmethod
    def load_weights(self, params: Any) -> None:
        """Takes a param tree of the engine's model as a nested dict of arrays (Tunix Qwen3's
        for the jax and vllm engines, MaxText's own for the maxtext engine).

        Leaves may be numpy arrays or jax Arrays replicated over this host's devices (a global
        fully-replicated array works: each device's addressable shard is used in place). The jax
        and maxtext engines take partial trees (absent leaves keep their value); the vllm engine
        takes only the whole tree (vLLM would accept a partial reload silently, so it refuses).
        """

    @property
    @abc.abstractmethod
    def compile_count(self) -> int:
        """How many programs the engine has compiled so far."""

    @property
    def decodes_in_slices(self) -> bool:
        """Whether `session(sampling, max_requests, ...)` gives a sliced decode (a
        `engine.session.DecodeSession`, the same samples as `generate`)."""
        return False
