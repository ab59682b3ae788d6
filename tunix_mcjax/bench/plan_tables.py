"""The planner's tables for the docs: Qwen3-0.6B to 8B on the paper's TPU v7x slices, and the
cells of the paper's Table 3 (Qwen3-0.6B).

    python -m tunix_mcjax.bench.plan_tables > bench_results/plan_tables.md

Workloads are the paper's profiles (`bench.profiles`, Table 1) with the model swapped; a v7x
chip is two JAX devices of 94.7 GiB, four chips a host. Pure arithmetic, no device.
"""

from __future__ import annotations

from tunix_mcjax import plan
from tunix_mcjax.bench.profiles import PROFILES
from tunix_mcjax.config import Config, load_config

V7X_DEVICE_BYTES = int(94.7 * plan.GIB)
MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b")
# The paper's Table 3: chips per profile (SWE at 8 chips did not fit the paper's trainer).
TABLE3_CHIPS = {"gsm8k": (8, 16, 32, 64), "numina": (8, 16, 32, 64), "swe": (8, 16, 32, 64)}


def v7x(chips: int) -> plan.Cluster:
    """`chips` v7x chips: hosts of four chips, each chip two devices."""
    return plan.Cluster(hosts=chips // 4, devices_per_host=8, device_bytes=V7X_DEVICE_BYTES)


def profile_config(name: str, **overrides) -> Config:
    keys = PROFILES[name].recipe("unused.jsonl")
    for key in ("hf_train_files", "dataset_name", "data_repeat_period"):
        keys.pop(key)
    return load_config(None, {**keys, **overrides})


def gib(n: int) -> str:
    return f"{n / plan.GIB:.1f}"


def row(cfg: Config, cluster: plan.Cluster) -> list[str]:
    mc = plan.model_config_for(cfg)
    whole = plan.plan(cfg, cluster, mc)
    split = plan.plan(cfg.replace(train_micro_batch_size=1), cluster, mc)
    best = plan.largest_micro_batch_that_fits(cfg, cluster, mc)
    state = whole.items["params"] + whole.items["optimizer state"] \
        + whole.items["engine weights"]
    return [gib(state), "yes" if whole.layout.gather_once else "no",
            gib(whole.phases["train"]), gib(split.phases["train"]),
            gib(whole.phases["generate"]), "-" if best is None else str(best)]


HEADER = ("| {first} | state | gather once | train, no accumulation | train, micro-batch 1 "
          "| generate | largest micro-batch that fits |\n|---|---|---|---|---|---|---|")


TABLE3_HEADER = ("| profile | chips | generate | train | publish | KV page pool, pages (GiB) "
                 "| pages a step needs | preempts | activations | fits "
                 "| peak with remat_policy=full |\n|---|---|---|---|---|---|---|---|---|---|---|")


def table3_row(name: str, chips: int) -> str:
    """One Table 3 cell at default keys and `train_micro_batch_size=1`: the phases, the pool
    against a step's pages, the saved activations, and the peak with remat as a what-if."""
    cfg = profile_config(name, train_micro_batch_size=1)
    mc = plan.model_config_for(cfg)
    p = plan.plan(cfg, v7x(chips), mc)
    remat = plan.plan(cfg.replace(remat_policy="full"), v7x(chips), mc)
    e = p.engine
    cells = [name, str(chips), *(gib(p.phases[k]) for k in ("generate", "train", "publish")),
             f"{e.pool_pages} ({gib(p.items['KV page pool'])})", str(e.step_pages),
             "yes" if p.preempts else "no", gib(p.items["activations"]),
             "yes" if p.fits else "no", f"{gib(remat.peak)} ({'fits' if remat.fits else 'no'})"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    print("Per device, GiB. state: params + Adam moments (FSDP) + the engine's weights; the "
          "KV page pool is in generate (free_kv_cache_during_weight_sync, the default).\n")
    for chips in (8, 64):
        cluster = v7x(chips)
        print(f"GSM8K profile (128 prompts x 16, 512 + 2048 tokens), {chips} v7x chips "
              f"({cluster.hosts} hosts x {cluster.devices_per_host} devices):\n")
        print(HEADER.format(first="model"))
        for model in MODELS:
            cells = row(profile_config("gsm8k", model_name=model), cluster)
            print(f"| {model} | " + " | ".join(cells) + " |")
        print()
    print("Qwen3-0.6B, the paper's three profiles, 8 v7x chips:\n")
    print(HEADER.format(first="profile"))
    for name in ("gsm8k", "numina", "swe"):
        print(f"| {name} | " + " | ".join(row(profile_config(name), v7x(8))) + " |")
    for name in ("numina", "swe"):
        cells = row(profile_config(name, rollout_max_batch_size=32), v7x(8))
        print(f"| {name}, rollout_max_batch_size=32 | " + " | ".join(cells) + " |")
    print("\nQwen3-0.6B, the cells of the paper's Table 3: default keys, train_micro_batch_size=1"
          " (per device, GiB; v7x devices of 94.7 GiB):\n")
    print(TABLE3_HEADER)
    for name, chip_counts in TABLE3_CHIPS.items():
        for chips in chip_counts:
            print(table3_row(name, chips))


if __name__ == "__main__":
    main()
