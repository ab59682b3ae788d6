"""The phases of a GRPO step, shared by the colocated and the disaggregated schedules.

Rollout side, on any process with an engine: `Prompts` (the run's prompt set), then
`RolloutPhases`: admit -> generate -> score, giving one `records.Rollout` (the pack-able
sequences with their behaviour logprobs and policy version). Trainer side, on the processes of
the trainer's jax.distributed group: `pack` (rows padded to the agreed K, in the step's one
exchange) -> `TrainPhase` (num_iterations updates) -> `publish` into a local engine. Metrics
are `runtime.reporting`'s. Nothing here assumes that one process both generates and trains:
hosts and host indices are arguments, and only `topology` talks to other processes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from tunix_mcjax import admission, metrics, rewards, topology
from tunix_mcjax.config import Config, ConfigError
from tunix_mcjax.engine import Completion, Engine, SamplingParams, stops
from tunix_mcjax.publish import Publisher
from tunix_mcjax.runtime import exchange, stepmath
from tunix_mcjax.runtime.engines import ENGINES, default_engine
from tunix_mcjax.runtime.records import Admission, Rollout
from tunix_mcjax.runtime.reward_pool import RewardPool, seconds_within
from tunix_mcjax.tasks import RewardFn, Task
from tunix_mcjax.tokenizer import unknown_characters
from tunix_mcjax.train import packing
from tunix_mcjax.train.trainer import Trainer

__all__ = ["ENGINES", "Prompts", "RolloutPhases", "TrainPhase", "TrainResult", "default_engine",
           "encode_prompt", "filter_task", "pack", "pack_local", "publish", "rollout_seed",
           "sampling_params", "tokenize_prompts"]


def completion_texts(tokenizer: Any, completions: Sequence[Completion]) -> list[str]:
    """The completions' texts: one that stopped ends with its stop token, which is dropped."""
    return tokenizer.batch_decode(
        [c.tokens[:-1] if c.finish_reason != "length" else c.tokens for c in completions],
        skip_special_tokens=True)


def sampling_params(cfg: Config) -> SamplingParams:
    """EOS is the engine's own stop (unless `ignore_eos`), so it is not repeated here."""
    return SamplingParams(
        max_new_tokens=cfg.max_completion_length,
        temperature=cfg.decode_sampling_temperature,
        top_k=cfg.decode_sampling_top_k,
        top_p=cfg.decode_sampling_nucleus_p,
        greedy=cfg.decode_sampling_strategy == "greedy",
        ignore_eos=cfg.ignore_eos,
    )


def prompt_slots(cfg: Config, requests: int) -> int:
    """The prompt slots `generate` gives `requests` (GRPO groups of num_generations): one a group
    when its requests share their prompt's pages, else one a request. A session opened with
    more prefills at more rows, which rounds differently (a sample can change at a draw within
    rounding of a token's boundary), and costs decode time."""
    return requests // cfg.num_generations if cfg.enable_prefix_caching else requests


def rollout_seed(seed: int, step: int, host: int, round_: int = 0) -> int:
    """A distinct sampling seed per (run seed, step, host) and dynamic sampling's refill round;
    the engine folds in the replica."""
    key = [seed, step, host] + ([round_] if round_ else [])
    return int(np.random.SeedSequence(key).generate_state(1)[0] >> 1)


