"""One trajectory in the making: a Tunix agent and environment, and the tokens so far.

The prompt is the agent's first messages rendered with the generation opener; after it, the
conversation alternates the model's sampled tokens (mask 1, with their logprobs) and the
rendered observations (mask 0). `status` says why it ended.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

from tunix_mcjax.agentic.parsers import ChatParser

Status = Literal["running", "done", "max_turns", "context_exceeded", "tool_timeout"]


@dataclasses.dataclass
class Conversation:
    agent: Any  # tunix.rl.agentic agent (ToolAgent)
    env: Any  # tunix.rl.agentic environment (ToolEnvironment)
    prompt: np.ndarray  # int32 prompt tokens
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0  # model turns
    tool_calls: int = 0  # observations of tool outputs received
    tool_errors: int = 0  # of those, error observations
    reward: float = 0.0  # the environment's reward at the end
    status: Status = "running"

    @classmethod
    def start(cls, agent: Any, env: Any, parser: ChatParser) -> Conversation:
        """Resets both (Tunix's collect engine's `_reset`) and renders the prompt."""
        observation, _ = env.reset()
        agent.reset()
        agent.update_from_env(observation=observation, reward=0.0, done=False, info={})
        return cls(agent, env, parser.tokens(agent.chat_completions, generation=True))

    @property
    def running(self) -> bool:
        return self.status == "running"

    def context(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.asarray(self.tokens, np.int32)])

    def add_model_turn(self, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        self.tokens += [int(t) for t in tokens]
        self.mask += [1.0] * len(tokens)
        self.logprobs += [float(x) for x in logprobs]
        self.turns += 1

    def add_observation(self, tokens: np.ndarray) -> None:
        self.tokens += [int(t) for t in tokens]
        self.mask += [0.0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)

    def end(self, status: Status, reward: float = 0.0) -> None:
        self.status, self.reward = status, float(reward)
