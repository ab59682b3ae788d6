"""Prefill tokens per step of agentic rollouts with kept pages (one session a rollout) and
without (a generate per round), on the random-init tiny model of
recipes/cpu/demo_agentic.yml: one host's share, 8 prompts x 16 generations, its environment,
chat template and engine settings. Two profiles: the tool demo as shipped (two turns), and the
same environment allowed five turns (`max_steps=5`, defined here, not in the demo) with
`max_target_length=128` so the longer conversations fit. Writes result.json beside this file.

PYTHONPATH=. nice -n 5 python bench_results/kept-pages/measure.py
"""

import json
import os
import pathlib
import time

import jax
import numpy as np
from flax import nnx

from tunix_mcjax import config, models
from tunix_mcjax.agentic.conversation import Conversation
from tunix_mcjax.agentic.demo import lookup_conversation
from tunix_mcjax.agentic.loop import TurnLimits, run_turns_counted
from tunix_mcjax.agentic.parsers import ChatParser, load_chat_template
from tunix_mcjax.engine.base import SamplingParams
from tunix_mcjax.engine.jax_engine import JaxEngine
from tunix_mcjax.runtime.agentic_rollouts import trajectory_seed
from tunix_mcjax.runtime.engines import engine_options
from tunix_mcjax.tokenizer import char_tokenizer

STEPS, PROMPTS = 3, 8
# name -> (the environment's max_steps, config overrides)
PROFILES = {"tool_demo": (2, []), "five_turns": (5, ["max_target_length=128"])}


def main() -> None:
    rows = []
    for name, (max_steps, overrides) in PROFILES.items():
        rows += measure(name, max_steps, config.load_config("recipes/cpu/demo_agentic.yml",
                                                            overrides))
    out = dict(rows=rows, load_average=os.getloadavg(), device=str(jax.devices()[0]),
               note="one host's share of the demo's step: 8 prompts x 16 generations")
    path = pathlib.Path(__file__).with_name("result.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


def measure(profile: str, max_steps: int, cfg) -> list[dict]:
    """Each step with and without kept pages; the trajectories must be equal."""
    tok = char_tokenizer()
    mc = models.model_config(cfg, vocab_size=tok.vocab_size, for_sampling=True)
    engine = JaxEngine(mc, jax.devices()[:1], engine_options(cfg, tok.pad_token_id,
                                                             (tok.eos_token_id,)))
    engine.load_weights(nnx_params(models.create_model(mc, 0)))
    parser = ChatParser(tok, load_chat_template(cfg.data_template_path))
    limits = TurnLimits(cfg.max_target_length, cfg.agentic_turn_tokens,
                        cfg.agentic_tool_timeout_s, cfg.max_concurrency)
    sampling = SamplingParams(max_new_tokens=cfg.agentic_turn_tokens,
                              temperature=cfg.decode_sampling_temperature)
    rows = []
    for step in range(STEPS):
        runs = {}
        for keep in (True, False):
            convs = conversations(cfg, parser, tok, step, max_steps)
            t0 = time.monotonic()
            run = run_turns_counted(engine, convs, parser, sampling, step, limits,
                                    keep_pages=keep)
            runs[keep] = [(c.tokens, c.status) for c in convs]
            rows.append(dict(profile=profile, step=step, kept_pages=keep, rounds=run.rounds,
                             turns_mean=float(np.mean([c.turns for c in convs])),
                             prefill_tokens=run.prefill_tokens,
                             full_reprefill_tokens=run.prefill_tokens_full,
                             seconds=round(time.monotonic() - t0, 3)))
        assert runs[True] == runs[False], "kept pages changed a trajectory"
    return rows


def conversations(cfg, parser, tok, step: int, max_steps: int) -> list[Conversation]:
    out = []
    for i in range(PROMPTS):
        for g in range(cfg.num_generations):
            agent, env = lookup_conversation("L", {}, seed=trajectory_seed(cfg.seed, step, i, g),
                                             system_prompt=cfg.system_prompt)
            env.max_steps = max_steps
            c = Conversation.start(agent, env, parser)
            c.prompt = np.concatenate([[tok.bos_token_id], c.prompt]).astype(np.int32)
            out.append(c)
    return out


def nnx_params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


if __name__ == "__main__":
    main()
