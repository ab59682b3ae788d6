"""A tool demo for tiny CPU models: the reward needs the tool's answer.

Every trajectory has its own secret digit that only the `lookup` tool returns. A model turn that
is one digit is the answer; any other turn calls `lookup` (the compact tool syntax below), whose
observation carries the digit. An environment allows two turns. The task's reward
(`tasks.lookup_reward`) is 1.0 for the right digit after a call and 0 otherwise: an answer
without the tool earns nothing, so the random-init policy scores about 1 in 100 (a call, then the
right digit by chance).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tunix.rl.agentic.agents.tool_agent import ToolAgent
from tunix.rl.agentic.environments.tool_environment import ToolEnvironment
from tunix.rl.agentic.parser.tool_parser import tool_parser_registry
from tunix.rl.agentic.parser.tool_parser.tool_parser_base import ToolParser
from tunix.rl.agentic.tools import base_tool


class CompactToolParser(ToolParser):
    """A turn that is not one digit calls `lookup`; no tool prompt (tiny contexts)."""

    def parse(self, model_response: str) -> list[base_tool.ToolCall]:
        text = model_response.strip()
        if len(text) == 1 and text.isdigit():
            return []
        return [base_tool.ToolCall(name="lookup", arguments={})]

    def get_tool_prompt(self, tools, *, schema_style="openai") -> str:
        return ""


def register_parser() -> None:
    """Makes "compact" a name Tunix's ToolAgent resolves (its registry has no public add)."""
    tool_parser_registry._PARSER_REGISTRY.setdefault("compact", CompactToolParser)


def lookup_tool(value: str) -> type[base_tool.BaseTool]:
    """A tool class whose every call returns `value` (one class per trajectory)."""

    class LookupTool(base_tool.BaseTool):
        """Returns this episode's secret digit."""

        def get_json_schema(self) -> dict[str, Any]:
            return {"type": "function", "function": {"name": self.name, "parameters": {}}}

        def apply(self, **kwargs: Any) -> base_tool.ToolOutput:
            return base_tool.ToolOutput(name=self.name, output=value)

    return LookupTool


def answer_matches(task: dict, action: str) -> float:
    return float(action.strip() == task["value"])


def lookup_conversation(prompt: str, fields: dict[str, Any], *, seed: int,
                        system_prompt: str) -> tuple[ToolAgent, ToolEnvironment]:
    """(agent, environment) of one trajectory; its secret digit comes from `seed`."""
    register_parser()
    value = str(np.random.default_rng(seed).integers(10))
    tools = {"lookup": lookup_tool(value)}
    agent = ToolAgent(system_prompt=system_prompt, tool_parser_name="compact", tool_map=tools)
    env = ToolEnvironment(task={"question": prompt, "value": value}, tool_map=tools,
                          reward_fn=answer_matches, max_steps=2)
    return agent, env
