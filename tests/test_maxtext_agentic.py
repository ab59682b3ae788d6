"""MaxText's agentic path under rl_runtime=mcjax: its `rl.*` agentic keys in MaxText's meaning,
its agent, environment and chat parser in our turn loop, and its CPU recipe on 2 hosts."""

from __future__ import annotations

import multiprocessing.pool  # noqa: F401  MaxText's math_verify_pool uses it without importing it
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("maxtext")

from maxtext.trainers.post_train.rl import utils_rl  # noqa: E402
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # noqa: E402

from tests.mp import REPO, read_jsonl  # noqa: E402
from tunix_mcjax.agentic.conversation import Conversation  # noqa: E402
from tunix_mcjax.agentic.loop import TurnLimits, run_turns  # noqa: E402
from tunix_mcjax.config import ConfigError  # noqa: E402
from tunix_mcjax.engine import Completion, Engine, SamplingParams  # noqa: E402
from tunix_mcjax.maxtext import agentic, checked_config, data  # noqa: E402

TINY_MODEL = ["model_name=qwen3-0.6b", "override_model_config=true", "base_num_decoder_layers=2",
              "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16",
              "base_mlp_dim=128", "weight_dtype=float32", "dtype=float32", "hardware=cpu",
              "convert_checkpoint_if_possible=false", "tokenizer_path=qwen3-tokenizer"]
AGENTIC = "rl.use_agentic_rollout=true"


def argv(*overrides: str) -> list[str]:
    return ["", f"{MAXTEXT_CONFIGS_DIR}/post_train/rl.yml", *TINY_MODEL, "log_config=false",
            *overrides]


def test_agentic_keys_land_in_config():
    _, cfg, not_applied = checked_config(argv(
        AGENTIC, "rl.epsilon_high=0.28", "rl.off_policy_steps=2", "rl.max_concurrency=8",
        "rl.system_prompt=Use the tool.", "rl.use_rollout_logps=false",
        "rl.force_on_policy_ratio=true", "agentic_max_turn_tokens=4",
        "agentic_tool_timeout_s=5", "agentic_environment=tunix_mcjax.agentic.demo:"
        "lookup_conversation"), {}, num_hosts=2)
    assert not_applied == {}
    got = {k: getattr(cfg, k) for k in (
        "use_agentic_rollout", "epsilon_high", "off_policy_steps", "max_concurrency",
        "system_prompt", "use_rollout_logps", "force_on_policy_ratio", "agentic_max_turn_tokens",
        "agentic_tool_timeout_s", "agentic_environment")}
    assert got == {"use_agentic_rollout": True, "epsilon_high": 0.28, "off_policy_steps": 2,
                   "max_concurrency": 8, "system_prompt": "Use the tool.",
                   "use_rollout_logps": False, "force_on_policy_ratio": True,
                   "agentic_max_turn_tokens": 4, "agentic_tool_timeout_s": 5.0,
                   "agentic_environment": "tunix_mcjax.agentic.demo:lookup_conversation"}


def test_agentic_defaults_are_maxtexts():
    """rl.yml's epsilon_high null is grpo_epsilon (-1 here); the environment is MaxText's."""
    _, cfg, _ = checked_config(argv(AGENTIC), {}, num_hosts=1)
    assert (cfg.epsilon_high, cfg.off_policy_steps, cfg.max_concurrency) == (-1.0, 0, 256)
    assert cfg.agentic_environment == agentic.__name__ + ":task_conversation"
    _, plain, _ = checked_config(argv(), {}, num_hosts=1)
    assert not plain.use_agentic_rollout


@pytest.mark.parametrize("key", [
    "rl.epsilon_high=0.28", "rl.off_policy_steps=1", "rl.max_concurrency=8",
    "rl.system_prompt=hi", "rl.use_rollout_logps=false", "rl.force_on_policy_ratio=true",
    "rl.log_sampler_trainer_agreement=true", "agentic_max_turn_tokens=4"])
def test_agentic_keys_without_agentic_rollout_are_refused_by_name(key):
    with pytest.raises(ConfigError) as err:
        checked_config(argv(key), {}, num_hosts=1)
    assert key.split("=")[0] in str(err.value)
    assert "rl.use_agentic_rollout=true" in str(err.value)


