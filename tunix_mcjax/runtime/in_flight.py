"""In-flight weight updates on a DA rollout host (`in_flight_weight_updates`): a batch decodes
on the engine's session (`engine.session`) in two slices. The first runs
`in_flight_update_iterations` loop iterations with the version the batch was issued with; if
requests remain, the host takes the next version (`switch`: it waits for the update the
trainers were running when the batch was issued, and loads it) and the second slice finishes
them on it, their pages and tokens so far kept. A fixed iteration, not a clock, decides which
tokens each version samples, so a rerun samples the same tokens. Each token's version goes to
the trainer in `Rollout.token_versions`; the behaviour logprobs are the engine's per token,
under whichever version sampled it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from tunix_mcjax.engine import Completion
from tunix_mcjax.runtime import phases
from tunix_mcjax.runtime.records import Admission, Rollout


class InFlightPhases(phases.RolloutPhases):
    """`RolloutPhases` whose `generate` may take the next version between two slices. Per
    batch, `begin(version, switch)` sets the batch's version and how to take the next one
    (`switch() -> version loaded`; None: the batch keeps its version)."""

    version: int = 0
    switch: Callable[[], int] | None = None
    token_versions: tuple[np.ndarray, ...] | list[np.ndarray] = ()

    def begin(self, version: int, switch: Callable[[], int] | None) -> None:
        self.version, self.switch = version, switch

    def generate(self, adm: Admission, round_: int = 0) -> list[Completion]:
        g = self.cfg.num_generations
        requests = [self.prompts.tokens[i] for i in adm.local_indices for _ in range(g)]
        if not requests:
            self.token_versions = []
            return []
        seed = phases.rollout_seed(self.cfg.seed, adm.step, self.host, round_)
        with self.engine.session(self.sampling, max_requests=len(requests),
                                 max_prompts=phases.prompt_slots(self.cfg, len(requests)),
                                 group_size=g) as session:
            ids = session.join(requests, seed, group_size=g)
            done = session.step(max_iterations=self.cfg.in_flight_update_iterations)
            sampled, next_version = session.lengths(), self.version
            if session.unfinished:
                if self.switch is not None:
                    next_version = self.switch()
                done.update(session.step())
        completions = [done[i] for i in ids]
        self.token_versions = [token_versions(len(c.tokens), sampled.get(i), self.version,
                                              next_version)
                               for i, c in zip(ids, completions, strict=True)]
        return completions

    def result(self, adm: Admission, completions: list[Completion], scores: phases.Scores,
               policy_version: int, seconds: dict[str, float]) -> Rollout:
        rollout = super().result(adm, completions, scores, policy_version, seconds)
        return dataclasses.replace(rollout, token_versions=tuple(self.token_versions))


def token_versions(length: int, sampled: int | None, first: int, second: int) -> np.ndarray:
    """int32 [length]: `first` for the tokens sampled before the switch (`sampled` of them;
    None: the request was done, all of them), `second` after."""
    before = length if sampled is None else sampled
    return np.where(np.arange(length) < before, first, second).astype(np.int32)


def token_staleness(rollouts: list[Rollout], trained_on: int, bound: int) -> dict:
    """{"token_staleness": tokens by staleness 0, 1, ..., "mixed_completions": completions
    whose tokens span two versions} of the batch update `trained_on` applies; raises naming
    the step when a token is more than `bound` updates stale."""
    versions = [v for r in rollouts for v in (r.token_versions or ())]
    if not versions:
        return {}
    staleness = trained_on - np.concatenate(versions)
    if staleness.max(initial=0) > bound or staleness.min(initial=0) < 0:
        raise RuntimeError(f"update {trained_on} got tokens {int(staleness.max())} versions "
                           f"stale (or from a version not yet made), past the bound "
                           f"off_policy_steps={bound}")
    return {"token_staleness": np.bincount(staleness, minlength=bound + 1).tolist(),
            "mixed_completions": sum(len(set(v.tolist())) > 1 for v in versions)}
