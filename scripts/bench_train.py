#!/usr/bin/env python3
"""Throughput of the DLRM trainer: the full step, the embedding part alone, overlap on vs off.

    neocomm run -n 2 -- python scripts/bench_train.py
    neocomm run -n 2 -- python scripts/bench_train.py --tables 26 --rows 100000 --dim 64 \\
        --local-batch 2048 --steps 20 --json bench.json

Every rank builds the trainer of ``neocomm train`` (tables of ``--rows`` x
``--dim``, ``--ids-per-bag`` ids per bag, the planner's plan, a small dense
model) over an
in-memory pool of synthetic batches (so the synthetic generator's hashing is
not what is measured; a memory-mapped binary file reads about as fast), then
measures, after warm-up steps, in one run:

* the full training step with overlap on and with overlap off (alternating
  rounds, so both see the same machine load), global samples/s and the
  share of each phase (rank 0's clocks; see embedding.train.types.Phase);
* the embedding part alone: input dist, lookup, output dist and the
  backward with the fused sparse optimizer, fed a constant gradient, with
  the next batch's input dist overlapped the same way.

Ratios are against peers measured in the same run: overlap on over off,
and the embedding part alone over the full step. Rank 0's embedding kernel
calls and collective calls per step (``ShardedEmbeddingCollection.take_calls``)
are counted over the measured full steps; ``--pack`` lets the planner pack the
tables (``[plan] pack``), so packed and unpacked runs can be compared.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=26, help="embedding tables (default 26)")
    p.add_argument("--rows", type=int, default=100_000, help="rows per table (default 100000)")
    p.add_argument("--rows-range", default=None, metavar="LO:HI",
                   help="table rows spread geometrically from LO to HI over the tables, "
                   "instead of --rows for all")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--ids-per-bag", type=int, default=1,
                   help="ids per feature and sample (multi-hot bags: the synthetic id and "
                   "Zipf ids beside it; default 1)")
    p.add_argument("--local-batch", type=int, default=2048,
                   help="samples per rank per step (default 2048)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per round")
    p.add_argument("--rounds", type=int, default=6,
                   help="rounds of (overlap on, overlap off, embedding alone), interleaved so "
                   "that each sees the same machine load")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    p.add_argument("--pool", type=int, default=6, help="global batches in the memory pool")
    p.add_argument("--threads", type=int, default=0, help="threads per rank (0: cores/ranks)")
    p.add_argument("--plan", default="planner", metavar="planner|SHARDING|FILE",
                   help="the planner's plan (default), the planner's plan with one sharding "
                   "type only (table_wise, row_wise, column_wise, data_parallel ...), or a "
                   "plan file")
    p.add_argument("--bottom", default="128", help="hidden widths of the bottom MLP, "
                   "comma-separated (the embedding dimension is appended; default 128)")
    p.add_argument("--top", default="128", help="hidden widths of the top MLP, comma-separated "
                   "(the logit is appended; default 128)")
    p.add_argument("--bucket-kib", type=int, default=1024,
                   help="dense gradient bucket size, KiB (default 1024, as train.bucket_kib)")
    p.add_argument("--optimizer", default="rowwise_adagrad",
                   choices=["sgd", "rowwise_adagrad", "adam"],
                   help="sparse optimizer of the fused backward (default rowwise_adagrad)")
    p.add_argument("--dedup", action="store_true",
                   help="send each distinct id of a feature once (train.dedup)")
    p.add_argument("--pack", action="store_true",
                   help="pack tables of at most --pack-rows rows into one table per kind")
    p.add_argument("--pack-rows", type=int, default=None,
                   help="largest table packed, rows (default: [plan] pack_rows' default)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)


def table_rows(args) -> list[int]:
    """Rows of each table: ``--rows`` each, or ``--rows-range LO:HI`` spread geometrically."""
    if not args.rows_range:
        return [args.rows] * args.tables
    try:
        lo, hi = (int(x) for x in args.rows_range.split(":"))
    except ValueError:
        raise SystemExit(f"bench_train.py: --rows-range: expected LO:HI, got "
                         f"{args.rows_range!r}") from None
    if not 1 <= lo <= hi:
        raise SystemExit(f"bench_train.py: --rows-range: expected 1 <= LO <= HI, got "
                         f"{args.rows_range!r}")
    return [int(x) for x in np.geomspace(lo, hi, args.tables).round()]


def build(args, world):
    from embedding.data import SyntheticConfig, SyntheticDataset
    from embedding.train import Trainer, parse_config
    from embedding.train.data import MemoryDataset, TrainData, WindowDataset

    gb = args.local_batch * world.size
    rows = table_rows(args)
    doc = {"tables": {"rows": rows},
           "model": {"embedding_dim": args.dim,
                     "bottom_mlp": [int(x) for x in args.bottom.split(",") if x] + [args.dim],
                     "top_mlp": [int(x) for x in args.top.split(",") if x] + [1]},
           "train": {"steps": 10 ** 9, "batch_size": gb, "eval_every": 0,
                     "threads": args.threads, "dedup": args.dedup,
                     "bucket_kib": args.bucket_kib},
           "sparse_optimizer": {"kind": args.optimizer, "lr": 0.05},
           "data": {"records": gb * args.pool, "eval_records": gb},
           "output": {"dir": "neocomm-out/bench"}}
    from embedding.types import ShardingType

    if args.plan in [t.value for t in ShardingType]:
        doc["plan"] = {"shardings": [args.plan]}  # the planner places them
    elif args.plan != "planner":
        doc["plan"] = {"file": args.plan}
    if args.pack:
        doc.setdefault("plan", {})["pack"] = True
        if args.pack_rows:
            doc["plan"]["pack_rows"] = args.pack_rows
    cfg = parse_config(doc, "bench_train.py")
    syn = SyntheticConfig(table_sizes=tuple(rows), seed=0)
    full = SyntheticDataset(syn, gb * (args.pool + 1))
    # Each rank keeps only what it reads: its slice of every pooled global batch.
    lb, r = args.local_batch, world.rank
    keep = [full.read(i * gb + r * lb, i * gb + (r + 1) * lb) for i in range(args.pool + 1)]
    dense = np.zeros((gb * (args.pool + 1), syn.num_dense), np.float32)
    labels = np.zeros(gb * (args.pool + 1), np.float32)
    ids = np.zeros((gb * (args.pool + 1), args.tables, args.ids_per_bag), np.int64)
    extra = np.random.default_rng(r)
    for i, b in enumerate(keep):
        a = i * gb + r * lb
        dense[a:a + lb], labels[a:a + lb] = b.dense, b.labels
        ids[a:a + lb, :, 0] = np.stack(b.values, axis=1)
        if args.ids_per_bag > 1:  # the rest of each bag: Zipf ids of the same table
            more = extra.zipf(1.1, (lb, args.tables, args.ids_per_bag - 1)) - 1
            ids[a:a + lb, :, 1:] = more % np.asarray(rows)[None, :, None]
    if args.ids_per_bag == 1:
        ids = ids[:, :, 0]
    mem = MemoryDataset(dense, labels, ids, syn.feature_names)
    data = TrainData(WindowDataset(mem, 0, gb * args.pool),
                     WindowDataset(mem, gb * args.pool, gb * (args.pool + 1)),
                     syn.table_sizes, tuple(syn.feature_names), syn.num_dense)
    return Trainer(cfg, world.world, data=data, stream=open("/dev/null", "w"))


def full_steps(trainer, steps: int, overlap: bool) -> tuple[float, dict]:
    from embedding.train.types import Phase

    trainer.set_overlap(overlap)
    trainer.run(1, horizon=trainer.step + steps + 1)  # settle the pipeline in this mode
    trainer.timer.reset()
    trainer.coll.take_calls()
    trainer.group.comm.Barrier()
    t0 = time.perf_counter()
    trainer.run(steps, horizon=trainer.step + steps + 1)
    seconds = time.perf_counter() - t0
    phases = trainer.timer.reset()
    calls = {k: v / steps for k, v in trainer.coll.take_calls().items()}
    return seconds, {p.value: phases[p] / steps for p in Phase}, calls


def embedding_steps(trainer, steps: int) -> tuple[float, dict]:
    """Input dist, lookup, output dist, backward + sparse optimizer; next input dist overlapped."""
    from embedding.train.data import GuardedDataset
    from embedding.train.setup import make_reader
    from embedding.train.step import PhaseTimer
    from embedding.train.types import Phase

    data, cfg = trainer.data, trainer.cfg
    guard = GuardedDataset(data.train, data.num_dense, data.feature_names)
    reader = make_reader(guard, cfg.train.batch_size, trainer.group, broadcast=False,
                         shuffle=False, seed=0, feature_names=data.feature_names)
    timer = PhaseTimer()
    stages = trainer.stages
    grad = None

    def start():
        prep = trainer.prepare(reader, guard, 0, timer)
        return stages.start(prep.kjt)

    dist = start()
    t0 = 0.0
    for i in range(steps + 1):
        if i == 1:  # the first step warms up
            timer.reset()
            trainer.group.comm.Barrier()
            t0 = time.perf_counter()
        pooled, ctx = stages.forward(dist, timer)
        if grad is None:
            grad = np.full(pooled.shape, 1e-4, pooled.dtype)
        with timer(Phase.INPUT_DIST):
            pass
        dist = start()
        stages.backward(grad, ctx, timer)
    seconds = time.perf_counter() - t0
    for p in dist.pending:  # the last one read ahead
        p.wait()
    phases = timer.reset()
    return seconds, {p.value: phases[p] / steps for p in Phase}, None


def main(argv=None) -> int:
    import embedding  # noqa: F401  (its NEOCOMM_* settings known before init checks them)
    import neocomm

    args = parse(argv)
    world = neocomm.init()
    trainer = build(args, world)
    gb = trainer.cfg.train.batch_size
    # every rank loads the kernels it will run now (by default a process's first second of
    # embedding work runs the NumPy kernels, embedding.kernels.compiled.RENT_S): the timings
    # are of the steady state on every rank, and the header names what each rank ran
    from embedding.kernels.compiled import info

    kernels = "/".join(sorted(set(world.world.comm.allgather(info()[1].split(" ")[0]))))
    if world.rank == 0:
        plan = ", ".join(f"{k} x{len(v)}" for k, v in trainer.describe_plan().items())
        packs = trainer.plan.packs
        if packs:
            plan += f" ({sum(len(p.members) for p in packs)} tables packed into {len(packs)})"
        rows = (f"{args.rows_range.replace(':', '-')} rows (geometric, "
                f"{sum(table_rows(args)):,} in all)" if args.rows_range else f"{args.rows} rows")
        print(f"bench_train: {world.size} rank(s), {args.tables} tables x {rows} x "
              f"dim {args.dim} (float32), {args.local_batch} samples per rank per step "
              f"(global {gb}), {args.ids_per_bag} id(s) per bag, {kernels} kernels, dense {list(trainer.cfg.model.bottom_mlp)} / "
              f"{list(trainer.cfg.model.top_mlp)} ({trainer.model.buffers.numel:,} parameters "
              f"in {len(trainer.model.buckets)} gradient bucket(s)); plan: {plan}; "
              f"{trainer.threads} thread(s) per rank", flush=True)
    trainer.run(args.warmup, horizon=trainer.step + args.warmup + 1)
    runs = {"overlap_on": [], "overlap_off": [], "embedding_only": []}
    for _ in range(args.rounds):
        runs["overlap_on"].append(full_steps(trainer, args.steps, True))
        runs["overlap_off"].append(full_steps(trainer, args.steps, False))
        runs["embedding_only"].append(embedding_steps(trainer, args.steps))
    trainer.close()
    result = {"world_size": world.size, "tables": args.tables, "rows": table_rows(args),
              "dim": args.dim, "ids_per_bag": args.ids_per_bag,
              "local_batch": args.local_batch, "global_batch": gb,
              "steps": args.steps, "rounds": args.rounds, "threads": trainer.threads,
              "plan": trainer.describe_plan()}
    calls = [c for s, ph, c in runs["overlap_on"] + runs["overlap_off"]]
    result["emb_calls_per_step"] = {k: sum(c[k] for c in calls) / len(calls) for k in calls[0]}
    result["packs"] = [{"name": p.name, "members": len(p.members)} for p in trainer.plan.packs]
    for name, rs in runs.items():
        seconds = sum(s for s, _, _ in rs)
        steps = args.steps * len(rs)
        phases = {k: sum(ph[k] for _, ph, _ in rs) / len(rs) for k in rs[0][1]}
        rates = sorted(gb * args.steps / s for s, _, _ in rs)
        result[name] = {"samples_per_s": gb * steps / seconds, "step_ms": 1e3 * seconds / steps,
                        "round_min": rates[0], "round_median": rates[len(rates) // 2],
                        "round_max": rates[-1],
                        "phases_ms": {k: 1e3 * v for k, v in phases.items() if v > 0}}
    on, off, emb = (result[k]["samples_per_s"] for k in ("overlap_on", "overlap_off",
                                                         "embedding_only"))
    result["overlap_speedup"] = on / off
    result["embedding_share_of_step"] = on / emb
    if world.rank == 0:
        _print(result)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
            print(f"results written to {args.json}")
    return 0


def _print(r: dict) -> None:
    print(f"{'':<16}{'samples/s':>11}{'ms/step':>9}{'rounds: min':>13}{'median':>9}"
          f"{'max':>9}")
    for name in ("overlap_on", "overlap_off", "embedding_only"):
        x = r[name]
        print(f"{name:<16}{x['samples_per_s']:>11,.0f}{x['step_ms']:>9.1f}"
              f"{x['round_min']:>13,.0f}{x['round_median']:>9,.0f}{x['round_max']:>9,.0f}")
    print("phases (rank 0's clocks; ms per step and share of the step):")
    for name in ("overlap_on", "overlap_off", "embedding_only"):
        ph = r[name]["phases_ms"]
        total = sum(ph.values()) or 1.0
        parts = ", ".join(f"{k} {v:.1f} ({100 * v / total:.0f}%)" for k, v in ph.items())
        print(f"  {name}: {parts}")
    c = r["emb_calls_per_step"]
    print(f"embedding calls per step (rank 0): {c['kernels']:g} kernel calls, "
          f"{c['collectives']:g} collective calls")
    print(f"overlap on / off: {r['overlap_speedup']:.3f}x; the embedding part alone runs at "
          f"{r['embedding_only']['samples_per_s']:,.0f} samples/s, "
          f"{r['embedding_only']['samples_per_s'] / r['overlap_on']['samples_per_s']:.2f}x the "
          f"full step's rate")


if __name__ == "__main__":
    sys.exit(main())
