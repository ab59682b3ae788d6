"""Staleness k under DA: does the demo still learn with 4 batches in flight?

    python -m tunix_mcjax.bench.staleness --out bench_results/staleness/learn [--seeds 5]

Arms, each on seeds 0..N-1 (a seed fixes the prompt order and sampling, so seeds pair the arms),
the demo recipe (recipes/cpu/demo.yml) at its own step count, DA (rl_runtime=mcjax_da), the jax
engine, bfloat16 rollout weights, sampler_is=token (DA learned steadier with it than without
on docs/mismatch.md's 3 seeds), on the demo's 2 hosts x 2 devices: rl_trainer_hosts_fraction's
default 0.5 makes them 1 trainer host and 1 rollout host (DA needs a whole number of trainer
hosts and a rollout host, so 2 hosts is its smallest split):
  k1     off_policy_steps=1: the paper's DA, each batch one update stale
  k4     off_policy_steps=4: four batches in flight, each four updates stale once they fill
  k4+if  the same with in_flight_weight_updates=true and in_flight_update_iterations=1: a
         rollout host loads the next version after a batch's first decode iteration, so its
         later tokens are fresher (the demo's completions are 2 tokens: at the default 16
         iterations no version would land mid-batch, and the arm would be k4's)
  k1+mis, k4+if+mis  k1 and k4+if with rollout_rs=token beside TIS (MIS: a token whose
         trainer / rollout ratio leaves [0.5, 2] gets no policy gradient), for the late
         gradient spikes that k1 and k4+if fell back with
  k1+halflr  k1 at half the demo's learning rate (0.0015): whether k1's late falls come from
         a step too large for updates one version stale
Reported as bench.learn_arms reports an arm table: per arm, steps to --target (seed median
[95% seed bootstrap]), seeds reached, final accuracy, the demo's bar met per seed, the
staleness of the batches (and, in-flight, of the tokens) as the runs record it; each other
arm's ratio over k1 of summed steps over paired seeds. Outputs under --out:
runs/<cell>/steps.jsonl and bench_meta.json, logs/, report.json, report.md.
"""

from __future__ import annotations

from pathlib import Path

from tunix_mcjax.bench import learn_arms

BASE = "k1"
BENCH = learn_arms.Bench(
    "Learning at staleness k under DA", "mcjax_da",
    {BASE: ("off_policy_steps=1",), "k4": ("off_policy_steps=4",),
     "k4+if": ("off_policy_steps=4", "in_flight_weight_updates=true",
               "in_flight_update_iterations=1"),
     "k1+mis": ("off_policy_steps=1", "rollout_rs=token"),
     "k4+if+mis": ("off_policy_steps=4", "in_flight_weight_updates=true",
                   "in_flight_update_iterations=1", "rollout_rs=token"),
     "k1+halflr": ("off_policy_steps=1", "learning_rate=0.0015")},
    Path("bench_results/staleness/learn"))


def main(argv: list[str] | None = None) -> None:
    learn_arms.main(BENCH, __doc__, argv)


if __name__ == "__main__":
    main()
