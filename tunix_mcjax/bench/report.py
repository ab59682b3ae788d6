"""Benchmark report: per-arm step times and phases, speedups with intervals, equal work, plots.

Scored steps are the second pass over the batches (steps B..2B-1), compile steps excluded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from tunix_mcjax.bench import stats
from tunix_mcjax.bench.equal_work import RunLog, check_equal_work

PHASES = ("admit", "generate", "reward", "pack", "train", "publish")
# Tunix admits inside generate and packs inside its loop, so gaps compare these groups.
GAP_GROUPS = {"rollout": ("admit", "generate"), "reward": ("reward",), "train": ("train",),
              "publish": ("publish",), "pack+other": ("pack", "other")}
HOST_SHARE = (
    "Host share is measured in the traced launch (`--trace-steps`): 1 - device busy, where "
    "device busy is the share of a step's wall time in which XLA's execution threads run a "
    "program (compute and the collectives inside programs), median over traced steps and "
    "hosts. The rest is host work: Python, dispatch, admission, reward, packing, the small "
    "cross-host exchanges (run inline on the Python thread), publication and metrics. "
    "Dispatches are jitted-program calls from Python, host syncs device values read back into "
    "Python, per step; train-step collectives are read from the train step's optimized HLO "
    "(result bytes per device)."
)

ROLLOUT_IMBALANCE = (
    "Rollout max/mean is the slowest host's generate time over the hosts' mean, median over "
    "scored steps: 1 is balanced; every host waits for the slowest one at the next all-gather."
)


@dataclasses.dataclass(frozen=True)
class ArmRun:
    """One arm at one host count: each launch's log and metadata. Statistics pool launches."""

    arm: str
    hosts: int
    launches: tuple[RunLog, ...]
    meta: tuple[dict, ...]

    @property
    def log(self) -> RunLog:
        if len(self.launches) == 1:
            return self.launches[0]
        return RunLog("+".join(run.name for run in self.launches),
                      tuple(r for run in self.launches for r in run.records))


def phase_table(run: RunLog, first_scored: int, reduce=np.median) -> dict[str, float]:
    """Seconds per phase over scored steps; `other` is the step outside all phases."""
    scored = run.scored(first_scored)
    present = [p for p in PHASES if any(p in r["phase_s"] for r in scored)]
    table = {p: float(reduce([r["phase_s"].get(p, 0.0) for r in scored])) for p in present}
    table["other"] = float(reduce(
        [r["step_s"] - sum(r["phase_s"].get(p, 0.0) for p in present) for r in scored]))
    return table


def gap_by_phase(arm: dict, ref: dict) -> dict[str, float]:
    """Where the mean step-time gap (arm - ref) sits, by phase group (Appendix C: means add)."""
    def total(a: dict, phases: tuple[str, ...]) -> float:
        return sum(a["phase_mean_s"].get(p, 0.0) for p in phases)
    gaps = {g: total(arm, ps) - total(ref, ps) for g, ps in GAP_GROUPS.items()}
    gaps["step"] = arm["mean_step_s"] - ref["mean_step_s"]
    return gaps


def rollout_imbalance(run: RunLog, first_scored: int) -> np.ndarray | None:
    """Per scored step, the slowest host's generate time over the hosts' mean (1 = balanced).

    None for runs that do not log per-host generate times (the Tunix arm).
    """
    scored = run.scored(first_scored)
    if not scored or any(r.get("generate_mean_s", 0.0) <= 0 for r in scored):
        return None
    return np.array([r["generate_max_s"] / r["generate_mean_s"] for r in scored])


def output_length_correlation(host_records: list[dict], first_scored: int) -> float:
    """Pearson r of each prompt's mean output length in the first pass vs the second.

    How much the expected-output weights of `rl_balance_by_expected_output` can know: near 0,
    a prompt's earlier lengths say nothing about its next ones.
    """
    passes: tuple[dict[int, list[float]], dict[int, list[float]]] = ({}, {})
    for r in host_records:
        seen = passes[r["step"] >= first_scored]
        for i, length in zip(r["local_prompt_indices"], r["completion_len_by_prompt"],
                             strict=True):
            seen.setdefault(i, []).append(length)
    both = sorted(passes[0].keys() & passes[1].keys())
    if len(both) < 3:
        raise ValueError(f"only {len(both)} prompts appear in both passes")
    first, second = ([np.mean(p[i]) for i in both] for p in passes)
    return float(np.corrcoef(first, second)[0, 1])


