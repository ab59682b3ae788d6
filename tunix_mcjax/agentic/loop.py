"""The turn loop on one host's engine: every running conversation's next model turn is decoded
in one `generate` call (the engine batches them continuously), then every environment steps
at once, each on its own thread under a timeout.

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
from tunix_mcjax.engine import Engine, SamplingParams


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


def run_turns(engine: Engine, conversations: Sequence[Conversation], parser: ChatParser,
              sampling: SamplingParams, seed: int, limits: TurnLimits) -> int:
    """Runs every conversation to its end; returns the number of rounds."""
    rounds = 0
    while running := [c for c in conversations if c.running]:
        for start in range(0, len(running), limits.max_concurrency):
            chunk = running[start:start + limits.max_concurrency]
            _one_round(engine, chunk, parser, sampling, seed * 1_000_003 + rounds, limits)
            rounds += 1
    return rounds


def _one_round(engine: Engine, chunk: list[Conversation], parser: ChatParser,
               sampling: SamplingParams, seed: int, limits: TurnLimits) -> None:
    room = {id(c): limits.max_total_tokens - len(c.context()) for c in chunk}
    for c in chunk:
        if room[id(c)] < 1:
            c.end("context_exceeded")
    ready = [c for c in chunk if c.running]
    if not ready:
        return
    max_new = min(limits.max_turn_tokens, max(room[id(c)] for c in ready))
    done = engine.generate([c.context() for c in ready],
                           dataclasses.replace(sampling, max_new_tokens=max_new), seed)
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
