"""A decode session: the engine's loop run in slices, its state kept on the device between them.

`JaxEngine.session(sampling, max_requests=...)` opens one over the engine's replicas. Each
replica holds one `LoopState` (its page pool, block tables, rows, request queue and
completions so far) on its devices for the whole session; `step` runs at most N more loop
iterations of every replica (one compiled program per shape, the bound a traced input) and
returns the GRPO groups that became whole, each only once all its requests are done. `join`
adds requests to the running loop, into request and prompt slots that are free (never used, or
whose completions were returned); each joined request keeps the key `generate(prompts,
sampling, seed)` would give it (`engine.keys`), so its sample is the one it would get alone.
A request joined with `keep` leaves its pages in a prompt slot when it is returned (its keep
slot), for a later request to continue from; a GRPO group of equal prompts still prefills its
prompt once, and each member's keep slot shares the prompt's full pages
(`block_tables.keep_rows`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_mcjax.engine import pages
from tunix_mcjax.engine.base import Completion, SamplingParams
from tunix_mcjax.engine.buckets import pow2_at_least, prompt_bucket
from tunix_mcjax.engine.completions import completion_of, stats_of
from tunix_mcjax.engine.keys import generate_keys
from tunix_mcjax.engine.loop_state import Inputs, LoopState, ProgramShape
from tunix_mcjax.engine.sampling import SamplerSpec
from tunix_mcjax.engine.session_programs import SessionPrograms

WHOLE = np.iinfo(np.int32).max  # iterations of a slice with no bound
PIPELINE_SLICES = 2  # a timed step's slices: about this many a budget


@dataclasses.dataclass
class _Replica:
    """One replica's part of the session: its state and inputs on its devices, and which
    session request sits in each request slot (-1: free) and how many undelivered requests
    each prompt slot serves."""

    mesh_index: int
    state: LoopState
    host: dict[str, np.ndarray]  # the inputs, as the host last wrote them
    inputs: Inputs  # the same, on the replica's devices
    slot_request: np.ndarray  # int64 [N]
    prompt_users: np.ndarray  # int64 [U]
    done: np.ndarray  # bool [N], as of the last slice
    outputs: Any = None  # the last slice's outputs, on the device


@dataclasses.dataclass(frozen=True)
class _Slice:
    """A slice dispatched on a replica and not yet read: its outputs and done flags on the
    device, which session request each slot held when it was dispatched, and when."""

    rep: _Replica
    outputs: Any
    done: jax.Array
    occupants: np.ndarray
    dispatched: float


@dataclasses.dataclass(frozen=True)
class _Group:
    replica: int
    slots: tuple[int, ...]
    request_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Kept:
    """A returned request's pages kept in its keep slot: its prompt and completion, all but
    the last token's keys/values resident (unless evicted under page pressure)."""

    replica: int
    prompt_slot: int
    tokens: np.ndarray