def decode_token_imbalance(host_records: list[dict], first_scored: int) -> float:
    """Median over second-pass steps of the busiest host's decoded tokens over the hosts' mean:
    how evenly an assignment spread the rollout work, free of timing noise."""
    by_step: dict[int, list[float]] = {}
    for r in host_records:
        if r["step"] >= first_scored:
            by_step.setdefault(r["step"], []).append(r["completion_tokens"])
    if not by_step:
        raise ValueError(f"no host records from step {first_scored}")
    return float(np.median([max(t) / np.mean(t) for t in by_step.values()]))


def arm_summary(a: ArmRun, first_scored: int, fixed_cost: dict | None = None) -> dict:
    scored = a.log.scored(first_scored)
    if not scored:
        raise ValueError(f"{a.log.name}: no steady steps from step {first_scored}")
    step_s = a.log.column("step_s", first_scored)
    tokens = a.log.column("tokens_generated", first_scored)
    second_pass = [r for r in a.log.records if r["step"] >= first_scored]
    imbalance = rollout_imbalance(a.log, first_scored)
    return {
        "run": a.log.name,
        "median_step_s": float(np.median(step_s)),
        "median_s_per_1k_tokens": float(np.median(stats.per_token(step_s, tokens)) * 1e3),
        "phase_median_s": phase_table(a.log, first_scored),
        "mean_step_s": float(np.mean(step_s)),
        "phase_mean_s": phase_table(a.log, first_scored, np.mean),
        "host_share": None if fixed_cost is None else fixed_cost["host_share"],
        "fixed_cost": fixed_cost,
        "rollout_imbalance": None if imbalance is None else float(np.median(imbalance)),
        "steady_steps": len(scored),
        "compiled_scored_steps": len(second_pass) - len(scored),
        "reward_mean": float(np.mean([r.get("reward_mean", np.nan) for r in scored])),
        "launches": list(a.meta),
    }


def _launch_columns(arm: ArmRun, key: str, first_scored: int) -> list[np.ndarray]:
    return [run.column(key, first_scored) for run in arm.launches]


def ratio(num: ArmRun, den: ArmRun, first_scored: int, seed: int) -> dict:
    """T_num / T_den per step and per generated token, with launch/block bootstrap intervals."""
    t_num, t_den = (_launch_columns(a, "step_s", first_scored) for a in (num, den))
    per_step = stats.launch_bootstrap_ratio(t_num, t_den, seed=seed)
    per_tok = stats.launch_bootstrap_ratio(
        [stats.per_token(t, n) for t, n in zip(
            t_num, _launch_columns(num, "tokens_generated", first_scored), strict=True)],
        [stats.per_token(t, n) for t, n in zip(
            t_den, _launch_columns(den, "tokens_generated", first_scored), strict=True)],
        seed=seed + 1)
    out = {**per_step.as_dict(), "per_token": per_tok.as_dict(),
           "faster": stats.is_faster(per_step) and stats.is_faster(per_tok)}
    logs = (num.log, den.log)
    if any(r["compiled"] for log in logs for r in log.records if r["step"] >= first_scored):
        # Compile time charged back: total second-pass time, compile steps included.
        totals = [sum(r["step_s"] for r in log.records if r["step"] >= first_scored)
                  for log in logs]
        out["with_compile"] = totals[0] / totals[1]
    return out


def _imbalance_ratio(num: ArmRun, den: ArmRun, first_scored: int, seed: int) -> dict | None:
    sides = [[rollout_imbalance(run, first_scored) for run in a.launches] for a in (num, den)]
    if any(x is None for side in sides for x in side):
        return None
    return stats.launch_bootstrap_ratio(*sides, seed=seed).as_dict()


