"""The agentic turn loop with Tunix's ToolAgent, ToolEnvironment and tools, unchanged, on a
scripted engine: multi-turn trajectories, masks that cover only model tokens in packed rows,
and every bad input's defined outcome (with the time it took and the message it left)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from tunix.rl.agentic.agents.tool_agent import ToolAgent
from tunix.rl.agentic.environments.tool_environment import ToolEnvironment
from tunix.rl.agentic.tools import base_tool
from tunix.rl.agentic.tools.calculator_tool import CalculatorTool

from tests.mp import REPO
from tunix_mcjax.agentic import rollout
from tunix_mcjax.agentic.conversation import Conversation
from tunix_mcjax.agentic.loop import TurnLimits, run_turns
from tunix_mcjax.agentic.parsers import PLAIN, ChatParser, load_chat_template
from tunix_mcjax.config import ConfigError, load_config
from tunix_mcjax.engine import Completion, Engine, SamplingParams
from tunix_mcjax.tokenizer import char_tokenizer
from tunix_mcjax.train import packing

TOK = char_tokenizer()
EOS = TOK.eos_token_id
RESULT = "Tool returned result: "
LIMITS = TurnLimits(max_total_tokens=4000, max_turn_tokens=200, tool_timeout_s=2.0,
                    max_concurrency=64)


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ScriptedEngine(Engine):
    """Answers each context with `script(context text)` and EOS; records every call's size."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompt_token_ids, sampling: SamplingParams, seed: int):
        self.calls.append(len(prompt_token_ids))
        out = []
        for p in prompt_token_ids:
            ids = TOK.encode(self.script(TOK.decode(list(p))), add_special_tokens=False) + [EOS]
            n = min(len(ids), sampling.max_new_tokens)
            out.append(Completion(np.asarray(ids[:n], np.int32), np.full(n, -0.5, np.float32),
                                  "eos" if n == len(ids) else "length"))
        return out

    def load_weights(self, params) -> None:
        pass

    @property
    def compile_count(self) -> int:
        return 0


def calculator_script(text: str) -> str:
    if RESULT not in text:
        return call("calculator", a=3, b=4, op="*")
    return text.rsplit(RESULT, 1)[1].split("\n")[0]  # the tool's answer, as the final answer


def exact(task, action):
    return float(action.strip() == task["answer"])


class SchemaTool(base_tool.BaseTool):
    def get_json_schema(self):
        return {"type": "function", "function": {"name": self.name, "parameters": {}}}


class RaisingTool(SchemaTool):
    """Always fails."""

    def apply(self, **kwargs):
        raise RuntimeError("lookup table is gone")


class HangingTool(SchemaTool):
    """Never answers in time."""

    def apply(self, **kwargs):
        time.sleep(30)
        return base_tool.ToolOutput(name=self.name, output="late")


class NumberEnvironment(ToolEnvironment):
    """A ToolEnvironment whose tool outputs are numbers, not strings."""

    def _execute_tool_calls(self, tool_calls):
        return {tc.get("id") or "0": 12 for tc in tool_calls}


def conversations(n, tool_map, *, env_cls=ToolEnvironment, max_steps=4, answer="12"):
    parser = ChatParser(TOK, PLAIN)
    return parser, [Conversation.start(
        ToolAgent(system_prompt="Use the tools.", tool_parser_name="qwen", tool_map=tool_map),
        env_cls(task={"question": "What is 3 * 4?", "answer": answer}, tool_map=tool_map,
                reward_fn=exact, max_steps=max_steps), parser) for _ in range(n)]


def run(script, tool_map, n=1, limits=LIMITS, **kwargs):
    parser, convs = conversations(n, tool_map, **kwargs)
    engine = ScriptedEngine(script)
    start = time.monotonic()
    rounds = run_turns(engine, convs, parser, SamplingParams(max_new_tokens=1), 7, limits)
    return convs, engine, rounds, time.monotonic() - start


def model_text(c: Conversation) -> str:
    return TOK.decode([t for t, m in zip(c.tokens, c.mask, strict=True) if m])


