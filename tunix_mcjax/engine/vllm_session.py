"""A decode session on the vllm engine: `generate`'s vLLM requests, stepped by the caller.

`VllmEngine.session(sampling, max_requests=...)` opens one on the engine's `vllm.LLM`, through
vLLM's engine-level API (`llm.llm_engine`: add_request, step, abort_request), the calls
`LLM.generate` makes itself. `join(prompts, seed)` adds the requests `generate(prompts,
sampling, seed)` would send (runs of equal prompts as one request of n samples, run r seeded
`request_seed(seed, r)`, final outputs only), so each sample is the one `generate` gives it.
`step` runs at most N `LLMEngine.step()`s (one scheduler iteration each: a forward over the
running batch), or steps until a time budget is spent (at least one), and returns the groups
that became whole, built as `generate` builds its `Completion`s. A group of a join comes back
once every vLLM request holding its samples is done (a run of equal prompts is one request).

Refused by name: `keep` and `continue_from` (vLLM's prefix cache already keeps a finished
request's pages, unpinned, for any later prompt that extends it, so `generate` per turn gets
them without a session) and `lengths()` (final outputs carry no count of tokens so far).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tunix_mcjax.engine.base import Completion, SamplingParams
from tunix_mcjax.engine.session import check_slice, split_groups

_SESSIONS = itertools.count()  # vLLM request ids: distinct per session, never generate's


class VllmSession:
    """Sliced decoding on `engine`'s vLLM engine with one `sampling`. Capacity: `max_requests`
    samples joined and not yet returned, prompts of at most `max_prompt_length` tokens (default
    the engine's). `max_prompts` and `group_size` size the jax engine's programs; vLLM's
    scheduler places requests itself, so here they are only checked. Close it (or use it as a
    context manager) to abort what is left and give `generate` its engine back."""

    keeps_pages = False  # `join` refuses keep and continue_from

    def __init__(self, engine: Any, sampling: SamplingParams, max_requests: int,
                 max_prompts: int | None = None, max_prompt_length: int | None = None,
                 group_size: int = 1):
        if max_requests < 1 or (max_prompts or 1) < 1 or group_size < 1:
            raise ValueError("max_requests, max_prompts and group_size must be >= 1")
        cap = engine.max_prompt_length
        if max_prompt_length is not None and not 1 <= max_prompt_length <= cap:
            raise ValueError(f"max_prompt_length={max_prompt_length} must be in 1..{cap} (the "
                             "engine's max_prompt_length)")
        self.engine, self.sampling = engine, sampling
        self.max_requests, self.prompt_len = max_requests, max_prompt_length or cap
        self._llm_engine = engine.llm.llm_engine
        self._prefix = f"tunix-session-{next(_SESSIONS)}-"
        self._requests: dict[str, list[int]] = {}  # vLLM request id -> its samples' ids
        self._done: dict[int, Completion] = {}  # finished samples of undelivered groups
        self._groups: list[tuple[int, ...]] = []  # undelivered groups, by request id
        self._next_id, self._next_request, self._open = 0, 0, True

    def join(self, prompt_token_ids: Sequence[Sequence[int]], seed: int,
             group_size: int | Sequence[int] = 1, keep: bool = False,
             continue_from: Sequence[int | None] | None = None) -> list[int]:
        """Add requests, in groups of `group_size` consecutive ones (a sequence: each group's
        size), sampled as `generate(prompt_token_ids, sampling, seed)` samples them. Returns
        their request ids (`step`'s keys). A join that does not fit changes nothing."""
        self._check_open()
        if keep or any(c is not None for c in continue_from or ()):
            raise NotImplementedError(
                "VllmSession does not keep pages (keep, continue_from): vLLM's prefix cache "
                "already keeps a finished request's pages (unpinned) for a later prompt that "
                "extends it; join without them, or use generate() per turn")
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        self.engine._validate(prompts, self.sampling)
        groups = split_groups(len(prompts), group_size)
        longest = max(map(len, prompts))
        if longest > self.prompt_len:
            raise ValueError(f"a prompt of {longest} tokens does not fit the session's "
                             f"max_prompt_length={self.prompt_len}: open the session with a "
                             "larger max_prompt_length")
        if self.unfinished + len(prompts) > self.max_requests:
            raise ValueError(f"the join does not fit the session: {len(prompts)} requests with "
                             f"{self.max_requests - self.unfinished} of max_requests="
                             f"{self.max_requests} free: step until groups come back, or open "
                             "the session with a larger max_requests")
        requests = self.engine.requests(prompts, self.sampling, seed)
        from vllm.sampling_params import RequestOutputKind

        first = self._next_id
        for prompt, params, n in requests:
            params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate sends it
            request_id = f"{self._prefix}{self._next_request}"
            self._llm_engine.add_request(request_id, prompt, params)
            self._requests[request_id] = list(range(self._next_id, self._next_id + n))
            self._next_request, self._next_id = self._next_request + 1, self._next_id + n
        self._groups += [tuple(first + i for i in g) for g in groups]
        return list(range(first, self._next_id))

    def step(self, max_iterations: int | None = None, time_budget_s: float | None = None,
             until_group: bool = False) -> dict[int, Completion]:
        """Run vLLM on: at most `max_iterations` engine steps (None: until every request is
        done); with `time_budget_s`, steps until that time is spent (at least one); with
        `until_group`, until a group is whole. Returns the requests of the groups that
        became whole, by request id."""
        self._check_open()
        check_slice(max_iterations, time_budget_s, "engine step")
        deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
        steps = 0
        while self._requests and (max_iterations is None or steps < max_iterations):
            for output in self._llm_engine.step():
                if output.finished:
                    self._finish(output)
            steps += 1
            if deadline is not None and time.monotonic() >= deadline:
                break
            if until_group and any(map(self._is_whole, self._groups)):
                break
        return self._whole_groups()

    def _finish(self, output: Any) -> None:
        ids = self._requests.pop(output.request_id)
        completions = self.engine.completions(output, len(ids), self.sampling)
        self._done.update(zip(ids, completions, strict=True))

    def _is_whole(self, group: tuple[int, ...]) -> bool:
        return all(i in self._done for i in group)

    def _whole_groups(self) -> dict[int, Completion]:
        whole = [g for g in self._groups if self._is_whole(g)]
        self._groups = [g for g in self._groups if g not in whole]
        return {i: self._done.pop(i) for g in whole for i in g}

    @property
    def unfinished(self) -> int:
        """Requests joined and not yet returned."""
        return sum(map(len, self._groups))

    @property
    def in_vllm(self) -> int:
        """vLLM requests added and not yet finished (a run of equal prompts is one)."""
        return len(self._requests)

    def lengths(self) -> dict[int, int]:
        raise NotImplementedError(
            "VllmSession.lengths(): its requests return final outputs only, with no count of "
            "tokens sampled so far; in-flight weight updates need rollout_engine=jax")

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError("the session is closed: open another with engine.session()")

    def close(self) -> None:
        """Abort the requests still in vLLM and give the engine back to `generate`."""
        if self._requests:
            self._llm_engine.abort_request(list(self._requests))
        self._requests, self._groups, self._done, self._open = {}, [], {}, False
        self.engine._close_session(self)

    def __enter__(self) -> VllmSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

