"""Phases 1-3 of an agentic step on one host, as steps of `RolloutPhases.rollout`: admit
(unchanged: whole groups per host), generate (the admitted prompts' conversations, turn by turn
on the host's engine: `agentic.loop`), score them.

Reward functions are called as Tunix's agentic learner calls them: `completions` are the
model's text (its turns, joined), with the environment's `trajectory_rewards` and the
`tool_calls` of each trajectory beside the task's fields. Each trajectory's environment seed
depends on (seed, step, prompt, generation) only, not on the host that runs it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from tunix_mcjax.agentic import rollout as agentic_rollout
from tunix_mcjax.agentic.conversation import Conversation
from tunix_mcjax.agentic.loop import TurnLimits, TurnRun, run_turns_counted
from tunix_mcjax.agentic.parsers import ChatParser, load_chat_template
from tunix_mcjax.config import Config, ConfigError
from tunix_mcjax.engine import Completion, Engine
from tunix_mcjax.runtime.phases import Prompts, RolloutPhases, Scores, rollout_seed
from tunix_mcjax.runtime.records import Admission, Rollout

EnvFactory = Callable[..., tuple[Any, Any]]


def resolve_factory(name: str) -> EnvFactory:
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"agentic_environment={name!r} not found ({e}); use "
                          "'package.module:function'") from e


def trajectory_seed(seed: int, step: int, prompt_index: int, generation: int,
                    round_: int = 0) -> int:
    key = [seed, step, prompt_index, generation] + ([round_] if round_ else [])
    return int(np.random.SeedSequence(key).generate_state(1)[0] >> 1)


@dataclasses.dataclass(frozen=True)
class Trajectories:
    """An agentic generate phase's samples: a host's conversations, each finished, and what
    the turn loop took (engine rounds, prefill tokens)."""

    conversations: list[Conversation]
    run: TurnRun


class AgenticRollouts(RolloutPhases):
    """`RolloutPhases` whose samples are conversations: `generate` runs the turn loop
    (`loop.run_turns`), `score` scores the model's turns, `result` keeps their loss masks."""

    def __init__(self, cfg: Config, prompts: Prompts, engine: Engine, num_hosts: int,
                 host: int, parser: ChatParser | None = None):
        """`parser`: renders the conversations (None: `data_template_path`'s ChatParser)."""
        super().__init__(cfg, prompts, engine, num_hosts, host)
        self.factory = resolve_factory(cfg.agentic_environment)
        self.parser = parser or ChatParser(prompts.tokenizer,
                                           load_chat_template(cfg.data_template_path))
        self.limits = TurnLimits(cfg.max_target_length, cfg.agentic_turn_tokens,
                                 cfg.agentic_tool_timeout_s, cfg.max_concurrency)

    def conversations(self, adm: Admission, round_: int = 0) -> list[Conversation]:
        cfg, task, bos = self.cfg, self.prompts.task, self.prompts.tokenizer.bos_token_id
        out = []
        for i in adm.local_indices:
            for g in range(cfg.num_generations):
                agent, env = self.factory(
                    task.prompts[i], {k: v[i] for k, v in task.fields.items()},
                    seed=trajectory_seed(cfg.seed, adm.step, int(i), g, round_),
                    system_prompt=cfg.system_prompt)
                c = Conversation.start(agent, env, self.parser)
                if bos is not None:
                    c.prompt = np.concatenate([[bos], c.prompt]).astype(np.int32)
                if len(c.prompt) > cfg.max_prefill_predict_length:
                    raise ConfigError(
                        f"prompt {i} renders to {len(c.prompt)} tokens with its system prompt "
                        f"and chat template, over max_prefill_predict_length="
                        f"{cfg.max_prefill_predict_length}: raise it")
                out.append(c)
        return out

    def generate(self, adm: Admission, round_: int = 0) -> Trajectories:
        convs = self.conversations(adm, round_)
        run = run_turns_counted(self.engine, convs, self.parser, self.sampling,
                                rollout_seed(self.cfg.seed, adm.step, self.host, round_),
                                self.limits, keep_pages=self.cfg.agentic_keep_pages)
        return Trajectories(convs, run)

    def score(self, adm: Admission, trajectories: Trajectories) -> Scores:
        """Tunix's agentic learner's call: the model's turns as text, with the environment's
        `trajectory_rewards` and each trajectory's `tool_calls`."""
        convs = trajectories.conversations
        if not convs:
            return (np.zeros(0, np.float32),) * 3
        texts = [self.parser.tokenizer.decode(
            [t for t, m in zip(c.tokens, c.mask, strict=True) if m], skip_special_tokens=True)
            for c in convs]
        return self.score_texts(adm, texts, {"trajectory_rewards": [c.reward for c in convs],
                                             "tool_calls": [c.tool_calls for c in convs]})

    def result(self, adm: Admission, trajectories: Trajectories, scores: Scores,
               policy_version: int, seconds: dict[str, float]) -> Rollout:
        """The conversations as completions (the model's and the tools' tokens), their loss
        masks and turn metrics; each group's prompt is its rendered first messages."""
        convs, g = trajectories.conversations, self.cfg.num_generations
        completions = tuple(
            Completion(np.asarray(c.tokens, np.int32), np.asarray(c.logprobs, np.float32),
                       "length" if c.status == "context_exceeded" else "stop") for c in convs)
        run = trajectories.run
        turns = {**agentic_rollout.turn_metrics(convs), "rounds": float(run.rounds),
                 "prefill_tokens": float(run.prefill_tokens),
                 "prefill_tokens_saved": float(run.prefill_tokens_saved)} if convs else {}
        return Rollout(adm, tuple(convs[j * g].prompt for j in range(len(adm.local_indices))),
                       completions, *scores, policy_version, seconds,
                       masks=tuple(np.asarray(c.mask, np.float32) for c in convs), turns=turns)