class DecodeSession:
    """Sliced decoding over `engine`'s replicas with one `sampling`. Capacity, per session
    (split evenly over the replicas, each rounded up to a power of two): `max_requests`
    requests and `max_prompts` distinct prompts (default `max_requests`) at once, prompts of at
    most `max_prompt_length` tokens (default the engine's), and `group_size` requests sharing a
    prompt's pages at once. Close it (or use it as a context manager) to give the engine its
    page pools back."""

    def __init__(self, engine: Any, sampling: SamplingParams, max_requests: int,
                 max_prompts: int | None = None, max_prompt_length: int | None = None,
                 group_size: int = 1):
        refuse_engine(engine)
        if max_requests < 1 or (max_prompts or 1) < 1 or group_size < 1:
            raise ValueError("max_requests, max_prompts and group_size must be >= 1")
        self.engine, self.sampling = engine, sampling
        self.shape = session_shape(engine, sampling, max_requests, max_prompts or max_requests,
                                   max_prompt_length, group_size)
        spec = SamplerSpec.of(sampling, engine.model_config.vocab_size)
        self._programs = SessionPrograms(engine, self.shape, spec)
        self._replicas = [self._open(i) for i in range(len(engine.meshes))]
        self._groups: list[_Group] = []
        self._kept: dict[int, _Kept] = {}
        self._next_id = 0
        self._iteration_s: float | None = None  # a timed slice's seconds an iteration, last
        self._running: list[_Slice] | None = None  # a timed step's slice, dispatched, unread
        self._landed_at: float | None = None  # when a slice was last read
        # Per replica, the loop's counters over the session so far (`JaxEngine.last_stats`).
        self.last_stats: list[dict[str, int]] = [{} for _ in self._replicas]

    def _open(self, mesh_index: int) -> _Replica:
        n, u = self.shape.num_requests, self.shape.num_prompts
        host = dict(prompts=np.full((u, self.shape.prompt_len), self.engine.options.pad_id,
                                    np.int32),
                    prompt_lens=np.zeros((u,), np.int32),
                    request_prompts=np.full((n,), -1, np.int32),
                    request_keys=np.zeros((n, 2), np.uint32),
                    request_kept=np.full((n,), -1, np.int32),
                    **self.engine._sampling_inputs(self.sampling))
        inputs = self._put(mesh_index, host)
        state = self._programs.start(mesh_index, self.engine._take_pool(mesh_index, self), inputs)
        return _Replica(mesh_index, state, host, inputs, np.full((n,), -1), np.zeros((u,), int),
                        np.ones((n,), bool))

    def _put(self, mesh_index: int, host: dict[str, np.ndarray]) -> Inputs:
        """The inputs on the replica's devices, from a copy: a CPU device may alias a host
        array, and the host's are written again at the next join."""
        sharding = NamedSharding(self.engine.meshes[mesh_index], P())
        return jax.device_put(Inputs(**{k: np.array(v) for k, v in host.items()}), sharding)

    # ----- joining -----

    def join(self, prompt_token_ids: Sequence[Sequence[int]], seed: int,
             group_size: int | Sequence[int] = 1, keep: bool = False,
             continue_from: Sequence[int | None] | None = None) -> list[int]:
        """Add requests, in groups of `group_size` consecutive ones (a GRPO group: returned
        together; a sequence: each group's size, in order), sampled as
        `generate(prompt_token_ids, sampling, seed)` samples them. Equal prompts of a group
        share one prompt slot (with prefix caching), so it is prefilled once. With `keep`,
        each request's pages (prompt and completion) stay in a prompt slot of its own when it
        is returned, until a request continues it or `release`; a group's kept requests share
        their prompt's full pages. `continue_from[i]` (a kept request's id, or None) starts
        request i, in a group of its own, from that request's pages: its prompt must extend
        the kept prompt and completion, and only the new tokens are prefilled (all of them if
        the pages were evicted meanwhile). Returns their request ids (`step`'s keys). A join
        that does not fit changes nothing."""
        self._check_open()
        if (keep or continue_from) and not self.keeps_pages:
            raise NotImplementedError(
                "kept pages with recorded expert routing: a continued prompt's routing would "
                "lack its kept tokens' experts; join without keep/continue_from")
        prompts = [np.asarray(p, dtype=np.int32).reshape(-1) for p in prompt_token_ids]
        self.engine._validate(prompts, self.sampling)
        groups = self._check_join(prompts, group_size)
        pinned = self._continuations(prompts, continue_from, groups)
        keys = np.concatenate(generate_keys(seed, len(prompts), self.engine.num_replicas))
        placed = self._place([[prompts[i] for i in g] for g in groups],
                             [pinned[g[0]] for g in groups], keep)
        for kept_id in (c for c in continue_from or () if c is not None):
            del self._kept[kept_id]
        joined = {r: np.zeros((self.shape.num_requests,), bool) for r in set(placed[0])}
        ids = []
        for group, replica, (slots, prompt_slots, keep_slots) in zip(groups, *placed,
                                                                     strict=True):
            rep, first = self._replicas[replica], self._next_id
            for i, slot, prompt_slot, keep_slot in zip(group, slots, prompt_slots, keep_slots,
                                                       strict=True):
                self._seat(rep, slot, (prompt_slot, keep_slot), prompts[i], keys[i],
                           first + i - group[0], pinned[i] is not None)
            joined[replica][slots] = True
            self._groups.append(_Group(replica, tuple(slots), tuple(
                range(first, first + len(group)))))
            ids += range(first, first + len(group))
            self._next_id += len(group)
        for replica, mask in joined.items():
            rep = self._replicas[replica]
            rep.inputs = self._put(rep.mesh_index, rep.host)
            rep.state = self._programs.join(rep.mesh_index, rep.state, rep.inputs, mask,
                                            mask & keep)
            rep.done &= ~mask
        return ids

    def _continuations(self, prompts: list[np.ndarray], continue_from: Any,
                       groups: list[range]) -> list[tuple[int, int] | None]:
        """Each request's (replica, prompt slot) to continue on, or None; errors name a
        request that was not kept or a prompt that does not extend its conversation."""
        if continue_from is None:
            return [None] * len(prompts)
        if len(continue_from) != len(prompts):
            raise ValueError(f"continue_from has {len(continue_from)} entries for "
                             f"{len(prompts)} prompts: give one (a request id or None) a prompt")
        if any(len(g) > 1 and any(continue_from[i] is not None for i in g) for g in groups):
            raise ValueError("continue_from needs group_size=1 for a continuing request (a "
                             "kept conversation is one request's): give it a group of its own")
        pinned: list[tuple[int, int] | None] = []
        for prompt, kept_id in zip(prompts, continue_from, strict=True):
            kept = None if kept_id is None else self._kept.get(kept_id)
            if kept_id is not None and kept is None:
                raise ValueError(f"request {kept_id} has no kept pages: join it with keep=True, "
                                 "and continue it once, after step returned it")
            if kept is not None:
                resident = len(kept.tokens) - 1
                if len(prompt) <= resident or not np.array_equal(prompt[:resident],
                                                                 kept.tokens[:resident]):
                    raise ValueError(f"the prompt continuing request {kept_id} does not extend "
                                     "its prompt and completion with new tokens")
            pinned.append(None if kept is None else (kept.replica, kept.prompt_slot))
        if len({p for p in pinned if p is not None}) < sum(p is not None for p in pinned):
            raise ValueError("continue_from names a kept request twice")
        return pinned

    def _check_join(self, prompts: list[np.ndarray], group_size: int | Sequence[int]
                    ) -> list[range]:
        """The join's groups of request indices; errors name a bad `group_size` or a prompt
        over the session's length."""
        groups = split_groups(len(prompts), group_size)
        longest = max(len(p) for p in prompts)
        if longest > self.shape.prompt_len:
            raise ValueError(f"a prompt of {longest} tokens does not fit the session's "
                             f"max_prompt_length={self.shape.prompt_len}: open the session "
                             "with a larger max_prompt_length")
        return groups

    def _place(self, groups: list[list[np.ndarray]], pinned: list[tuple[int, int] | None],
               keep: bool) -> tuple[list[int], list[tuple]]:
        """Each group's replica (the one with the most free request slots that holds it, or
        the one its kept conversation is on) and its request, prompt and keep slots (None:
        not kept), or an error naming the capacity key it overflows."""
        free_requests = [list(np.flatnonzero(r.slot_request < 0)) for r in self._replicas]
        free_prompts = [list(np.flatnonzero(r.prompt_users == 0)) for r in self._replicas]
        replicas, slots = [], []
        for group, pin in zip(groups, pinned, strict=True):
            prompt_of, keep_of = (([0], [0 if keep else None]) if pin
                                  else self._prompt_slots(group, keep))
            need = 0 if pin else max(prompt_of + [k or 0 for k in keep_of]) + 1
            fits = [r for r in range(len(self._replicas)) if len(free_requests[r]) >= len(group)
                    and len(free_prompts[r]) >= need and (pin is None or pin[0] == r)]
            if not fits:
                raise ValueError(self._overflow(len(group), need, free_requests, free_prompts))
            r = max(fits, key=lambda r: len(free_requests[r]))
            taken = [pin[1]] if pin else free_prompts[r][:need]
            del free_prompts[r][:need]
            replicas.append(r)
            slots.append(([free_requests[r].pop(0) for _ in group],
                          [taken[k] for k in prompt_of],
                          [None if k is None else taken[k] for k in keep_of]))
        return replicas, slots

    def _prompt_slots(self, group: list[np.ndarray], keep: bool
                      ) -> tuple[list[int], list[int | None]]:
        """Each request's prompt slot and keep slot (None: not kept) among the group's new
        ones. A kept request alone on its prompt slot keeps its pages there; one sharing it
        keeps them in a slot of its own, which will list the shared prompt's full pages."""
        read = self._shared_slots(group)
        if not keep:
            return read, [None] * len(group)
        users = np.bincount(read)
        extra = iter(range(len(users), len(users) + len(group)))
        return read, [slot if users[slot] == 1 else next(extra) for slot in read]

    def _shared_slots(self, group: list[np.ndarray]) -> list[int]:
        """Each request's prompt slot among the group's: equal prompts share one (with prefix
        caching), at most the shape's `group_size` requests a slot."""
        if not self.engine.options.prefix_caching:
            return list(range(len(group)))
        slot_of: dict[bytes, int] = {}
        count: dict[int, int] = {}
        out = []
        for prompt in group:
            slot = slot_of.get(prompt.tobytes())
            if slot is None or count[slot] == self.shape.group_size:
                slot = slot_of[prompt.tobytes()] = len(count)
                count[slot] = 0
            count[slot] += 1
            out.append(slot)
        return out

    def _overflow(self, requests: int, prompts: int, free_requests: list, free_prompts: list
                  ) -> str:
        most_requests, most_prompts = max(map(len, free_requests)), max(map(len, free_prompts))
        key, per_replica = (("max_requests", self.shape.num_requests) if most_requests < requests
                            else ("max_prompts", self.shape.num_prompts))
        return (f"the join does not fit the session: a group of {requests} requests on "
                f"{prompts} distinct prompts, with at most {most_requests} request and "
                f"{most_prompts} prompt slots free on a replica ({key} gives each of the "
                f"{len(self._replicas)} replicas {per_replica}): step until groups come back, "
                f"or open the session with a larger {key}")

    def _seat(self, rep: _Replica, slot: int, prompt_slots: tuple[int, int | None],
              prompt: np.ndarray, key: np.ndarray, request_id: int, continues: bool) -> None:
        """The request on its (prompt slot, keep slot); a continuing request takes over its
        kept conversation's slot (and use), which is both; a keep slot of its own holds no
        prompt until a request continues it."""
        host, (prompt_slot, keep_slot) = rep.host, prompt_slots
        if rep.prompt_users[prompt_slot] == 0 or continues:
            self._write_prompt(host, prompt_slot, prompt)
        rep.prompt_users[prompt_slot] += 0 if continues else 1
        if keep_slot is not None and keep_slot != prompt_slot:
            self._write_prompt(host, keep_slot, prompt[:0])
            rep.prompt_users[keep_slot] += 1
        host["request_prompts"][slot] = prompt_slot
        host["request_kept"][slot] = -1 if keep_slot is None else keep_slot
        host["request_keys"][slot] = key
        rep.slot_request[slot] = request_id

    def _write_prompt(self, host: dict[str, np.ndarray], prompt_slot: int,
                      prompt: np.ndarray) -> None:
        host["prompts"][prompt_slot] = self.engine.options.pad_id
        host["prompts"][prompt_slot, :len(prompt)] = prompt
        host["prompt_lens"][prompt_slot] = len(prompt)

    # ----- stepping -----

    def step(self, max_iterations: int | None = None, time_budget_s: float | None = None,
             until_group: bool = False) -> dict[int, Completion]:
        """Run the loop on, at most `max_iterations` iterations (None: until every request is
        done); with `time_budget_s`, in pipelined slices until that time is spent (at least
        one iteration); with `until_group`, in pipelined slices that each end as a group
        becomes whole, returning the first read that finds one (`_pipelined`). Returns the
        requests of the groups that became whole, by request id."""
        self._check_open()
        check_slice(max_iterations, time_budget_s, "loop iteration")
        if time_budget_s is None and not until_group:
            finished = self._land_running()
            self._advance(WHOLE if max_iterations is None else max_iterations)
            return finished | self._whole_groups()
        return self._pipelined(max_iterations, time_budget_s, until_group)

    def _pipelined(self, max_iterations: int | None, budget_s: float | None,
                   until_group: bool) -> dict[int, Completion]:
        """Slices pipelined: the next is dispatched on the donated state before the last one
        is read, so the device never waits for the host's sync, group fetch or caller. A
        timed slice is about half the budget (sized by the session's last seconds an
        iteration; an uncalibrated session first runs one iteration alone, to time it).
        Returns after the read that spends the budget or the iterations, or (`until_group`)
        that finds a group whole, the next slice still running (the next `step` reads it
        first). With `until_group` on one replica, slices end only as groups become whole:
        on several, also on the clock, so that a replica whose slice ended does not wait long
        for the others'."""
        finished: dict[int, Completion] = {}
        deadline = math.inf if budget_s is None else time.monotonic() + budget_s
        clock = None if until_group and len(self._replicas) == 1 else budget_s
        left = WHOLE if max_iterations is None else max_iterations

        def launch() -> list[_Slice]:
            nonlocal left
            size = self._slice_size(left, clock)
            left -= 0 if max_iterations is None else size
            return self._launch(size, until_group)

        while True:
            if self._running is None:
                self._running = launch()
            ahead = None
            if (clock is None or self._iteration_s is not None) and left > 0:
                ahead = launch()
            self._land(self._running)
            self._running = ahead or None
            finished.update(self._whole_groups())
            if (not self.unfinished or left <= 0 or time.monotonic() >= deadline
                    or (until_group and finished)):
                return finished

    def _slice_size(self, left: int, budget_s: float | None) -> int:
        """Iterations of a pipelined slice: half the budget at the last seconds an iteration
        (one while uncalibrated; None: no clock, as many as `left`), at most `left`."""
        if budget_s is None:
            return left
        if self._iteration_s is None:
            return 1
        return int(min(left, max(1, budget_s / PIPELINE_SLICES / max(self._iteration_s, 1e-9))))

    def _advance(self, max_iterations: int) -> None:
        """A slice of every replica with requests left, read before it returns."""
        self._land(self._launch(max_iterations, until_group=False))

    def _launch(self, max_iterations: int, until_group: bool) -> list[_Slice]:
        """A slice of every replica with requests left, dispatched and not read: all are
        queued before any is read, so the replicas run at once. With `until_group`, each
        replica's slice also ends as one of its groups becomes whole."""
        launched = []
        for index, rep in enumerate(self._replicas):
            if rep.done.all():
                continue
            groups = np.full((self.shape.num_requests,), -1, np.int32)
            if until_group:  # numbered on the replica: fewer than its request slots
                mine = [g for g in self._groups if g.replica == index]
                for g, group in enumerate(mine):
                    groups[list(group.slots)] = g
            rep.state, outputs, done = self._programs.advance(
                rep.mesh_index, rep.state, rep.inputs, np.int32(max_iterations), groups)
            launched.append(_Slice(rep, outputs, done, rep.slot_request.copy(),
                                   time.monotonic()))
        return launched

    def _land(self, launched: list[_Slice]) -> None:
        """Read launched slices (waiting for them): their done flags, for the requests each
        slot held when the slice was dispatched (a slot joined or returned since keeps the
        host's flag), their counters (a stalled loop is an error) and the session's seconds
        an iteration."""
        ran = 0
        for piece in launched:
            rep = piece.rep
            done = np.asarray(piece.done)
            counters = jax.device_get(dataclasses.replace(
                piece.outputs, tokens=None, logprobs=None, prompt_routing=None, routing=None))
            if counters.stalled:
                raise RuntimeError(
                    f"the decode loop stopped with requests left: the KV page pool "
                    f"({self.engine.num_pages} pages) could not hold them; raise "
                    "hbm_utilization_vllm")
            stats = stats_of(counters)
            ran = max(ran, stats["iterations"] - self.last_stats[rep.mesh_index].get(
                "iterations", 0))
            self.last_stats[rep.mesh_index] = stats
            rep.done = np.where(piece.occupants == rep.slot_request, done, rep.done)
            rep.outputs = piece.outputs
        now = time.monotonic()
        if launched and ran:
            began = max(launched[0].dispatched, self._landed_at or 0.0)
            self._iteration_s = (now - began) / ran
        self._landed_at = now

    def _land_running(self) -> dict[int, Completion]:
        """The groups of the slice a timed step left running (none: {}), read."""
        if self._running is None:
            return {}
        running, self._running = self._running, None
        self._land(running)
        return self._whole_groups()

    def _whole_groups(self) -> dict[int, Completion]:
        """The undelivered groups whose requests are all done, their slots freed."""
        whole = [g for g in self._groups if self._replicas[g.replica].done[list(g.slots)].all()]
        fetched: dict[int, Any] = {}
        finished = {}
        for group in whole:
            rep = self._replicas[group.replica]
            if group.replica not in fetched:
                fetched[group.replica] = jax.device_get(rep.outputs)
            out = fetched[group.replica]
            for slot, request_id in zip(group.slots, group.request_ids, strict=True):
                finished[request_id] = done = completion_of(out, slot, self.sampling,
                                                            self.engine.options.eos_ids)
                self._finish(rep, slot, request_id, done)
        self._groups = [g for g in self._groups if g not in whole]
        return finished

    def lengths(self) -> dict[int, int]:
        """Tokens sampled so far by each request joined and not yet returned, by request id
        (read from the loop state on the device)."""
        out: dict[int, int] = {}
        for replica in {g.replica for g in self._groups}:
            rep = self._replicas[replica]
            lens = np.asarray(jax.device_get(rep.state.requests.lengths))
            out.update({int(rep.slot_request[s]): int(lens[s])
                        for s in np.flatnonzero(rep.slot_request >= 0)})
        return out

    def _finish(self, rep: _Replica, slot: int, request_id: int, done: Completion) -> None:
        """Free the request's slot and its use of its prompt slot, and its keep slot unless
        its pages are kept there (as the loop kept them: `block_tables.keeping`)."""
        prompt_slot = int(rep.host["request_prompts"][slot])
        keep_slot = int(rep.host["request_kept"][slot])
        prompt = rep.host["prompts"][prompt_slot, :rep.host["prompt_lens"][prompt_slot]]
        rep.slot_request[slot] = -1
        kept = keep_slot >= 0 and len(prompt) + len(done.tokens) - 1 < self.shape.prompt_len
        if kept:
            self._kept[request_id] = _Kept(rep.mesh_index, keep_slot,
                                           np.concatenate([prompt, done.tokens]))
        if not kept or keep_slot != prompt_slot:
            rep.prompt_users[prompt_slot] -= 1
        if not kept and keep_slot not in (-1, prompt_slot):
            rep.prompt_users[keep_slot] -= 1

    def release(self, request_ids: int | Sequence[int]) -> None:
        """Free returned requests' kept pages (`join(keep=True)`) and keep slots: one program
        a replica. An error naming a request with no kept pages frees nothing."""
        self._check_open()
        ids = [request_ids] if isinstance(request_ids, int) else list(request_ids)
        if len(set(ids)) < len(ids):
            raise ValueError(f"release names a request twice: {ids}")
        if bad := [i for i in ids if i not in self._kept]:
            raise ValueError(f"request {bad[0]} has no kept pages to release")
        released = {r.mesh_index: np.zeros((self.shape.num_prompts,), bool)
                    for r in self._replicas}
        for kept in map(self._kept.pop, ids):
            released[kept.replica][kept.prompt_slot] = True
            self._replicas[kept.replica].prompt_users[kept.prompt_slot] -= 1
        for replica, mask in released.items():
            if mask.any():
                rep = self._replicas[replica]
                rep.state = self._programs.release(rep.mesh_index, rep.state, mask)

    @property
    def keeps_pages(self) -> bool:
        """Whether `join(keep=True, continue_from=...)` is honoured: not with recorded expert
        routing (`join`)."""
        return self.shape.routing is None

    @property
    def kept(self) -> list[int]:
        """The returned requests whose pages are kept, by request id."""
        return sorted(self._kept)

    @property
    def unfinished(self) -> int:
        """Requests joined and not yet returned."""
        return sum(len(g.slots) for g in self._groups)

    # ----- closing -----

    def _check_open(self) -> None:
        if not self._replicas:
            raise RuntimeError("the session is closed: open another with engine.session()")

    def close(self) -> None:
        """Give the engine its page pools back (or free them, as `generate` would)."""
        for rep in self._replicas:
            self.engine._return_pool(rep.mesh_index, rep.state.pool, self)
        self._replicas, self._kept = [], {}

    def __enter__(self) -> DecodeSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def refuse_engine(engine: Any) -> None:
    """Engines whose loop a session cannot slice, refused by name with the reason."""
    name = type(engine).__name__
    if engine.options.lockstep:
        raise NotImplementedError(
            f"{name} with lockstep=True runs every replica in one program whose loop condition "
            "is an all-reduce over the replicas (the single-controller baseline); a session "
            "slices per-replica loops: open it on an engine with lockstep=False")
    if not engine.options.continuous_batching:
        raise NotImplementedError(
            f"{name} with continuous_batching=False decodes a share in waves of separate "
            "programs; a session is one running loop whose rows refill: turn "
            "rollout_continuous_batching on")