def equal_work(ref: ArmRun, other: ArmRun, first_scored: int) -> dict:
    """The equal-work rule launch by launch (launch i of one arm against launch i of the other)."""
    checks = [check_equal_work(a, b, first_scored)
              for a, b in zip(ref.launches, other.launches, strict=True)]
    problems = [f"launch {i}: {p}" if len(checks) > 1 else p
                for i, c in enumerate(checks) for p in c.problems]
    return {"ok": not problems, "problems": problems, "summary": [c.summary for c in checks]}


def moved_phase(base: dict, variant: dict) -> dict:
    """The phase whose median changed most from base to variant (seconds, variant - base)."""
    deltas = {p: variant["phase_median_s"].get(p, 0.0) - base["phase_median_s"].get(p, 0.0)
              for p in base["phase_median_s"]}
    top = max(deltas, key=lambda p: abs(deltas[p]))
    return {"phase": top, "delta_s": deltas[top], "deltas_s": deltas}


def build_report(runs: list[ArmRun], reference: str, first_scored: int, *, ablation: bool,
                 context: dict, seed: int = 0,
                 fixed_cost: dict[tuple[str, int], dict] | None = None) -> dict:
    """The report for every host count; top-level fields mirror the largest host count.
    `fixed_cost`: (arm, hosts) -> `bench.trace.summarize` of that arm's traced launch."""
    fixed_cost = fixed_cost or {}
    by_hosts = {}
    for hosts in sorted({r.hosts for r in runs}):
        at = {r.arm: r for r in runs if r.hosts == hosts}
        arms = {name: arm_summary(r, first_scored, fixed_cost.get((name, hosts)))
                for name, r in at.items()}
        refs = [reference] if ablation else [a for a in (reference, f"{reference}+opt") if a in at]
        ratios, pairs = {}, {}
        for ref in refs:
            for name, r in at.items():
                if name == ref:
                    continue
                num, den = (at[ref], r) if ablation else (r, at[ref])
                key = f"{ref}_over_{name}" if ablation else f"{name}_over_{ref}"
                ratios[key] = ratio(num, den, first_scored, seed)
                if ablation:
                    ratios[key]["moved"] = moved_phase(arms[ref], arms[name])
                    imbalance = _imbalance_ratio(num, den, first_scored, seed + 2)
                    if imbalance is not None:
                        ratios[key]["imbalance"] = imbalance
                else:
                    ratios[key]["gap_by_phase_s"] = gap_by_phase(arms[name], arms[ref])
                if ref == reference:
                    pairs[name] = equal_work(at[ref], r, first_scored)
        by_hosts[str(hosts)] = {
            "hosts": hosts, "arms": arms, "ratios": ratios,
            "equal_work": {"ok": all(p["ok"] for p in pairs.values()), "pairs": pairs},
        }
    top = by_hosts[max(by_hosts, key=int)]
    return {**context, "reference": reference, "ablation": ablation,
            "first_scored_step": first_scored, "host_share_definition": HOST_SHARE,
            **top, "by_hosts": by_hosts}


def fixed_cost_table(arms: dict[str, dict]) -> list[str]:
    """Markdown lines: each traced arm's fixed cost per step (none without traces)."""
    traced = {name: a["fixed_cost"] for name, a in arms.items() if a.get("fixed_cost")}
    if not traced:
        return []
    lines = ["", "Fixed cost per step (traced launch; medians over its traced steps and hosts):",
             "", "| arm | train-step collectives | collective bytes | dispatches | host syncs | "
             "device busy | host share | traced step s |", "|---" * 8 + "|"]
    for name, f in traced.items():
        c = f["train_step_collectives"]
        kinds = "-" if c is None else ", ".join(
            f"{v['count']} {k}" for k, v in c.items() if k != "total") or "0"
        total = "-" if c is None else f"{c['total']['count']} ({kinds})"
        size = "-" if c is None else f"{c['total']['bytes'] / 1e6:.3f} MB"
        lines.append(f"| {name} | {total} | {size} | {f['dispatches']:.0f} | "
                     f"{f['host_syncs']:.0f} | {f['device_busy']:.0%} | {f['host_share']:.0%} | "
                     f"{f['wall_s']:.3f} |")
    phased = {name: f["phases"] for name, f in traced.items() if f.get("phases")}
    names = list(dict.fromkeys(p for phases in phased.values() for p in phases))
    if phased:
        lines += ["", "Traced step by phase function, wall ms (device-busy ms inside):", "",
                  "| arm | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for name, phases in phased.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{phases[p]['wall_s'] * 1e3:.1f} ({phases[p]['device_s'] * 1e3:.1f})"
                if p in phases else "-" for p in names) + " |")
    return lines