def encode_prompt(tokenizer, index: int, text: str) -> np.ndarray:
    """Token ids (BOS first when the tokenizer has one); unknown characters are an error."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception as e:
        raise ConfigError(
            f"prompt {index} has characters the tokenizer cannot encode "
            f"({unknown_characters(tokenizer, text)!r}: {e}). Clean the dataset, or use "
            "tokenizer_type=huggingface with a tokenizer that covers them.") from e
    return np.asarray(bos + ids, np.int32)


def tokenize_prompts(tokenizer, prompts: list[str], max_len: int,
                     filter_long: bool = False) -> tuple[list[np.ndarray], np.ndarray]:
    """(token ids of the kept prompts, their dataset indices). A prompt over `max_len` tokens
    is dropped when `filter_long` (as MaxText filters its dataset), else an error."""
    out, kept = [], []
    for i, text in enumerate(prompts):
        ids = encode_prompt(tokenizer, i, text)
        if len(ids) > max_len:
            if filter_long:
                continue
            raise ConfigError(
                f"prompt {i} has {len(ids)} tokens, over max_prefill_predict_length={max_len}. "
                "Raise max_prefill_predict_length, or set filter_long_prompts=true to drop "
                "such prompts.")
        out.append(ids)
        kept.append(i)
    return out, np.asarray(kept, np.int64)


def filter_task(task: Task, tokenizer, cfg: Config, host: int) -> tuple[Task, list[np.ndarray]]:
    """The task without prompts over the prompt budget (count printed), and their tokens."""
    tokens, kept = tokenize_prompts(tokenizer, task.prompts, cfg.max_prefill_predict_length,
                                    cfg.filter_long_prompts)
    dropped = len(task.prompts) - len(kept)
    if not dropped:
        return task, tokens
    if not tokens:
        raise ConfigError(f"all {dropped} prompts are longer than max_prefill_predict_length="
                          f"{cfg.max_prefill_predict_length} tokens: raise it")
    if host == 0:
        print(f"filtered {dropped} of {len(task.prompts)} prompts longer than "
              f"max_prefill_predict_length={cfg.max_prefill_predict_length} tokens",
              file=sys.stderr, flush=True)
    fields = {k: [v[i] for i in kept] for k, v in task.fields.items()}
    return dataclasses.replace(task, prompts=[task.prompts[i] for i in kept],
                               fields=fields), tokens


@dataclasses.dataclass(frozen=True)
class Prompts:
    """A run's prompts as the rollout side uses them: the task without over-long prompts, their
    token ids and lengths, the reward functions, and the tokenizer's pad and stop ids."""

    tokenizer: Any
    task: Task
    tokens: list[np.ndarray]
    lengths: np.ndarray
    reward_fns: tuple[RewardFn, ...]
    pad_id: int
    eos_ids: tuple[int, ...]

    @classmethod
    def load(cls, cfg: Config, tokenizer: Any, task: Task, host: int) -> Prompts:
        """Filters the task (MaxText filters its data too) and resolves the rewards, before any
        device work."""
        task, tokens = filter_task(task, tokenizer, cfg, host)
        reward_fns = rewards.resolve_reward_fns(cfg.reward_functions, task)
        eos_ids = stops.model_stop_ids(tokenizer, (cfg.load_parameters_path, cfg.tokenizer_path))
        return cls(tokenizer, task, tokens, np.array([len(t) for t in tokens]), reward_fns,
                   tokenizer.pad_token_id, eos_ids)


Scores = tuple[np.ndarray, np.ndarray, np.ndarray]  # (rewards, correct, group advantages)

# `stream`'s slices end as groups become whole; on an engine of several replicas, also about
# this often, so that a whole group waits at most about this long for its scoring to start.
STREAM_SLICE_S = 0.05


def join_scores(parts: Sequence[Scores]) -> Scores:
    """The scores of consecutive groups, joined in order."""
    return tuple(np.concatenate(column) for column in zip(*parts, strict=True))  # type: ignore[return-value]


