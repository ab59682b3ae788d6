"""LoCoJAX-DA against LoCoJAX-CO: the paper's verdict rule (Appendix A) and reward band (§4.4).

For each DA arm (a trainer share, a staleness bound k, in-flight updates on or off) at a
host count, against the colocated reference arm `mcjax`:
- Welch: the 95% t interval of the ratio on log launch values (each launch's median steady step);
- paired-step bootstrap: launch i of one arm paired with launch i of the other, their common
  steady steps paired by step number (the same batch), step indices resampled jointly;
- verdict: "DA faster" or "CO faster" only when both intervals fall on the same side of 1;
  otherwise none (the two rules disagree, or an interval holds 1);
- reward: the mean training reward over every step of the runs, DA - CO, within the paper's
  pre-registered 0.005 band or not.
Each split's step also splits into Eq. 4's two branches: rollout (admit + generate + reward +
weight load) and trainer (pack + train + publish), medians over steady steps.
"""

from __future__ import annotations

import numpy as np

from tunix_mcjax.bench import stats
from tunix_mcjax.bench.report import ArmRun

REFERENCE = "mcjax"
REWARD_BAND = 0.005
ROLLOUT_BRANCH = ("admit", "generate", "reward")
TRAINER_BRANCH = ("pack", "train", "publish")


def split_arm(fraction: float, staleness: int = 1, in_flight: bool = False) -> str:
    """The bench arm of one DA split: mcjax_da-t50, -t25, -t12.5 (trainer share in %) at the
    paper's staleness of 1; -t50-k2 at off_policy_steps=2; a trailing -if with
    in_flight_weight_updates on."""
    return (f"mcjax_da-t{fraction * 100:g}" + (f"-k{staleness}" if staleness != 1 else "")
            + ("-if" if in_flight else ""))


def parse_arm(arm: str) -> tuple[float, int, bool]:
    """`split_arm`'s inverse: (trainer share, staleness k, in-flight updates)."""
    share, *rest = arm.removeprefix("mcjax_da-t").split("-")
    staleness = next((int(p[1:]) for p in rest if p.startswith("k")), 1)
    return float(share) / 100, staleness, "if" in rest


def split_fraction(arm: str) -> float:
    return parse_arm(arm)[0]


def _launch_medians(arm: ArmRun, first_scored: int) -> list[float]:
    return [float(np.median(run.column("step_s", first_scored))) for run in arm.launches]


def _paired_steps(da: ArmRun, co: ArmRun, first_scored: int) -> tuple[list[float], list[float]]:
    num, den = [], []
    for a, b in zip(da.launches, co.launches, strict=False):
        co_steps = {r["step"]: r["step_s"] for r in b.scored(first_scored)}
        for r in a.scored(first_scored):
            if r["step"] in co_steps:
                num.append(r["step_s"])
                den.append(co_steps[r["step"]])
    return num, den


def _side(interval: stats.Interval) -> str:
    return "DA faster" if interval.high < 1 else "CO faster" if interval.low > 1 else "none"


def _branch(arm: ArmRun, first_scored: int, phases: tuple[str, ...], extra: str = "") -> float:
    return float(np.median([sum(r["phase_s"][p] for p in phases) + r.get(extra, 0.0)
                            for r in arm.log.scored(first_scored)]))