def _fmt_ci(r: dict) -> str:
    return f"{r['median']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"


def arm_table(arms: dict[str, dict]) -> list[str]:
    """Markdown lines: each arm's median step, its cost per 1k tokens and its phases."""
    lines = ["| arm | median step s | s / 1k tokens | host share | rollout max/mean | "
             + " | ".join(PHASES) + " | other | steady steps |",
             "|---" * (len(PHASES) + 7) + "|"]
    for name, a in arms.items():
        ph = a["phase_median_s"]
        cells = [f"{ph[p]:.3f}" if p in ph else "-" for p in (*PHASES, "other")]
        imbalance = a.get("rollout_imbalance")
        share = "-" if a["host_share"] is None else f"{a['host_share']:.0%}"
        lines.append(f"| {name} | {a['median_step_s']:.3f} | {a['median_s_per_1k_tokens']:.3f}"
                     f" | {share} | "
                     f"{'-' if imbalance is None else f'{imbalance:.3f}'} | "
                     + " | ".join(cells) + f" | {a['steady_steps']} |")
    return lines


def ratio_table(ratios: dict[str, dict], ablation: bool) -> list[str]:
    """Markdown lines: each ratio per step and per token, with its verdict (an ablation's:
    the change, the phase moved most, the rollout imbalance) and, but in an ablation, the
    mean gap to the reference by phase group."""
    verdict = ("step-time change (per-step interval excludes 1) | phase moved most | "
               "rollout max/mean, base / variant" if ablation else
               f"faster (both lower bounds > {stats.FASTER_MARGIN})")
    lines = ["", f"| ratio | per step | per token | {verdict} |",
             "|---|---|---|---|" + ("---|---|" if ablation else "")]
    for name, r in ratios.items():
        if ablation:
            change = ("faster" if r["ci_low"] > 1 else "slower" if r["ci_high"] < 1
                      else "none resolved")
            imbalance = _fmt_ci(r["imbalance"]) if "imbalance" in r else "-"
            cell = (f"{change} | {r['moved']['phase']} ({r['moved']['delta_s']:+.3f} s) | "
                    f"{imbalance}")
        else:
            cell = "yes" if r["faster"] else "no"
            if "with_compile" in r:
                cell += f" (compile charged back: {r['with_compile']:.2f})"
        lines.append(f"| {name} | {_fmt_ci(r)} | {_fmt_ci(r['per_token'])} | {cell} |")
    if not ablation:
        lines += ["", "Mean step-time gap to the reference by phase group (s; means add):", "",
                  "| ratio | " + " | ".join((*GAP_GROUPS, "step")) + " |",
                  "|---" * (len(GAP_GROUPS) + 2) + "|"]
        for name, r in ratios.items():
            lines.append(f"| {name} | " + " | ".join(
                f"{v:+.3f}" for v in r["gap_by_phase_s"].values()) + " |")
    return lines


def run_notes(at: dict) -> list[str]:
    """Markdown lines: the machine's load around each launch, the code, the equal-work check."""
    load = [f"{name} " + ", ".join(f"{m['loadavg_1m_before']:.1f}->{m['loadavg_1m_after']:.1f}"
                                   for m in a["launches"] if "loadavg_1m_before" in m)
            for name, a in at["arms"].items()]
    lines = ["", f"Machine load (1-min load average, before->after each launch, "
             f"{os.cpu_count()} CPUs): " + "; ".join(load)]
    codes = sorted({m["code"] for a in at["arms"].values() for m in a["launches"]
                    if "code" in m})
    if len(codes) > 1:
        lines += ["", f"WARNING: runs used different code versions: {', '.join(codes)}"]
    elif codes:
        lines += ["", f"Code: {codes[0]}"]
    ew = at["equal_work"]
    lines += ["", f"Equal work: {'ok' if ew['ok'] else 'FAILED'}"]
    for name, p in ew["pairs"].items():
        lines += [f"- {name}: {'ok' if p['ok'] else '; '.join(p['problems'][:5])}"]
    return lines


