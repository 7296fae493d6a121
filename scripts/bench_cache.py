#!/usr/bin/env python
"""Step throughput of host-resident tables against the device cache's size, beside device tables.

One process: the local lookup + fused backward + row-wise AdaGrad of
``--tables`` tables (``--rows`` × ``--dim``), batch ``--batch`` with
``--ids-per-bag`` ids per bag, for ids drawn Zipf(1.05), Zipf(1.2) (hot rows
scattered over the table) and uniform. Each distribution runs with every
table in device memory (the reference, measured in the same run) and cached
with a device cache of each ``--cache`` share of the rows (``100`` holds the
whole table: only the bookkeeping is left). As in the trainer, the rows of
batch i+1 are prefetched before the update of batch i. Throughput is samples
per second from the median step over ``--iters`` steps after ``--warmup``.
``hit rate`` counts every id looked up (a hot row read 100 times in a step
counts 100 times); ``planner`` is the hit rate the planner's cost model
assumes for this cache (:mod:`embedding.planner.tiers`); ``row hits`` counts
each step's distinct rows once::

    python scripts/bench_cache.py --plot cache.png --json cache.json

On a machine without a GPU, ``device`` and host memory are the same memory:
the ratio measures what placing rows, copying them and writing them back
costs, not a PCIe transfer. TorchRec/FBGEMM's UVM caching
(``EmbeddingLocation.MANAGED_CACHING``) needs CUDA; its column says so when
there is none.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

DISTS = ("zipf1.05", "zipf1.2", "uniform")


def draw(rng, dist: str, rows: int, n: int, perm: np.ndarray) -> np.ndarray:
    """``n`` ids in ``[0, rows)``: uniform, or Zipf over ranks mapped through ``perm``."""
    if dist == "uniform":
        return rng.integers(0, rows, n)
    s = float(dist[4:])
    w = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** s
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    rank = np.minimum(np.searchsorted(cdf, rng.random(n)), rows - 1)
    return perm[rank]


def batches(args, dist: str, count: int, seed: int = 0):
    from embedding.kernels import Bags

    rng = np.random.default_rng(seed)
    perms = [rng.permutation(args.rows) for _ in range(args.tables)]
    b, length, t_count = args.batch, args.ids_per_bag, args.tables
    offsets = np.arange(0, t_count * b * length + 1, length, dtype=np.int64)
    out = []
    for _ in range(count):
        ids = np.concatenate([draw(rng, dist, args.rows, b * length, perms[t])
                              for t in range(t_count)])
        out.append(Bags(ids, offsets, tuple(range(t_count)),
                        tuple(t * args.dim for t in range(t_count)), (False,) * t_count, b,
                        t_count * args.dim))
    return out


def run(store, bags: list, args) -> tuple[float, object]:
    """Median step time (seconds) and the cache counters of the timed steps."""
    grad = np.full((args.batch, args.tables * args.dim), 1e-3, np.float32)
    times = []
    stats = None
    for i, cur in enumerate(bags):
        if i == args.warmup and hasattr(store, "take_stats"):
            store.take_stats()
        t0 = time.perf_counter()
        store.lookup(cur)
        if i + 1 < len(bags):
            store.prefetch(bags[i + 1])
        store.backward_update(cur, grad)
        times.append(time.perf_counter() - t0)
    if hasattr(store, "take_stats"):
        stats = store.take_stats()
    return statistics.median(times[args.warmup:]), stats


def planned_hit_rate(dist: str, cache_rows: int, rows: int) -> float:
    """The planner's hit rate for this cache: the hottest rows of Zipf ids, or the cached
    share of uniform ones."""
    if dist == "uniform":
        return cache_rows / rows
    from embedding.planner.tiers import zipf_hit_rate

    return zipf_hit_rate(cache_rows, rows, float(dist[4:]))


def fbgemm_uvm_note() -> str:
    try:
        import torch
    except ImportError:
        return "torch not installed"
    if not torch.cuda.is_available():
        return "needs CUDA (EmbeddingLocation.MANAGED_CACHING)"
    return "not run: see docs/memory-tiers.md"


def main(argv=None) -> int:
    from embedding.kernels import FusedTables
    from embedding.kernels.tiered import TieredTables
    from embedding.types import OptimizerConfig, OptimizerKind, TableMemory, Tier

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--ids-per-bag", type=int, default=4)
    p.add_argument("--cache", type=float, nargs="+", default=[1, 5, 20, 100],
                   help="cache sizes, percent of each table's rows")
    p.add_argument("--dists", nargs="+", default=list(DISTS), choices=DISTS)
    p.add_argument("--warmup", type=int, default=40, help="steps that fill the cache first")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a PNG plot here")
    args = p.parse_args(argv)
    opt = OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.01)
    rows, dims = (args.rows,) * args.tables, (args.dim,) * args.tables
    init = np.random.default_rng(1).random(args.rows * args.dim, dtype=np.float32) * 0.01
    samples = args.batch
    peer = fbgemm_uvm_note()
    results = []
    print(f"# {args.tables} tables x {args.rows} rows x dim {args.dim}, batch {args.batch}, "
          f"{args.ids_per_bag} ids per bag, row-wise AdaGrad; TorchRec/FBGEMM UVM cache: {peer}")
    print(f"{'ids':>9} {'cache':>7} {'samples/s':>12} {'vs device':>9} {'hit rate':>8} "
          f"{'planner':>7} {'row hits':>8} {'H2D MB/step':>11} {'D2H MB/step':>11}")
    for dist in args.dists:
        bags = batches(args, dist, args.warmup + args.iters)
        device = FusedTables(rows, dims, opt)
        for t in range(args.tables):
            device.weight(t).reshape(-1)[:] = init
        t_dev, _ = run(device, bags, args)
        del device
        ref = samples / t_dev
        print(f"{dist:>9} {'device':>7} {ref:12.0f} {1.0:9.2f}")
        results.append({"ids": dist, "cache_pct": None, "samples_per_s": ref, "ratio": 1.0})
        for pct in args.cache:
            cap = max(1, int(round(pct / 100 * args.rows)))
            store = TieredTables(rows, dims, opt, [TableMemory(Tier.CACHED, cap)] * args.tables)
            for t in range(args.tables):
                store.weight(t).reshape(-1)[:] = init
            t_c, st = run(store, bags, args)
            rate = samples / t_c
            mb_in = st.bytes_in / args.iters / 1e6
            mb_out = st.bytes_out / args.iters / 1e6
            model = planned_hit_rate(dist, cap, args.rows)
            print(f"{dist:>9} {pct:6g}% {rate:12.0f} {rate / ref:9.2f} {st.hit_rate:8.3f} "
                  f"{model:7.3f} {st.row_hit_rate:8.3f} {mb_in:11.2f} {mb_out:11.2f}")
            results.append({"ids": dist, "cache_pct": pct, "samples_per_s": rate,
                            "ratio": rate / ref, "hit_rate": st.hit_rate,
                            "planner_hit_rate": model, "row_hit_rate": st.row_hit_rate,
                            "h2d_mb_per_step": mb_in, "d2h_mb_per_step": mb_out})
    out = {"config": vars(args), "peer_uvm_caching": peer, "results": results}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    if args.plot:
        plot(out, args.plot)
    return 0


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for dist in dict.fromkeys(r["ids"] for r in out["results"]):
        pts = [r for r in out["results"] if r["ids"] == dist and r["cache_pct"] is not None]
        ax.plot([r["cache_pct"] for r in pts], [r["ratio"] for r in pts], marker="o",
                label=dist)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="all in device memory")
    ax.axhline(0.5, color="red", lw=0.8, ls=":", label="goal at 5 % on zipf1.2")
    ax.set_xscale("log")
    ax.set_xlabel("device cache, % of each table's rows")
    ax.set_ylabel("throughput / all-in-device")
    ax.set_title("Cached host-resident tables (same run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