def compare_split(da: ArmRun, co: ArmRun, first_scored: int, seed: int = 0) -> dict:
    """One DA split against CO at one host count (see the module docstring)."""
    da_medians, co_medians = _launch_medians(da, first_scored), _launch_medians(co, first_scored)
    welch = stats.welch_log_ratio(da_medians, co_medians) \
        if min(len(da_medians), len(co_medians)) >= 2 else None
    paired = stats.paired_step_bootstrap(*_paired_steps(da, co, first_scored), seed=seed)
    sides = {_side(paired)} | ({_side(welch)} if welch else {"none"})
    reward = {name: float(np.mean([r["reward_mean"] for r in arm.log.records]))
              for name, arm in (("da", da), ("co", co))}
    gap = reward["da"] - reward["co"]
    return {
        "trainer_fraction": split_fraction(da.arm),
        "staleness": parse_arm(da.arm)[1],
        "in_flight": parse_arm(da.arm)[2],
        "launches": {"da": len(da_medians), "co": len(co_medians)},
        "median_step_s": {"da": float(np.median(da_medians)), "co": float(np.median(co_medians))},
        "launch_median_step_s": {"da": da_medians, "co": co_medians},
        "welch": None if welch is None else welch.as_dict(),
        "paired_step_bootstrap": paired.as_dict(),
        "verdict": sides.pop() if len(sides) == 1 else "none",
        "branches_s": {"da_rollout": _branch(da, first_scored, ROLLOUT_BRANCH, "weight_load_s"),
                       "da_trainer": _branch(da, first_scored, TRAINER_BRANCH),
                       "co_rollout": _branch(co, first_scored, ROLLOUT_BRANCH),
                       "co_trainer": _branch(co, first_scored, TRAINER_BRANCH)},
        "reward_mean": reward, "reward_gap": gap, "reward_within_band": abs(gap) <= REWARD_BAND,
        "reward_steps": len(da.log.records),
    }


def compare(runs: list[ArmRun], first_scored: int, ruled_out: dict[str, dict[str, str]]
            ) -> dict:
    """{hosts: {"splits": {arm: compare_split}, "ruled_out": {arm: why}}}."""
    out = {}
    for hosts in sorted({r.hosts for r in runs}):
        at = {r.arm: r for r in runs if r.hosts == hosts}
        splits = {name: compare_split(arm, at[REFERENCE], first_scored)
                  for name, arm in at.items() if name.startswith("mcjax_da")}
        out[str(hosts)] = {"splits": splits, "ruled_out": ruled_out.get(str(hosts), {})}
    return out


def _ci(d: dict | None) -> str:
    return "-" if d is None else f"{d['median']:.3f} [{d['ci_low']:.3f}, {d['ci_high']:.3f}]"


def markdown(comparison: dict, profile: str) -> str:
    lines = [f"# LoCoJAX-DA vs -CO: {profile}", "",
             "Ratio = DA / CO step time (below 1: DA faster). Welch: 95% t interval on log "
             "launch medians; paired: bootstrap over the same steps of paired launches. A "
             "verdict needs both on the same side of 1. Reward: mean training reward over all "
             f"steps, band {REWARD_BAND}.", "",
             "| hosts | trainer share | k | in-flight | launches DA/CO | CO step s | DA step s "
             "| Welch | paired | verdict | DA rollout / trainer branch s "
             "| CO rollout / trainer s | reward CO | reward DA | within band |", "|---" * 15 + "|"]
    for hosts, at in comparison.items():
        for c in at["splits"].values():
            b = c["branches_s"]
            lines.append(
                f"| {hosts} | {c['trainer_fraction']:.3g} | {c.get('staleness', 1)} | "
                f"{'yes' if c.get('in_flight') else 'no'} | {c['launches']['da']}/"
                f"{c['launches']['co']} | {c['median_step_s']['co']:.3f} | "
                f"{c['median_step_s']['da']:.3f} | {_ci(c['welch'])} | "
                f"{_ci(c['paired_step_bootstrap'])} | {c['verdict']} | "
                f"{b['da_rollout']:.3f} / {b['da_trainer']:.3f} | {b['co_rollout']:.3f} / "
                f"{b['co_trainer']:.3f} | {c['reward_mean']['co']:.4f} | "
                f"{c['reward_mean']['da']:.4f} | {'yes' if c['reward_within_band'] else 'no'} "
                f"({c['reward_gap']:+.4f}) |")
        for name, why in at["ruled_out"].items():
            lines.append(f"| {hosts} | {split_fraction(name):.3g} | | | ruled out: {why} |"
                         + " |" * 10)
    return "\n".join(lines) + "\n"