def test_multi_turn_tool_trajectory_and_its_packed_mask():
    convs, engine, rounds, _ = run(calculator_script, {"calculator": CalculatorTool}, n=3)
    for c in convs:
        assert (c.status, c.turns, c.tool_calls, c.tool_errors, c.reward) == \
            ("done", 2, 1, 0, 1.0)
        tool_text = TOK.decode([t for t, m in zip(c.tokens, c.mask, strict=True) if not m])
        assert tool_text == f"{RESULT}12\n"  # the observation only, no model token
        assert model_text(c).startswith("<tool_call>") and c.logprobs.count(-0.5) == sum(c.mask)
    assert engine.calls == [3, 3] and rounds == 2  # one generate per round, all conversations
    rows = packing.pack(rollout.sequences(convs, np.array([1.0, -1.0, 0.5])), 4000, pad_id=0)
    covered = rows.targets[rows.loss_mask == 1]
    expected = [t for c in convs for t, m in zip(c.tokens, c.mask, strict=True) if m]
    assert sorted(covered.tolist()) == sorted(expected)
    assert rows.loss_mask.sum() < sum(len(c.tokens) for c in convs)  # tool tokens carry none
    metrics = rollout.turn_metrics(convs)
    assert metrics["turns/mean"] == 2.0 and metrics["status/done"] == 3.0


def test_tool_that_raises_is_an_error_observation():
    convs, _, _, seconds = run(calculator_script, {"calculator": RaisingTool})
    c = convs[0]
    assert c.status == "done" and c.tool_errors == 1 and seconds < 2
    assert "Error: RuntimeError: lookup table is gone" in TOK.decode(c.tokens)


def test_tool_that_hangs_ends_the_trajectory_at_the_timeout():
    limits = TurnLimits(4000, 200, tool_timeout_s=0.5, max_concurrency=64)
    convs, _, _, seconds = run(calculator_script, {"calculator": HangingTool}, n=2, limits=limits)
    assert [c.status for c in convs] == ["tool_timeout"] * 2 and [c.reward for c in convs] == [0, 0]
    assert 0.5 <= seconds < 2.0  # both waited on together, not one after the other


def test_tool_output_that_is_not_a_string_is_an_error_observation():
    convs, _, _, _ = run(calculator_script, {"calculator": CalculatorTool},
                         env_cls=NumberEnvironment)
    assert "Error: the tool returned int, not a string" in TOK.decode(convs[0].tokens)
    assert convs[0].tool_errors == 1


def test_turn_without_a_tool_call_is_the_final_answer():
    convs, _, rounds, _ = run(lambda text: "12", {"calculator": CalculatorTool})
    assert (convs[0].status, convs[0].turns, convs[0].reward, rounds) == ("done", 1, 1.0, 1)


def test_context_limit_truncates_with_its_reason():
    parser, convs = conversations(1, {"calculator": CalculatorTool})
    limit = len(convs[0].prompt) + 10
    got, _, _, _ = run(calculator_script, {"calculator": CalculatorTool},
                       limits=TurnLimits(limit, 200, 2.0, 64))
    assert got[0].status == "context_exceeded" and len(got[0].context()) == limit


def test_max_steps_ends_with_max_turns():
    convs, _, _, _ = run(lambda text: call("calculator", a=1, b=1, op="+"),
                         {"calculator": CalculatorTool}, max_steps=3)
    assert (convs[0].status, convs[0].turns, convs[0].reward) == ("max_turns", 3, 0.0)


def test_max_concurrency_bounds_each_generate_call():
    limits = TurnLimits(4000, 200, 2.0, max_concurrency=2)
    _, engine, _, _ = run(calculator_script, {"calculator": CalculatorTool}, n=5, limits=limits)
    assert engine.calls == [2, 2, 1, 2, 2, 1]


def test_chat_template_file_is_checked(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"system": "{content}"}))
    with pytest.raises(ConfigError, match="needs string role formats for user, assistant"):
        load_chat_template(str(bad))
    good = tmp_path / "g.json"
    good.write_text(json.dumps({**PLAIN, "generation": "A:"}))
    assert ChatParser(TOK, load_chat_template(str(good))).render(
        [{"role": "user", "content": "hi"}], generation=True) == "hi\nA:"


def test_an_agentic_run_names_its_environment():
    """No demo module is the default: an agentic run without agentic_environment is refused,
    naming the key; the demo recipe names the demo's."""
    recipe = REPO / "recipes/cpu/demo_agentic.yml"
    assert load_config(recipe, []).agentic_environment == \
        "tunix_mcjax.agentic.demo:lookup_conversation"
    with pytest.raises(ConfigError, match="needs agentic_environment=package.module:function"):
        load_config(recipe, ["agentic_environment="])
