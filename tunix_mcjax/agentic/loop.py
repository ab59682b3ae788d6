"""The turn loop on one host's engine: every running conversation's next model turn is decoded
in one round (the engine batches them continuously), then every environment steps at once,
each on its own thread under a timeout.

On an engine whose session keeps pages (jax, maxtext: `engine.session`) the rounds run on one
session that keeps each conversation's pages between turns (`join(keep=True,
continue_from=...)`): a turn prefills only the tokens added since the last (the tools', and the
last sampled token), unless page pressure evicted the conversation, which is then prefilled in
full; the samples are those of a full re-prefill. A group's equal first prompts join as one
group, so the prompt is prefilled once and its full pages are shared by the group's kept
conversations. Other engines (vllm, whose session refuses `keep`) take a `generate` per round.

A conversation waiting on its tool holds no decode slot: it is out of the engine until the
round's tools have answered (or timed out). Rounds are deterministic in (seed, round), so a
host's trajectories are deterministic in its seed. Bad input has a defined outcome:

| what happens | outcome |
|---|---|
| a tool raises | Tunix's ToolManager returns `Error: <type>: <message>` as its output |
| the environment's step raises | an error observation (`Error: ...`), the conversation goes on |
| a tool output is not a string | an error observation naming the type |
| the step outlasts `tool_timeout_s` | the trajectory ends, status `tool_timeout`, reward 0 |
| the model's turn holds no tool call | Tunix's ToolAgent: the turn is the final answer |
| the context reaches `max_total_tokens` | the trajectory ends, status `context_exceeded` |
| the environment's `max_steps` | the trajectory ends, status `max_turns` |
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tunix_mcjax.agentic.conversation import Conversation
from tunix_mcjax.agentic.parsers import ChatParser
from tunix_mcjax.engine import Completion, Engine, SamplingParams


@dataclasses.dataclass(frozen=True)
class TurnLimits:
    max_total_tokens: int  # prompt + conversation (max_target_length)
    max_turn_tokens: int  # tokens of one model turn
    tool_timeout_s: float  # one round's environment steps
    max_concurrency: int  # conversations decoded in one generate call


@dataclasses.dataclass
class _Step:
    """One environment step on its own thread: (observation, reward, done, info) or error."""

    result: tuple | None = None
    error: BaseException | None = None

    def run(self, env: Any, action: Any) -> None:
        try:
            self.result = env.step(action)
        except Exception as e:  # noqa: BLE001 - any failure of user code is an observation
            self.error = e


@dataclasses.dataclass(frozen=True)
class TurnRun:
    """What a host's turn loop took: engine rounds, and the prompt tokens prefilled against a
    full re-prefill of every turn's context (the difference: what kept pages saved)."""

    rounds: int
    prefill_tokens: int
    prefill_tokens_full: int

    @property
    def prefill_tokens_saved(self) -> int:
        return self.prefill_tokens_full - self.prefill_tokens


def run_turns(engine: Engine, conversations: Sequence[Conversation], parser: ChatParser,
              sampling: SamplingParams, seed: int, limits: TurnLimits) -> int:
    """Runs every conversation to its end; returns the number of rounds."""
    return run_turns_counted(engine, conversations, parser, sampling, seed, limits).rounds


def run_turns_counted(engine: Engine, conversations: Sequence[Conversation], parser: ChatParser,
                      sampling: SamplingParams, seed: int, limits: TurnLimits,
                      keep_pages: bool = False) -> TurnRun:
    """`run_turns`, counting prefill; `keep_pages=False` decodes a `generate` per round on
    any engine."""
    decoder = _open_decoder(engine, sampling, conversations, limits, keep_pages)
    rounds = 0
    try:
        while running := [c for c in conversations if c.running]:
            for start in range(0, len(running), limits.max_concurrency):
                chunk = running[start:start + limits.max_concurrency]
                _one_round(decoder, chunk, parser, sampling, seed * 1_000_003 + rounds, limits)
                decoder.release_ended(chunk)
                rounds += 1
    finally:
        decoder.close()
    return TurnRun(rounds, decoder.prefill_tokens(), decoder.full)


class _Generate:
    """A `generate` per round: every context prefilled in full."""

    def __init__(self, engine: Engine):
        self.engine, self.full, self.counted = engine, 0, 0

    def decode_round(self, chunk: list[Conversation], sampling: SamplingParams,
                     seed: int) -> list[Completion]:
        contexts = [c.context() for c in chunk]
        self.full += sum(map(len, contexts))
        out = self.engine.generate(contexts, sampling, seed)
        stats = getattr(self.engine, "last_stats", None) or []
        self.counted += sum(s.get("prefill_tokens", 0) for s in stats)
        return out

    def prefill_tokens(self) -> int:
        """The engine's counters where it has them (jax, maxtext), else every context."""
        return self.counted or self.full

    def release_ended(self, chunk: list[Conversation]) -> None:
        pass

    def close(self) -> None:
        pass