@pytest.mark.parametrize("overrides,match", [
    ([AGENTIC, "rl.force_on_policy_ratio=true", "rl.num_iterations=2"],
     r"force_on_policy_ratio=true pins the ratio to 1.*set num_iterations=1 \(got 2\)"),
    ([AGENTIC, "rollout_engine=vllm", "rl_publish_weights_single_call=true"],
     "use_agentic_rollout=true decodes turns on our decode loop"),
])
def test_agentic_combinations_the_runtime_cannot_run_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        checked_config(argv(*overrides), {}, num_hosts=1)


def test_agentic_recipe_keys_land_in_config(tmp_path):
    lines = (REPO / "recipes/maxtext/cpu/qwen3_tiny_agentic.args").read_text().splitlines()
    args = [s.strip() for s in lines if s.strip() and not s.startswith("#")]
    _, cfg, not_applied = checked_config(
        ["", f"{MAXTEXT_CONFIGS_DIR}/post_train/rl.yml", *args,
         f"base_output_directory={tmp_path}"], {}, num_hosts=2)
    assert not_applied == {}
    assert (cfg.use_agentic_rollout, cfg.epsilon_high, cfg.off_policy_steps,
            cfg.max_concurrency, cfg.agentic_max_turn_tokens) == (True, 0.28, 1, 8, 4)
    assert cfg.agentic_environment == "tunix_mcjax.agentic.demo:lookup_conversation"


class OneTokenEngine(Engine):
    """Answers every context with token `answer` and stops (finish reason eos)."""

    def __init__(self, answer: int):
        self.answer, self.contexts = answer, []

    def generate(self, prompt_token_ids, sampling: SamplingParams, seed: int):
        self.contexts += [np.asarray(p) for p in prompt_token_ids]
        return [Completion(np.array([self.answer], np.int32), np.array([-0.5], np.float32),
                           "eos") for _ in prompt_token_ids]

    def load_weights(self, params) -> None:
        pass

    @property
    def compile_count(self) -> int:
        return 0


def test_maxtext_agent_environment_and_parser_in_our_turn_loop():
    """MaxText's ModelAgent + TaskEnvironment: one turn on the prompt MaxText's own parser
    renders, ended by the environment (status done), only the model's token under loss."""
    config, _, _ = checked_config(argv(AGENTIC, "rl.system_prompt=Be brief."), {}, 1)
    tokenizer = data.load_tokenizer(config)
    parser = agentic.chat_parser(config, tokenizer)
    agent, env = agentic.task_conversation("What is 2+2?", {"question": "What is 2+2?",
                                                            "answer": "4"}, seed=0,
                                           system_prompt=config.rl.system_prompt)
    conv = Conversation.start(agent, env, parser)
    own = utils_rl.MaxTextChatParser(tokenizer, parser.parser.template_config, config).parse(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        add_generation_prompt=True)
    np.testing.assert_array_equal(conv.prompt,
                                  tokenizer.encode(own, add_special_tokens=False))
    engine = OneTokenEngine(answer=tokenizer.encode("4", add_special_tokens=False)[0])
    rounds = run_turns(engine, [conv], parser, SamplingParams(max_new_tokens=8), seed=0,
                       limits=TurnLimits(1024, 8, 5.0, 8))
    assert (rounds, conv.turns, conv.status, conv.mask) == (1, 1, "done", [1.0])


def test_missing_data_template_is_refused_by_name():
    config, _, _ = checked_config(argv(AGENTIC, "data_template_path=no/such.json"), {}, 1)
    with pytest.raises(ConfigError, match=r"data_template_path='no/such.json'.*SYSTEM_PROMPT"):
        agentic.chat_parser(config, tokenizer=None)


@pytest.mark.bench  # one 2-host train_rl run: about 3 min on 2 shared CPU cores
def test_agentic_recipe_runs_through_train_rl_on_two_hosts(tmp_path):
    res = subprocess.run(
        ["bash", str(REPO / "recipes/maxtext/cpu/run.sh"), f"base_output_directory={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO),
             "RECIPE_ARGS": "qwen3_tiny_agentic.args"})
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    run_dir = tmp_path / "maxtext-qwen3-tiny-agentic"
    for host in (0, 1):
        records = read_jsonl(run_dir / f"host_{host}.jsonl")
        assert [r["step"] for r in records] == [0, 1, 2]
        for r in records:
            # The lookup demo: turn 1 calls the tool, turn 2 answers; a turn is 4 model tokens,
            # the only ones under loss.
            turns = r["turns"]
            assert turns["turns/max"] == 2 and turns["turns/mean"] > 1
            assert turns["tool_calls/mean"] > 0
            assert turns["loss_tokens"] == turns["turns/mean"] * r["completions"] * 4
            assert np.isfinite(r["loss"])