class RolloutPhases:
    """Phases 1-3 on one rollout host (`host` of `num_hosts`), on its own engine.

    `rollout` is the one skeleton (admit -> generate -> score -> `result`), as Tunix's
    `RLLearner` runs its steps; a kind of rollout overrides the steps, not the skeleton. Here
    `generate` makes one completion per request; `agentic_rollouts.AgenticRollouts` makes a
    conversation per request."""

    def __init__(self, cfg: Config, prompts: Prompts, engine: Engine, num_hosts: int,
                 host: int):
        self.cfg, self.prompts, self.engine = cfg, prompts, engine
        self.num_hosts, self.host = num_hosts, host
        self.sampling = sampling_params(cfg)
        self.reward_pool = RewardPool(cfg.reward_num_workers, cfg.reward_worker_timeout_seconds)
        self.streamed: list[int] = []  # groups `stream` gave the pool, in the order given
        self.decode_span = (0.0, 0.0)  # when `stream` last decoded (time.monotonic)
        self.reward_hidden_s = 0.0  # reward seconds scored while `stream` decoded, unreported

    def admit(self, step: int, history: stepmath.LengthHistory,
              global_idx: np.ndarray | None = None) -> Admission:
        """The step's global batch (or `global_idx`, a refill round's) and this host's whole
        groups of it (O3: balanced)."""
        cfg = self.cfg
        if global_idx is None:
            global_idx = admission.global_prompt_indices(
                len(self.prompts.tokens), cfg.batch_size, cfg.seed, step, cfg.data_repeat_period)
        expected = history.expected(global_idx, cfg.max_completion_length / 2) \
            if cfg.rl_balance_by_expected_output else None
        positions = admission.host_prompt_positions(
            self.num_hosts, self.host, self.prompts.lengths[global_idx],
            cfg.rl_balance_prompts_by_length, expected, cfg.num_generations)
        return Admission(step, global_idx, global_idx[positions])

    def generate(self, adm: Admission, round_: int = 0) -> list[Completion]:
        """The admitted groups' samples (here one completion a request) on the host's engine;
        streamed (`stream`) when rewards run on workers and the engine decodes in slices."""
        g = self.cfg.num_generations
        requests = [self.prompts.tokens[i] for i in adm.local_indices for _ in range(g)]
        if not requests:
            return []
        seed = rollout_seed(self.cfg.seed, adm.step, self.host, round_)
        if self.reward_pool.workers and self.engine.decodes_in_slices:
            return self.stream(adm, requests, seed)
        return self.engine.generate(requests, self.sampling, seed)

    def stream(self, adm: Admission, requests: list[np.ndarray], seed: int
               ) -> list[Completion]:
        """`generate`'s samples, decoded in slices: each group goes to the reward pool as soon
        as it is whole, and is scored while the rest decode (`score` collects them)."""
        g = self.cfg.num_generations
        samples: dict[int, Completion] = {}
        with self.engine.session(self.sampling, len(requests),
                                 max_prompts=prompt_slots(self.cfg, len(requests)),
                                 group_size=g,
                                 max_prompt_length=max(len(r) for r in requests)) as session:
            start = time.monotonic()
            ids = session.join(requests, seed, group_size=g)
            index = {request_id: i for i, request_id in enumerate(ids)}
            while session.unfinished:
                finished = session.step(time_budget_s=STREAM_SLICE_S, until_group=True)
                samples.update(finished)
                for group in sorted({index[r] // g for r in finished}):
                    texts = completion_texts(self.prompts.tokenizer,
                                             [samples[r] for r in ids[group * g:(group + 1) * g]])
                    self.submit_group(adm, group, texts, {})
                    self.streamed.append(group)
            self.decode_span = (start, time.monotonic())
        return [samples[r] for r in ids]

    def score(self, adm: Admission, completions: list[Completion]) -> Scores:
        """(rewards, correct, group advantages) of `generate`'s samples; every group is whole
        on this host. Streamed groups were scored as they came: their scores are collected."""
        if not completions:
            return (np.zeros(0, np.float32),) * 3
        if self.streamed:
            order, self.streamed = np.argsort(self.streamed), []
            parts = self.reward_pool.results()
            self.reward_hidden_s += seconds_within(self.reward_pool.spans, *self.decode_span)
            return join_scores([parts[i] for i in order])
        return self.score_texts(adm, completion_texts(self.prompts.tokenizer, completions))

    def score_texts(self, adm: Admission, texts: list[str], extra: dict[str, list] | None = None
                    ) -> Scores:
        """(rewards, correct, group advantages) of the admitted groups' completion `texts`, in
        order; `extra`: more per-completion fields for the reward and accuracy functions. With
        reward workers, each group is scored on its own (`reward_pool`)."""
        if not self.reward_pool.workers or not len(adm.local_indices):
            return self.score_groups(adm, range(len(adm.local_indices)), texts, extra or {})
        g = self.cfg.num_generations
        for i in range(len(adm.local_indices)):
            group = slice(i * g, (i + 1) * g)
            self.submit_group(adm, i, texts[group],
                              {k: v[group] for k, v in (extra or {}).items()})
        return join_scores(self.reward_pool.results())

    def submit_group(self, adm: Admission, group: int, texts: list[str],
                     extra: dict[str, list]) -> None:
        """Group `group` of `adm` (its completion `texts` and `extra` fields) to the reward
        pool, which scores it while the caller goes on."""
        name = (f"step {adm.step}'s group {group} (prompt index "
                f"{int(adm.local_indices[group])})")
        self.reward_pool.submit(name, lambda: self.score_groups(adm, [group], texts, extra))

    def score_groups(self, adm: Admission, groups: Sequence[int], texts: list[str],
                     extra: dict[str, list]) -> Scores:
        """(rewards, correct, group advantages) of `groups` of `adm`, whose completions are
        `texts` in order."""
        g, task = self.cfg.num_generations, self.prompts.task
        expanded = [int(adm.local_indices[i]) for i in groups for _ in range(g)]
        prompts = [task.prompts[i] for i in expanded]
        fields = {k: [v[i] for i in expanded] for k, v in task.fields.items()} | extra
        reward = rewards.score(self.prompts.reward_fns, prompts, texts, fields, expanded)
        correct = np.asarray(task.accuracy_fn(prompts=prompts, completions=texts, **fields))
        return reward, correct, rewards.group_advantages(reward, g)

    def result(self, adm: Admission, completions: list[Completion], scores: Scores,
               policy_version: int, seconds: dict[str, float]) -> Rollout:
        """The step's `Rollout` of `generate`'s samples and their `scores`."""
        return Rollout(adm, tuple(self.prompts.tokens[i] for i in adm.local_indices),
                       tuple(completions), *scores, policy_version, seconds)

    def rollout(self, step: int, policy_version: int, history: stepmath.LengthHistory,
                timer: metrics.PhaseTimer | None = None, global_idx: np.ndarray | None = None,
                round_: int = 0) -> Rollout:
        """Admit, generate and score, each timed as its phase (in `timer`, when given: the
        step's), with `policy_version`: the version of the engine's weights. `global_idx`,
        `round_`: a dynamic sampling refill round's prompts."""
        timer = timer or metrics.PhaseTimer()
        with timer.phase("admit"):
            adm = self.admit(step, history, global_idx)
        with timer.phase("generate"):
            samples = self.generate(adm, round_)
        with timer.phase("reward"):
            scores = self.score(adm, samples)
        hidden, self.reward_hidden_s = self.reward_hidden_s, 0.0
        timer.seconds["reward_hidden"] = timer.seconds.get("reward_hidden", 0.0) + hidden
        seconds = {p: timer.seconds[p] for p in ("admit", "generate", "reward")}
        return self.result(adm, samples, scores, policy_version, seconds)


def pack(cfg: Config, seqs: list[packing.Sequence], pad_id: int, num_local_devices: int,
         watchdog: topology.Watchdog | None, *, metrics: np.ndarray | None = None,
         lengths: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], exchange.Exchanged]:
    """Phase 4: this host's rows padded to the agreed K, with global loss weights.

    Runs the step's one exchange among the trainer's hosts, which also carries `metrics` (a
    deferred host record's vector) and `lengths` (O3's (prompt, length) pairs). Returns (local
    batch, what every host sent)."""
    rows = packing.pack(seqs, cfg.max_target_length, pad_id)
    message = exchange.HostMessage(
        rows.num_rows, stepmath.loss_sequences(seqs), stepmath.completion_tokens(seqs),
        np.zeros(0) if metrics is None else metrics,
        np.zeros((0, 2)) if lengths is None else lengths)
    everyone = exchange.exchange(message, watchdog)
    local = stepmath.local_batch(rows, everyone.rows_per_device(num_local_devices),
                                 num_local_devices, pad_id, cfg.loss_agg_mode,
                                 everyone.global_sequences, everyone.global_tokens)
    return local, everyone


def pack_local(cfg: Config, prompts: list[np.ndarray], completions: list[Completion],
               advantages: np.ndarray, pad_id: int, num_local_devices: int,
               sync_payload: np.ndarray, watchdog: topology.Watchdog | None = None
               ) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
    """`pack` of completions, `prompts[j]` being completion j's. Returns (local batch, every
    host's `sync_payload` [num_hosts, n], K per device)."""
    local, everyone = pack(cfg, stepmath.sequences(prompts, completions, advantages), pad_id,
                           num_local_devices, watchdog, metrics=sync_payload)
    return local, everyone.metrics, everyone.rows_per_device(num_local_devices)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    metrics: dict[str, float]  # the first iteration's; finite 0.0 when any was not finite
    applied: int  # iterations whose update was applied
    compiled: bool  # a train program was compiled


class TrainPhase:
    """Phase 5: `num_iterations` updates on one packed batch (MaxText's `rl.num_iterations`,
    GRPO's mu).

    Tunix (grpo_learner with num_iterations > 1): the rollout model scores the batch once with
    the weights it was sampled with (`rl_cluster.get_old_per_token_logps`), and the same
    TrainExample goes to the actor num_iterations times (rl_learner's `batch_repeat`), one
    optimizer update each, every one against those old logps. Here the old logps are the
    engine's logprobs of the sampled tokens (same weights and temperature), so no scoring pass:
    the first update takes old = stop_gradient(current) (Tunix's first update, whose ratio is 1),
    the later ones Tunix's clipped ratio against the engine's logprobs. A trainer built
    `off_policy` (stale rollouts) is off-policy in every iteration. Iterations stop at the first
    non-finite one (never applied).
    """

    def __init__(self, trainer: Trainer, watchdog: topology.Watchdog, num_iterations: int):
        self.trainer, self.watchdog, self.num_iterations = trainer, watchdog, num_iterations
        self._compiled_for: set[tuple[int, bool]] = set()  # (K, off-policy) programs built

    def __call__(self, local: dict[str, np.ndarray], rows_per_device: int) -> TrainResult:
        trainer, programs = self.trainer, self.trainer.compile_count
        first: dict[str, float] | None = None
        applied = 0
        for i in range(self.num_iterations):
            off_policy = trainer.off_policy or i > 0
            shape = (rows_per_device, off_policy)
            compiles = shape not in self._compiled_for  # step 0, or a new K
            self._compiled_for.add(shape)
            with self.watchdog.guard("train", compiles=compiles):
                out = trainer.step(local, off_policy=off_policy)
            first = first or out
            if out.get("finite", 1.0) != 1.0:
                first = {**first, "finite": 0.0}
                break
            applied += 1
        return TrainResult(first, applied, trainer.compile_count > programs)


def publish(publisher: Publisher, trainer: Trainer, engine: Engine) -> None:
    """Phase 6: the trainer's weights into this host's engine replicas."""
    publisher.publish_trainer(trainer, engine)
