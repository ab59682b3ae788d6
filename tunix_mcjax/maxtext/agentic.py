"""MaxText's agentic path on our turn loop: its conversation classes and its chat parser.

With `rl.use_agentic_rollout=true` MaxText's train_rl hands Tunix's agentic learner its
default agent and environment (a `ModelAgent` and a `TaskEnvironment` over the row: one turn,
scored by MaxText's reward functions) and `utils_rl.MaxTextChatParser`, built from
`data_template_path`. Here both run unchanged inside `tunix_mcjax.agentic`'s turn loop on each
host's engine: `task_conversation` is the default `agentic_environment`, `chat_parser` wraps
MaxText's parser in our `ChatParser` interface (`tokenizer`, `tokens(messages, generation)`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tunix.rl.agentic.agents.model_agent import ModelAgent
from tunix.rl.agentic.environments.task_environment import TaskEnvironment

from tunix_mcjax.config import ConfigError


def task_conversation(prompt: str, fields: dict[str, Any], *, seed: int,
                      system_prompt: str) -> tuple[ModelAgent, TaskEnvironment]:
    """MaxText's agent and environment of one row: the raw question as the user's turn, one
    model turn; the environment's reward is 0 (MaxText gives it no reward_fn), the reward
    functions score the turn."""
    del seed  # the row decides the task
    return ModelAgent(system_prompt=system_prompt), \
        TaskEnvironment({"prompts": prompt, **fields}, reward_fn=None)


class MaxTextParser:
    """MaxText's chat parser behind our ChatParser interface: every rendering (the prompt and
    each observation) is `MaxTextChatParser.parse`, tokenized without special tokens."""

    def __init__(self, parser: Any, tokenizer: Any):
        self.parser, self.tokenizer = parser, tokenizer

    def render(self, messages: list[dict[str, Any]], generation: bool) -> str:
        return self.parser.parse(messages=list(messages), add_generation_prompt=generation)

    def tokens(self, messages: list[dict[str, Any]], generation: bool) -> np.ndarray:
        text = self.render(messages, generation)
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.int32)


def chat_parser(config: Any, tokenizer: Any) -> MaxTextParser:
    """MaxText's parser for this run, as train_rl builds it (a template is required there)."""
    from maxtext.input_pipeline.instruction_data_processing import load_data_template_from_file
    from maxtext.trainers.post_train.rl import utils_rl

    template = load_data_template_from_file(config.data_template_path)
    if template is None:
        raise ConfigError(
            f"data_template_path={config.data_template_path!r}: rl.use_agentic_rollout=true "
            "needs MaxText's data template (JSON with SYSTEM_PROMPT and TEMPLATE) for its chat "
            "parser; give a path MaxText finds (absolute, or relative to the maxtext package's "
            "parent directory)")
    return MaxTextParser(utils_rl.MaxTextChatParser(
        model_tokenizer=tokenizer, template_config=template, tmvp_config=config), tokenizer)