def split_groups(count: int, group_size: int | Sequence[int]) -> list[range]:
    """A join's groups of request indices: `count` requests in groups of `group_size` (a
    sequence: each group's size, in order); an error names a `group_size` that does not fit."""
    sizes = ([group_size] * (count // max(group_size, 1))
             if isinstance(group_size, int) else list(group_size))
    if min(sizes, default=0) < 1 or sum(sizes) != count:
        raise ValueError(f"{count} prompts do not split into groups of group_size={group_size}")
    starts = np.cumsum([0, *sizes[:-1]])
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def check_slice(max_iterations: int | None, time_budget_s: float | None, unit: str) -> None:
    """A ValueError naming a slice bound no session can run: under one `unit` or no time."""
    if max_iterations is not None and max_iterations < 1:
        raise ValueError(f"max_iterations={max_iterations}: a slice runs at least one {unit} "
                         "(None: until every request is done)")
    if time_budget_s is not None and not time_budget_s > 0:
        raise ValueError(f"time_budget_s={time_budget_s} must be > 0 (None: no budget)")


def session_shape(engine: Any, sampling: SamplingParams, max_requests: int, max_prompts: int,
                  max_prompt_length: int | None, group_size: int) -> ProgramShape:
    """The program shape of a session: `JaxEngine._shape`'s rules at the given capacity."""
    opts = engine.options
    replicas = len(engine.meshes)
    n = pow2_at_least(-(-max_requests // replicas))
    u = pow2_at_least(-(-max_prompts // replicas))
    cap = opts.max_prompt_length
    if max_prompt_length is not None and not 1 <= max_prompt_length <= cap:
        raise ValueError(f"max_prompt_length={max_prompt_length} must be in 1..{cap} (the "
                         "engine's max_prompt_length)")
    prompt_len = prompt_bucket(max_prompt_length or cap, cap)
    new = min(pow2_at_least(sampling.max_new_tokens), opts.max_new_tokens)
    chunk, rows = pages.prefill_chunk(prompt_len, opts.max_num_batched_tokens)
    return ProgramShape(
        num_requests=n, num_slots=min(n, pow2_at_least(opts.max_batch_size)), num_prompts=u,
        prompt_len=prompt_len, max_new=new, page_size=opts.page_size,
        num_pages=engine.num_pages, chunk=chunk, prefill_rows=max(1, min(u, rows)),
        group_size=pow2_at_least(group_size) if opts.prefix_caching else 1,
        pack_decode_rows=engine.pack_decode_rows,
        routing=getattr(engine._replica_model(0), "routing_shape", None))
