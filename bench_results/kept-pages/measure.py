"""Prefill tokens per step of the agentic tool demo (recipes/cpu/demo_agentic.yml: one host's
share, 8 prompts x 16 generations, its environment, chat template and engine settings) with
kept pages (one session a rollout) and without (a generate per round), on the random-init
tiny model. Writes result.json beside this file.

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


def main() -> None:
    cfg = config.load_config("recipes/cpu/demo_agentic.yml")
    tok = char_tokenizer()
    mc = models.model_config(cfg, vocab_size=tok.vocab_size, for_sampling=True)
    engine = JaxEngine(mc, jax.devices()[:1], engine_options(cfg, tok.pad_token_id,
                                                             (tok.eos_token_id,)))
    engine.load_weights(nnx_params(models.create_model(mc, 0)))
    parser = ChatParser(tok, load_chat_template(cfg.data_template_path))
    limits = TurnLimits(cfg.max_target_length, cfg.agentic_turn_tokens,
                        cfg.agentic_tool_timeout_s, cfg.max_concurrency)
    sampling = engine_sampling(cfg)
    rows = []
    for step in range(STEPS):
        for keep in (True, False):
            convs = conversations(cfg, parser, tok, step)
            t0 = time.monotonic()
            run = run_turns_counted(engine, convs, parser, sampling, step, limits,
                                    keep_pages=keep)
            rows.append(dict(step=step, kept_pages=keep, rounds=run.rounds,
                             prefill_tokens=run.prefill_tokens,
                             full_reprefill_tokens=run.prefill_tokens_full,
                             tokens=[c.tokens for c in convs],
                             seconds=round(time.monotonic() - t0, 3)))
    for a, b in zip(rows[::2], rows[1::2], strict=True):
        assert a["tokens"] == b["tokens"], "kept pages changed a trajectory"
    for r in rows:
        del r["tokens"]
    out = dict(rows=rows, load_average=os.getloadavg(), device=str(jax.devices()[0]),
               note="one host's share of the demo's step: 8 prompts x 16 generations")
    path = pathlib.Path(__file__).with_name("result.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


def conversations(cfg, parser, tok, step: int) -> list[Conversation]:
    out = []
    for i in range(PROMPTS):
        for g in range(cfg.num_generations):
            agent, env = lookup_conversation("L", {}, seed=trajectory_seed(cfg.seed, step, i, g),
                                             system_prompt=cfg.system_prompt)
            c = Conversation.start(agent, env, parser)
            c.prompt = np.concatenate([[tok.bos_token_id], c.prompt]).astype(np.int32)
            out.append(c)
    return out


def engine_sampling(cfg) -> SamplingParams:
    return SamplingParams(max_new_tokens=cfg.agentic_turn_tokens,
                          temperature=cfg.decode_sampling_temperature)


def nnx_params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


if __name__ == "__main__":
    main()