class _KeptPages:
    """The rounds on one session that keeps each conversation's pages between its turns."""

    def __init__(self, session: Any):
        self.session, self.full = session, 0
        self.kept: dict[int, int] = {}  # id(conversation) -> its last request, kept

    def decode_round(self, chunk: list[Conversation], sampling: SamplingParams,
                     seed: int) -> list[Completion]:
        """The chunk's turns, each cut at `sampling.max_new_tokens` as `generate` would cut
        it (the session decodes up to the turn cap; the keys are the same)."""
        contexts = [c.context() for c in chunk]
        self.full += sum(map(len, contexts))
        previous = [self.kept.pop(id(c), None) for c in chunk]
        ids = self.session.join(contexts, seed, group_size=equal_runs(contexts, previous),
                                keep=True, continue_from=previous)
        done: dict[int, Completion] = {}
        while self.session.unfinished:
            done.update(self.session.step())
        kept = set(self.session.kept)
        for c, request_id in zip(chunk, ids, strict=True):
            if request_id in kept:
                self.kept[id(c)] = request_id
        return [_cut(done[i], sampling.max_new_tokens) for i in ids]

    def prefill_tokens(self) -> int:
        return sum(stats.get("prefill_tokens", 0) for stats in self.session.last_stats)

    def release_ended(self, chunk: list[Conversation]) -> None:
        ended = [self.kept.pop(id(c)) for c in chunk if not c.running and id(c) in self.kept]
        if ended:
            self.session.release(ended)

    def close(self) -> None:
        self.session.close()


def equal_runs(contexts: Sequence[np.ndarray], previous: Sequence[int | None]) -> list[int]:
    """A round's join groups: each run of consecutive equal contexts that continue nothing
    (a GRPO group's first turn, prefilled once), and each continuing conversation alone."""
    sizes: list[int] = []
    for i, context in enumerate(contexts):
        if (i and previous[i] is None and previous[i - 1] is None
                and np.array_equal(context, contexts[i - 1])):
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


def _cut(completion: Completion, max_new: int) -> Completion:
    if len(completion.tokens) <= max_new:
        return completion
    return dataclasses.replace(completion, tokens=completion.tokens[:max_new],
                               logprobs=completion.logprobs[:max_new], finish_reason="length")


def kept_session_capacity(conversations: int, shared_prompts: int,
                          max_concurrency: int) -> tuple[int, int]:
    """(max_requests, max_prompts) of the session that keeps `conversations`' pages: a turn of
    each at once, up to `max_concurrency`; a prompt slot a conversation, and one more a first
    prompt its group shares (`shared_prompts`). The planner sizes the session so too."""
    return min(conversations, max_concurrency), conversations + shared_prompts


def _open_decoder(engine: Engine, sampling: SamplingParams,
                  conversations: Sequence[Conversation], limits: TurnLimits,
                  keep_pages: bool) -> Any:
    """A session that keeps pages where the engine has one (and `keep_pages`), else
    `generate` per round."""
    if not keep_pages or not hasattr(engine, "session") or not conversations:
        return _Generate(engine)
    groups = equal_runs([c.context() for c in conversations], [None] * len(conversations))
    max_requests, max_prompts = kept_session_capacity(
        len(conversations), sum(g > 1 for g in groups), limits.max_concurrency)
    try:
        session = engine.session(
            dataclasses.replace(sampling, max_new_tokens=limits.max_turn_tokens),
            max_requests=max_requests, max_prompts=max_prompts,
            group_size=min(max(groups), limits.max_concurrency))
    except NotImplementedError:  # a lockstep / wave-batched loop
        return _Generate(engine)
    if not session.keeps_pages:  # vllm, or routing replay (it needs every token's experts)
        session.close()
        return _Generate(engine)
    return _KeptPages(session)


def _one_round(decoder: Any, chunk: list[Conversation], parser: ChatParser,
               sampling: SamplingParams, seed: int, limits: TurnLimits) -> None:
    room = {id(c): limits.max_total_tokens - len(c.context()) for c in chunk}
    for c in chunk:
        if room[id(c)] < 1:
            c.end("context_exceeded")
    ready = [c for c in chunk if c.running]
    if not ready:
        return
    max_new = min(limits.max_turn_tokens, max(room[id(c)] for c in ready))
    done = decoder.decode_round(ready, dataclasses.replace(sampling, max_new_tokens=max_new),
                                seed)
    steps: list[tuple[Conversation, _Step, threading.Thread]] = []
    for c, completion in zip(ready, done, strict=True):
        keep = room[id(c)]
        c.add_model_turn(completion.tokens[:keep], completion.logprobs[:keep])
        if len(completion.tokens) > keep or (completion.finish_reason == "length"
                                             and len(completion.tokens) == keep):
            c.end("context_exceeded")  # the turn was cut at the context's end
            continue
        text = parser.tokenizer.decode(completion.tokens, skip_special_tokens=True)
        action = c.agent.update_from_model(text).action
        step = _Step()
        thread = threading.Thread(target=step.run, args=(c.env, action), daemon=True)
        thread.start()
        steps.append((c, step, thread))
    deadline = time.monotonic() + limits.tool_timeout_s
    for c, step, thread in steps:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            c.end("tool_timeout")  # the thread is a daemon: it cannot hold the process
        else:
            _observe(c, step, parser, limits)


def _observe(c: Conversation, step: _Step, parser: ChatParser, limits: TurnLimits) -> None:
    if step.error is not None:
        observation, reward, done, info = (
            {"tool_outputs": {"error": f"Error: {type(step.error).__name__}: {step.error}"}},
            0.0, False, {})
    else:
        observation, reward, done, info = step.result
    outputs = observation.get("tool_outputs") if isinstance(observation, dict) else None
    if outputs:
        c.tool_calls += 1
        for key, value in list(outputs.items()):
            if not isinstance(value, str):
                outputs[key] = f"Error: the tool returned {type(value).__name__}, not a string"
        c.tool_errors += sum(1 for v in outputs.values() if v.startswith("Error"))
    if done:
        c.end("max_turns" if outputs else "done", reward)
        return
    c.agent.update_from_env(observation, reward, done, info)
    messages = c.agent.chat_completions
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    tokens = parser.tokens(messages[last + 1:], generation=True)
    if len(c.context()) + len(tokens) >= limits.max_total_tokens:
        c.end("context_exceeded")
        return
    c.add_observation(np.asarray(tokens, np.int32))
