"""Step-time benchmark: the same GRPO under stock Tunix, our single controller, and McJAX.

    python -m tunix_mcjax.bench.step --profile gsm8k-cpu --hosts 2 --devices-per-host 1 \\
        --arms tunix,single,mcjax --out bench_results/<name>

Arms (same model, tokenizer, reward, hyperparameters, batches and devices):
  tunix      stock Tunix GRPOLearner + RLCluster (vanilla rollout), one process; every layout in
             --tunix-layouts runs and the fastest one is the arm
  tunix-cli  Tunix's own CLI, `python -m tunix.cli.grpo_main` (rl_runtime=default), one process,
             on the same workload (bench.tunix_cli_arm); layouts as for tunix
  single     our runtime, rl_runtime=single: one process drives all H x D devices
  mcjax      our colocated runtime on H hosts (the reference of every ratio)
  mcjax+opt  mcjax with O1-O4 on
  mcjax_da   the disaggregated mode (rl_runtime=mcjax_da) at each trainer share of the paper
             (50%, 25%, 12.5%: arms mcjax_da-t50, -t25, -t12.5) that the host count and batch
             allow; compared with mcjax by the paper's rule (bench.da_compare, da_report.md).
             --da-shares picks shares; --da-staleness 1,2,4 runs each at off_policy_steps=k
             (arms -t50-k2 ..., the paper's k=1 unsuffixed); --da-in-flight adds each with
             in_flight_weight_updates=true (arms ...-if)
--ablation runs mcjax, mcjax+O1 .. mcjax+O4 and mcjax+opt, and reports each against mcjax.
--streaming runs mcjax (reward_num_workers=0: the batch scored after generation) and
mcjax+streaming (one reward worker: each group scored as it finishes, while the rest decode)
with a reward of 50 ms per completion (bench.slow_reward), reported like --ablation plus each
arm's median generate, reward and step seconds and reward seconds hidden in decoding.
--balance runs mcjax, mcjax+O3 and mcjax+O3x (O3 plus rl_balance_by_expected_output) with
output lengths that vary by prompt, reported like --ablation plus each arm's rollout imbalance
(slowest host's generate time / mean) and how well a prompt's first-pass output length predicts
its second-pass one (Pearson r). It sets ignore_eos=false, decode_sampling_strategy=greedy and
rollout_max_batch_size=8 (--set overrides them): a random-init model's completions then end
where EOS first becomes the argmax, so lengths differ by prompt and repeat across epochs (r = 1,
the predictor's best case), and a host's rollout time follows its token load. Add
--set decode_sampling_strategy=weighted for lengths that earlier epochs do not predict.

Protocol: 20 batches twice (40 steps); the second pass is scored, compile steps excluded.
Runs go one at a time; with --launches N, round robin over the arms N times, and statistics pool
the launches' steady steps (intervals resample launches, then blocks of steps: bench.stats).
--trace-steps N adds one launch per arm (not timed) whose steps B+1..B+N run under the JAX
profiler; its per-step fixed cost (train-step collectives, dispatches, host syncs, device-busy
share: bench.trace) goes to <out>/runs/<arm>-h<H>-trace/fixed_cost.json and the report.
Each run's log is in <out>/logs/, its steps in <out>/runs/, traces in <out>/traces/.
Outputs: <out>/report.json, report.md and PNGs (see tunix_mcjax.bench.report for definitions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tunix_mcjax.bench import da_compare, profiles, report, trace
from tunix_mcjax.bench.equal_work import RunLog

OPTIMIZATIONS = {
    "O1": "rl_async_metrics_export",
    "O2": "rl_gc_freeze_after_warmup",
    "O3": "rl_balance_prompts_by_length",
    "O4": "rl_publish_weights_single_call",
}
ALL_OPT = {key: True for key in OPTIMIZATIONS.values()}
ARMS = ("tunix", "tunix-cli", "single", "mcjax", "mcjax+opt", "mcjax_da")
LAYOUT_ARMS = ("tunix", "tunix-cli")  # one process; each layout in --tunix-layouts is a run
ABLATION = ("mcjax", *(f"mcjax+{o}" for o in OPTIMIZATIONS), "mcjax+opt")
BALANCE = ("mcjax", "mcjax+O3", "mcjax+O3x")
# Rewards scored after generation (mcjax: reward_num_workers=0) against streamed (one reward
# worker: each group as it finishes, while the rest decode), with a 50 ms/completion reward.
STREAMING = ("mcjax", "mcjax+streaming")
STREAMING_SET = ("reward_functions=tunix_mcjax.bench.slow_reward:sleeping_reward",)
# Output lengths that differ by prompt and repeat across epochs (EOS honoured, greedy decoding),
# and 8 decode slots per engine, so that a host's rollout time follows its total tokens (the
# saturated-engine regime of accelerator-scale runs, where requests outnumber decode slots).
BALANCE_SET = ("ignore_eos=false", "decode_sampling_strategy=greedy", "rollout_max_batch_size=8")


@dataclasses.dataclass(frozen=True)
class Run:
    """One process launch: an arm (or one Tunix layout of it) at one host count."""

    arm: str
    hosts: int
    devices_per_host: int
    layout: str = ""  # LAYOUT_ARMS only
    launch: int = 0
    launches: int = 1
    traced: bool = False  # the extra launch under the profiler (bench.trace); not timed

    @property
    def name(self) -> str:
        layout = f"-{self.layout}" if self.layout else ""
        launch = "-trace" if self.traced else f"-l{self.launch}" if self.launches > 1 else ""
        return f"{self.arm}{layout}-h{self.hosts}{launch}"

    def overrides(self) -> dict:
        if self.arm == "single":
            return {"rl_runtime": "single"}
        if self.arm.startswith("mcjax_da"):
            share, staleness, in_flight = da_compare.parse_arm(self.arm)
            return {"rl_runtime": "mcjax_da", "rl_trainer_hosts_fraction": share,
                    **({"off_policy_steps": staleness} if staleness != 1 else {}),
                    **({"in_flight_weight_updates": True} if in_flight else {})}
        if self.arm == "mcjax+opt":
            return ALL_OPT
        if self.arm == "mcjax+streaming":
            return {"reward_num_workers": 1}
        if self.arm == "mcjax+O3x":
            return {OPTIMIZATIONS["O3"]: True, "rl_balance_by_expected_output": True}
        if self.arm.startswith("mcjax+"):
            return {OPTIMIZATIONS[self.arm.removeprefix("mcjax+")]: True}
        return {}

    def command(self, recipe: Path, out: Path, extra: list[str]) -> list[str]:
        keys = [f"{k}={v}" for k, v in self.overrides().items()]
        keys += [f"run_name={self.name}", f"base_output_directory={out / 'runs'}", *extra]
        devices = self.hosts * self.devices_per_host
        if self.arm == "tunix":
            return [sys.executable, "-m", "tunix_mcjax.bench.tunix_arm", "--devices",
                    str(devices), "--layout", self.layout, str(recipe), *keys]
        if self.arm == "tunix-cli":
            return tunix_cli_command(recipe, devices, self.layout, keys)
        hosts, per_host = (1, devices) if self.arm == "single" else (self.hosts,
                                                                      self.devices_per_host)
        launcher = "tunix_mcjax.bench.traced_run" if self.traced else "tunix_mcjax.launch"
        return [sys.executable, "-m", launcher, "--hosts", str(hosts),
                "--devices-per-host", str(per_host), str(recipe), *keys]


@dataclasses.dataclass(frozen=True)
class DaGrid:
    """The mcjax_da arms to run: trainer shares (DA_SPLITS; empty: all), staleness bounds k
    (off_policy_steps) and in-flight updates; every combination the host count allows."""

    shares: tuple[float, ...] = ()
    staleness: tuple[int, ...] = (1,)
    in_flight: tuple[bool, ...] = (False,)


def mcjax_da_arms(hosts: int, batch_size: int, grid: DaGrid = DaGrid()
                  ) -> tuple[list[str], dict[str, str]]:
    """The mcjax_da arm: (the arms this host count and batch allow, {ruled-out split: why})."""
    from tunix_mcjax.config import DA_SPLITS, ConfigError, load_config

    allowed, ruled_out = [], {}
    for fraction in grid.shares or DA_SPLITS:
        cfg = load_config(None, {"rl_runtime": "mcjax_da", "batch_size": batch_size,
                                 "rl_trainer_hosts_fraction": fraction})
        try:
            cfg.disaggregated_split(hosts)
        except ConfigError as e:
            ruled_out[da_compare.split_arm(fraction)] = str(e).split(":")[0]
            continue
        allowed += [da_compare.split_arm(fraction, k, f)
                    for k in grid.staleness for f in grid.in_flight]
    return allowed, ruled_out


def tunix_cli_command(recipe: Path, devices: int, layout: str, keys: list[str]) -> list[str]:
    """The `tunix-cli` arm: `bench.tunix_cli_arm` writes the workload's Tunix CLI config and runs
    `tunix.cli.grpo_main` on it in this process, with the step clock installed."""
    return [sys.executable, "-m", "tunix_mcjax.bench.tunix_cli_arm", "--devices", str(devices),
            "--layout", layout, str(recipe), *keys]


def plan(arms: list[str], hosts: list[int], devices_per_host: int, tunix_layouts: list[str],
         launches: int, batch_size: int = 0, da_grid: DaGrid = DaGrid()) -> list[Run]:
    """Launch after launch, each running every arm once (round robin spreads machine load)."""
    runs = []
    for launch in range(launches):
        for h in hosts:
            for arm in [a for name in arms for a in (
                    mcjax_da_arms(h, batch_size, da_grid)[0] if name == "mcjax_da" else [name])]:
                layouts = [""] if arm not in LAYOUT_ARMS else (
                    tunix_layouts if h * devices_per_host > 1 else ["one-device"])
                runs += [Run(arm, h, devices_per_host, layout, launch, launches)
                         for layout in layouts]
    return runs


def _progress(steps_file: Path, seen: int, run: Run, total: int) -> int:
    if not steps_file.is_file():
        return seen
    lines = steps_file.read_text().splitlines()
    for line in lines[seen:]:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line still being written
            return seen
        print(f"  {run.name} step {r['step'] + 1:3d}/{total} {r['step_s']:7.3f}s"
              f"{'  (compiled)' if r['compiled'] else ''}", flush=True)
        seen += 1
    return seen


def code_version() -> str:
    """The last commit that changed the package, `+dirty` with uncommitted changes in it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()
    return git("log", "-1", "--format=%h", "--", "tunix_mcjax") + ("+dirty" if git(
        "status", "--porcelain", "--untracked-files=no", "tunix_mcjax") else "")