def report_notes(report: dict) -> list[str]:
    """Markdown lines: what the report holds beyond its host counts' tables."""
    lines = []
    if "tunix_layouts" in report:
        lines += ["Tunix layouts (median step s): " + ", ".join(
            f"{k} {v:.3f}" for k, v in report["tunix_layouts"].items()), ""]
    if "output_length_r" in report:
        lines += ["Output-length predictability (Pearson r of each prompt's mean output length, "
                  "first pass vs second, base arm, per launch): " + ", ".join(
                      f"{r:.2f}" for r in report["output_length_r"]), ""]
    if "decode_token_imbalance" in report:
        lines += ["Decoded tokens per host, max/mean (median over second-pass steps, per launch): "
                  + "; ".join(f"{arm} " + ", ".join(f"{x:.3f}" for x in values)
                              for arm, values in report["decode_token_imbalance"].items()), ""]
    if "streaming" in report:
        lines += ["Median s over scored steps (generate, reward, reward scored while decoding, "
                  "step): " + "; ".join(
                      f"{arm} " + ", ".join(f"{k.removesuffix('_s')} {v:.3f}"
                                            for k, v in values.items())
                      for arm, values in report["streaming"].items()), ""]
    return lines + [report["host_share_definition"], ROLLOUT_IMBALANCE, ""]


def markdown(report: dict) -> str:
    """The report's tables."""
    lines = [f"# Step-time benchmark: {report['profile']}", "",
             f"Scored: steps {report['first_scored_step']}+ (second pass), compile steps "
             f"excluded; intervals: 95% percentile bootstrap, {stats.RESAMPLES} resamples of "
             f"launches and, in each, of {stats.BLOCK_STEPS}-step blocks.", ""]
    for key, at in report["by_hosts"].items():
        lines += [f"## {key} host(s) x {report['devices_per_host']} device(s)", "",
                  *arm_table(at["arms"]), *fixed_cost_table(at["arms"]),
                  *ratio_table(at["ratios"], report["ablation"]), *run_notes(at), ""]
    return "\n".join(lines + report_notes(report))


def plot(report: dict, out_dir: Path) -> list[Path]:
    """Step time stacked by phase per arm (and host count); speedup vs hosts when several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    bars = [(f"{name}\n{h}h" if len(report["by_hosts"]) > 1 else name, a)
            for h, at in report["by_hosts"].items() for name, a in at["arms"].items()]
    labels = [b[0] for b in bars]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(bars)) + 1.5, 4))
    bottom = np.zeros(len(bars))
    for phase in (*PHASES, "other"):
        heights = np.array([max(a["phase_median_s"].get(phase, 0.0), 0.0) for _, a in bars])
        if heights.any():
            ax.bar(labels, heights, bottom=bottom, label=phase)
            bottom += heights
    for x, (_, a) in enumerate(bars):
        ax.annotate(f"{a['median_step_s']:.3f}s", (x, bottom[x]), ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel("median seconds per step")
    ax.set_title(f"{report['profile']}: step time by phase")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    paths.append(out_dir / "step_time_by_phase.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    if len(report["by_hosts"]) > 1:
        fig, ax = plt.subplots(figsize=(5, 4))
        hosts = sorted(report["by_hosts"], key=int)
        for key in report["by_hosts"][hosts[-1]]["ratios"]:
            rs = [report["by_hosts"][h]["ratios"].get(key) for h in hosts]
            xs = [int(h) for h, r in zip(hosts, rs, strict=True) if r]
            rs = [r for r in rs if r]
            ax.errorbar(xs, [r["median"] for r in rs], marker="o", capsize=3, label=key,
                        yerr=[[r["median"] - r["ci_low"] for r in rs],
                              [r["ci_high"] - r["median"] for r in rs]])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("hosts")
        ax.set_ylabel("speedup (ratio of median step times)")
        ax.set_xticks([int(h) for h in hosts])
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "speedup_vs_hosts.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def write(report: dict, out_dir: Path) -> list[Path]:
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown(report))
    return [out_dir / "report.json", out_dir / "report.md", *plot(report, out_dir)]