def trace_window(run: Run, out: Path, first_scored: int, trace_steps: int) -> trace.Window:
    """A traced launch profiles `trace_steps` steps from the second scored one."""
    return trace.Window(first_scored + 1, trace_steps,
                        out / "traces" / run.name.removesuffix("-trace"))


def execute(run: Run, recipe: Path, out: Path, extra: list[str], steps: int,
            timeout_s: float, window: trace.Window | None = None) -> dict:
    """Runs one launch to completion with per-step progress; returns its metadata."""
    steps_file = out / "runs" / run.name / "steps.jsonl"
    for stale in (steps_file, *steps_file.parent.glob("host_*.jsonl")):
        stale.unlink(missing_ok=True)
    log_path = out / "logs" / f"{run.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = run.command(recipe, out, extra)
    env = dict(os.environ)
    if window is not None:
        shutil.rmtree(window.out, ignore_errors=True)
        env[trace.TRACE_ENV] = window.encode()
    load_before, code = os.getloadavg()[0], code_version()
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        seen = 0
        while proc.poll() is None:
            seen = _progress(steps_file, seen, run, steps)
            if time.perf_counter() - t0 > timeout_s:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
                raise RuntimeError(f"{run.name}: timed out after {timeout_s:.0f}s; see {log_path}")
            time.sleep(1.0)
    _progress(steps_file, seen, run, steps)
    if proc.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{run.name} failed (exit {proc.returncode}); {log_path}:\n{tail}")
    meta = {"command": " ".join(cmd[1:]), "code": code, "wall_s": time.perf_counter() - t0,
            "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]}
    if window is not None:
        meta["trace"] = window.encode()
        trace.prune_hlo_dump(window.out / "hlo")
    (steps_file.parent / "bench_meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _load(run: Run, out: Path) -> tuple[RunLog, dict]:
    run_dir = out / "runs" / run.name
    meta_file = run_dir / "bench_meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    return RunLog.load(run_dir / "steps.jsonl", run.name), meta


def _host_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(run_dir.glob("host_*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def _balance_context(runs: list[Run], out: Path, first_scored: int, hosts: int) -> dict:
    """Per launch: the base arm's output-length predictability, every arm's token balance."""
    logs = {run: _host_records(out / "runs" / run.name) for run in runs if run.hosts == hosts}
    imbalance: dict[str, list[float]] = {}
    for run, records in logs.items():
        imbalance.setdefault(run.arm, []).append(
            report.decode_token_imbalance(records, first_scored))
    return {"output_length_r": [report.output_length_correlation(records, first_scored)
                                for run, records in logs.items() if run.arm == "mcjax"],
            "decode_token_imbalance": imbalance}


def _streaming_context(runs: list[Run], out: Path, first_scored: int) -> dict:
    """Per arm, medians over the scored steps of every launch and host (compile steps
    excluded): generate, reward and step seconds, and the reward seconds scored while the
    host still decoded (`reward_hidden_s`, 0 without streaming)."""
    columns = ("generate_s", "reward_s", "reward_hidden_s", "step_s")
    steps: dict[str, list[dict]] = {}
    for run in runs:
        steps.setdefault(run.arm, []).extend(
            r for r in _host_records(out / "runs" / run.name)
            if r["step"] >= first_scored and not r["compiled"])
    return {"streaming": {arm: {c: float(np.median([r.get(c, 0.0) for r in records]))
                                for c in columns} for arm, records in steps.items() if records}}


def collect(runs: list[Run], out: Path, first_scored: int) -> tuple[list[report.ArmRun], dict]:
    """Loads every run; per arm in LAYOUT_ARMS and host count, the layout with the fastest
    pooled median is the arm."""
    groups: dict[tuple[str, int, str], list[tuple[RunLog, dict]]] = {}
    for run in runs:
        groups.setdefault((run.arm, run.hosts, run.layout), []).append(_load(run, out))
    arm_runs, layouts, best = [], {}, {}
    for (arm, hosts, layout), loaded in groups.items():
        logs = tuple(log for log, _ in loaded)
        metas = tuple({**meta, "layout": layout} if layout else meta for _, meta in loaded)
        arm_run = report.ArmRun(arm, hosts, logs, metas)
        if arm not in LAYOUT_ARMS:
            arm_runs.append(arm_run)
            continue
        median = float(np.median(arm_run.log.column("step_s", first_scored)))
        layouts[arm, layout, hosts] = median
        if (arm, hosts) not in best or median < best[arm, hosts][0]:
            best[arm, hosts] = (median, arm_run)
    return [b[1] for b in best.values()] + arm_runs, layouts


def _layout_key(arm: str, layout: str, hosts: int) -> str:
    """`<layout>-h<H>` for the tunix arm (as before), `<arm>-<layout>-h<H>` for the others."""
    return f"{layout}-h{hosts}" if arm == "tunix" else f"{arm}-{layout}-h{hosts}"


def traced_runs(arms: list[str], hosts: list[int], devices_per_host: int,
                layouts: dict[tuple[str, str, int], float]) -> list[Run]:
    """One traced launch per arm and host count; LAYOUT_ARMS in their fastest timed layout
    (`layouts`: (arm, layout, hosts) -> pooled median, from `collect`)."""
    runs = []
    for h in hosts:
        for arm in arms:
            layout = ""
            if arm in LAYOUT_ARMS:
                timed = {lay: v for (a, lay, hh), v in layouts.items() if a == arm and hh == h}
                layout = min(timed, key=timed.get)
            runs.append(Run(arm, h, devices_per_host, layout, traced=True))
    return runs


def write_da_report(arm_runs: list[report.ArmRun], first_scored: int, hosts: list[int],
                    profile: profiles.Profile, out: Path, grid: DaGrid = DaGrid()) -> None:
    """The mcjax_da arm's comparison with mcjax: da_report.json and da_report.md."""
    ruled_out = {str(h): mcjax_da_arms(h, profile.batch_size, grid)[1] for h in hosts}
    comparison = da_compare.compare(arm_runs, first_scored, ruled_out)
    (out / "da_report.json").write_text(json.dumps(comparison, indent=2) + "\n")
    text = da_compare.markdown(comparison, profile.name)
    (out / "da_report.md").write_text(text)
    print(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--profile", required=True, choices=sorted(profiles.PROFILES))
    p.add_argument("--hosts", default="2", help="host counts, comma-separated (e.g. 1,2)")
    p.add_argument("--devices-per-host", type=int, default=1)
    p.add_argument("--arms", default="tunix,single,mcjax", help=f"from {', '.join(ARMS)}")
    p.add_argument("--ablation", action="store_true",
                   help=f"run {', '.join(ABLATION)} instead of --arms")
    p.add_argument("--balance", action="store_true",
                   help=f"run {', '.join(BALANCE)} on varying output lengths instead of --arms")
    p.add_argument("--streaming", action="store_true",
                   help=f"run {', '.join(STREAMING)} with a 50 ms/completion reward instead "
                        "of --arms")
    p.add_argument("--da-shares", default="",
                   help="mcjax_da trainer shares, comma-separated (default: the paper's "
                        "0.5,0.25,0.125, those the host count allows)")
    p.add_argument("--da-staleness", default="1",
                   help="mcjax_da staleness bounds k (off_policy_steps), comma-separated: "
                        "one arm per k (arm suffix -k<K>; the paper's DA is k=1)")
    p.add_argument("--da-in-flight", action="store_true",
                   help="each mcjax_da arm also with in_flight_weight_updates=true (suffix -if)")
    p.add_argument("--tunix-layouts", default="fsdp,one-device",
                   help="layouts of the tunix and tunix-cli arms to try: fsdp, one-device")
    p.add_argument("--out", required=True, type=Path, help="output directory (relative path)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra config overrides for every arm")
    p.add_argument("--launches", type=int, default=1,
                   help="launches per arm, run round robin; statistics pool their steps")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    p.add_argument("--trace-steps", type=int, default=0, metavar="N",
                   help="after the timed launches, one more launch per arm with N scored "
                        "steps under the JAX profiler: collectives, dispatches, host syncs "
                        "and device-busy share per step (bench.trace)")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the report from the runs already in --out")
    args = p.parse_args(argv)
    args.hosts = [int(h) for h in args.hosts.split(",")]
    if args.ablation + args.balance + args.streaming > 1:
        p.error("--ablation, --balance and --streaming are separate benchmarks: pick one")
    args.arms = list(ABLATION) if args.ablation else list(BALANCE) if args.balance \
        else list(STREAMING) if args.streaming else args.arms.split(",")
    if args.balance:
        args.set = [*BALANCE_SET, *args.set]
    if args.streaming:
        args.set = [*STREAMING_SET, *args.set]
    unknown = [a for a in args.arms if a not in ARMS + ABLATION + BALANCE + STREAMING]
    if unknown or "mcjax" not in args.arms:
        p.error(f"--arms must include mcjax (the reference) and only {', '.join(ARMS)}")
    args.tunix_layouts = args.tunix_layouts.split(",")
    try:
        args.da_grid = DaGrid(tuple(float(x) for x in args.da_shares.split(",") if x),
                              tuple(int(k) for k in args.da_staleness.split(",")),
                              (False, True) if args.da_in_flight else (False,))
    except ValueError as e:
        p.error(f"--da-shares / --da-staleness: {e}")
    if min(args.da_grid.staleness) < 1:
        p.error("--da-staleness: each k must be >= 1 (off_policy_steps=0 is CO's on-policy)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    profile = profiles.PROFILES[args.profile]
    out: Path = args.out
    first_scored = profiles.BATCHES
    steps = 2 * profiles.BATCHES
    recipe = out / "recipe.yml"
    runs = plan(args.arms, args.hosts, args.devices_per_host, args.tunix_layouts, args.launches,
                profile.batch_size, args.da_grid)
    if not args.report_only:
        recipe = profiles.write_workload(profile, out)
        started = time.perf_counter()
        for i, run in enumerate(runs, 1):
            print(f"[{i}/{len(runs)}] {run.name}: {run.hosts} host(s) x {run.devices_per_host} "
                  f"device(s) ({time.perf_counter() - started:.0f}s elapsed)", flush=True)
            meta = execute(run, recipe, out, args.set, steps, args.timeout_s)
            print(f"  done in {meta['wall_s']:.0f}s", flush=True)
    arm_runs, layouts = collect(runs, out, first_scored)
    traced = traced_runs(args.arms, args.hosts, args.devices_per_host, layouts) \
        if args.trace_steps else []
    if not args.report_only:
        for run in traced:
            print(f"[trace] {run.name}: {args.trace_steps} steps under the profiler", flush=True)
            window = trace_window(run, out, first_scored, args.trace_steps)
            execute(run, recipe, out, args.set, steps, args.timeout_s, window)
            (out / "runs" / run.name / "fixed_cost.json").write_text(
                json.dumps(trace.summarize(window.out), indent=2) + "\n")
    fixed_cost = {(run.arm, run.hosts): json.loads(
        (out / "runs" / run.name / "fixed_cost.json").read_text()) for run in traced}
    context = {"profile": profile.name, "character": profile.character,
               "devices_per_host": args.devices_per_host, "overrides": args.set,
               "steps": steps, "batches": profiles.BATCHES, "launches": args.launches}
    if layouts:
        context["tunix_layouts"] = {_layout_key(*k): v for k, v in layouts.items()}
    if args.balance:
        context.update(_balance_context(runs, out, first_scored, max(args.hosts)))
    if args.streaming:
        context.update(_streaming_context(runs, out, first_scored))
    rep = report.build_report(arm_runs, "mcjax", first_scored,
                              ablation=args.ablation or args.balance or args.streaming,
                              context=context,
                              fixed_cost=fixed_cost)
    for path in report.write(rep, out):
        print(f"wrote {path}")
    print(report.markdown(rep))
    if "mcjax_da" in args.arms:
        write_da_report(arm_runs, first_scored, args.hosts, profile, out, args.da_grid)
    if not rep["equal_work"]["ok"]:
        sys.exit("equal work FAILED: the ratios above do not count (see report.md)")


if __name__ == "__main__":
    main()
