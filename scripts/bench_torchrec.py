"""Sharded embedding training steps: neocomm's torch module beside TorchRec's, in one run.

    neocomm run -n 2 -- python scripts/bench_torchrec.py
    neocomm run -n 2 -- python scripts/bench_torchrec.py --tables 26 --rows 100000 --dim 16 \\
        --batch 2048 --steps 40 --shardings table_wise row_wise
    neocomm run -n 2 -- python scripts/bench_torchrec.py --ids-per-bag 1 8 32 --variable \\
        --optimizer rowwise_adagrad --dim 64

The same tables, ids and world size on both sides, CPU, torch.distributed over
gloo for TorchRec (started on neocomm's ranks by
``embedding.torch.init_process_group``): neocomm's
``ShardedEmbeddingBagCollection`` and TorchRec's ``DistributedModelParallel``
over an ``EmbeddingBagCollection`` built on the meta device, both with the
optimizer fused into the backward (SGD, or row-wise AdaGrad: TorchRec's
``RowWiseAdagrad``, FBGEMM's EXACT_ROWWISE_ADAGRAD), each table placed by the
sharding asked for; column-wise, both cut each table's columns over every
rank (TorchRec's planner keeps a table narrower than 128 columns whole unless
told, which is table-wise placement under another name). The last column
shows how the first table was cut (``2 x 100000x8``: two shards of 100,000
rows and 8 columns), and TorchRec's cut where it differs. A step is the
pooled (sum) lookup of a local batch (``--ids-per-bag`` Zipf ids per feature
and sample, as many as production multi-hot features pool; ``--variable``:
each bag 0 to twice that many, the same mean), a loss on the pooled output
and its backward with the fused update, after a warm-up of both (neocomm's past
its first second of embedding work, which runs on the NumPy kernels). Prints
samples/s of both (the slowest rank's time, median of ``--repeat`` timings of
``--steps`` steps, the two interleaved) and neocomm's over TorchRec's, and each
side's page faults per step (neocomm / TorchRec: the median over the timings, on
the rank that faulted most; both share the processes, so both run with the host
memory neocomm keeps, ``neocomm.hostmem``). A
sharding TorchRec cannot run here (row-wise on CPU) is reported as such, with
neocomm's figure alone. Needs torchrec (with fbgemm-gpu's CPU build); without
it, only neocomm's figures.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import resource
import statistics
import time

import numpy as np
import torch

import neocomm
from collectives import all_reduce
from embedding.kernels import compiled
from embedding.kernels.compiled import RENT_S
from embedding.planner import Hardware, TableConstraints, Workload, plan_sharding
from embedding.torch import ShardedEmbeddingBagCollection, init_process_group
from embedding.types import OptimizerConfig, ShardingType, TableConfig

LR = 0.01
EPS = 1e-8


def batches(args, rank: int, count: int, per_bag: int):
    """``count`` local batches ``(ids, lengths)``, feature-major: per feature ``args.batch``
    bags of ``per_bag`` Zipf ids (``args.variable``: 0 to ``2 * per_bag``)."""
    rng = np.random.default_rng(1000 + rank)
    out = []
    for _ in range(count):
        n = args.tables * args.batch
        lengths = (rng.integers(0, 2 * per_bag + 1, n) if args.variable
                   else np.full(n, per_bag)).astype(np.int64)
        ids = (rng.zipf(1.1, int(lengths.sum())) - 1) % args.rows
        out.append((ids.astype(np.int64), lengths))
    return out


def column_split(args, world) -> int:
    """The narrowest column shard both sides may cut: a table's columns split over every rank.
    (TorchRec's planner keeps tables narrower than 128 columns whole under column-wise sharding
    unless told: ``min_partition``.)"""
    return max(1, args.dim // world.size)


def shapes(sizes, replicated: bool = False) -> str:
    """``N x ROWSxCOLS`` of a table's shards (``sizes``: their ``(rows, cols)``), e.g. ``2 x
    100000x8``; ``replicated``: every rank holds the whole table."""
    if len(set(sizes)) == 1:
        if replicated:
            return f"{len(sizes)} x {sizes[0][0]}x{sizes[0][1]} replicas"
        return f"{len(sizes)} x {sizes[0][0]}x{sizes[0][1]}"
    return " + ".join(f"{r}x{c}" for r, c in sizes)


def neocomm_steps(args, world, sharding: str, data):
    """``(run, shards of the first table)``: ``run(n)`` takes ``n`` steps."""
    tables = [TableConfig(f"t{i}", args.rows, args.dim, "sum", (f"f{i}",),
                          optimizer=OptimizerConfig(args.optimizer, lr=LR, eps=EPS))
              for i in range(args.tables)]
    only = {t.name: TableConstraints(shardings=(ShardingType(sharding),)) for t in tables}
    hw = Hardware(world.size, 1, 64 << 30, min_column_dim=column_split(args, world))
    plan = plan_sharding(tables, hw, Workload(batch_size=args.batch), constraints=only).plan
    first = plan.tables[0]
    shards = shapes([(s.num_rows, s.num_cols) for s in first.shards],
                    replicated=first.sharding is ShardingType.DATA_PARALLEL)
    ebc = ShardedEmbeddingBagCollection(tables, plan, world.world, threads=args.threads)
    keys = [f"f{i}" for i in range(args.tables)]
    from embedding.jagged import KeyedJagged

    kjts = [KeyedJagged(keys, ids, lengths) for ids, lengths in data]
    w = torch.randn(args.batch, args.tables * args.dim, generator=torch.Generator().manual_seed(1))

    def run(n: int) -> None:
        for k in range(n):
            pooled = ebc(kjts[k % len(kjts)])
            (pooled * w).sum().backward()
    return run, shards


def torchrec_steps(args, world, sharding: str, data):
    """``(run, shards of the first table)`` as :func:`neocomm_steps`; ``(None, None)`` for a
    sharding TorchRec cannot run on CPU."""
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import (EmbeddingShardingPlanner, ParameterConstraints,
                                              Topology)
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                                  feature_names=[f"f{i}"]) for i in range(args.tables)]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    if args.optimizer == "sgd":
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": LR})
    else:
        from torchrec.optim import RowWiseAdagrad
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": LR, "eps": EPS})
    sharder = EmbeddingBagCollectionSharder()
    if sharding not in sharder.sharding_types("cpu"):
        return None, None
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world.size, compute_device="cpu"),
        constraints={c.name: ParameterConstraints(sharding_types=[sharding],
                                                  min_partition=column_split(args, world))
                     for c in configs})
    plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
    first = plan.plan[""]["t0"]
    if first.sharding_spec is None:   # data-parallel: a replica on each of its ranks
        shards = shapes([(args.rows, args.dim)] * len(first.ranks), replicated=True)
    else:
        shards = shapes([tuple(m.shard_sizes) for m in first.sharding_spec.shards])
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    keys = [f"f{i}" for i in range(args.tables)]
    kjts = [KeyedJaggedTensor(keys=keys, values=torch.from_numpy(ids),
                              lengths=torch.from_numpy(lengths.astype(np.int32)))
            for ids, lengths in data]
    w = torch.randn(args.batch, args.tables * args.dim, generator=torch.Generator().manual_seed(1))

    def run(n: int) -> None:
        for k in range(n):
            out = dmp(kjts[k % len(kjts)]).to_dict()  # keys come grouped by rank: use names
            pooled = torch.cat([out[f] for f in keys], dim=1)
            (pooled * w).sum().backward()
    return run, shards


def timed(world, run, steps: int) -> tuple[float, float]:
    """``(seconds, faults)``: seconds of ``steps`` steps on the slowest rank, and the page
    faults per step of the rank that faulted most (minor faults: fresh memory touched)."""
    world.world.comm.Barrier()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    run(steps)
    took = time.perf_counter() - t0
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps
    worst = all_reduce(np.array([took, faults]), op="max")
    return float(worst[0]), float(worst[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2048, help="samples per rank and step")
    ap.add_argument("--steps", type=int, default=40, help="steps per timing")
    ap.add_argument("--repeat", type=int, default=3, help="timings (the median reported)")
    ap.add_argument("--ids-per-bag", type=int, nargs="+", default=[1],
                    help="ids per bag (multi-hot features pool several)")
    ap.add_argument("--variable", action="store_true",
                    help="bags of 0 to twice --ids-per-bag ids (the same mean)")
    ap.add_argument("--optimizer", choices=("sgd", "rowwise_adagrad"), default="sgd")
    ap.add_argument("--threads", type=int, default=1,
                    help="neocomm's kernel threads per rank (TorchRec's: torch's, set to 1)")
    ap.add_argument("--shardings", nargs="+",
                    default=["table_wise", "row_wise", "column_wise", "data_parallel"],
                    choices=[s.value for s in ShardingType])
    args = ap.parse_args(argv)
    world = neocomm.init()
    have_torchrec = importlib.util.find_spec("torchrec") is not None
    if have_torchrec:
        init_process_group("gloo")
    torch.set_num_threads(1)
    rows = []
    warm_until = None
    served = set()
    for per_bag in args.ids_per_bag:
        data = batches(args, world.rank, 8, per_bag)
        for sharding in args.shardings:
            ours, our_shards = neocomm_steps(args, world, sharding, data)
            theirs, their_shards = (torchrec_steps(args, world, sharding, data)
                                    if have_torchrec else (None, None))
            ours(2)
            # a process's first second of embedding work, counted from its first call, runs
            # on the NumPy kernels, then the compiled ones load (embedding.kernels.compiled.
            # RENT_S): wait that second out and warm those up too, so that every timing is of
            # the steady state
            if warm_until is None:
                warm_until = time.monotonic() + RENT_S
            time.sleep(max(0.0, warm_until - time.monotonic()))
            ours(2)
            if theirs is not None:
                theirs(2)
            # which CPU kernels the timings below run (float32 tables)
            served.add("compiled" if compiled.kernels(np.float32) is not None else "NumPy")
            times = {"neocomm": [], "torchrec": []}
            faults = {"neocomm": [], "torchrec": []}
            for _ in range(args.repeat):
                for side, run in (("neocomm", ours), ("torchrec", theirs)):
                    if run is not None:
                        took, faulted = timed(world, run, args.steps)
                        times[side].append(took)
                        faults[side].append(faulted)
            samples = args.steps * args.batch * world.size
            rate = {k: samples / statistics.median(v) for k, v in times.items() if v}
            fault = {k: statistics.median(v) for k, v in faults.items() if v}
            rows.append((per_bag, sharding, rate.get("neocomm"), rate.get("torchrec"),
                         our_shards if their_shards in (None, our_shards)
                         else f"{our_shards} (TorchRec: {their_shards})",
                         fault.get("neocomm"), fault.get("torchrec")))
            # free both models before the next configuration builds its own: their modules
            # hold reference cycles, which Python's collector frees only when it runs (at
            # dim 128 a run of nine configurations otherwise held 13 GB on a rank)
            del ours, theirs
            gc.collect()
    if world.rank == 0:
        per = "/".join(str(n) for n in args.ids_per_bag)
        bags = f"0 to 2x {per}" if args.variable else per
        print(f"# {args.tables} tables x {args.rows:,} rows x dim {args.dim}, {args.batch} "
              f"samples per rank, {world.size} ranks, fused {args.optimizer}, {bags} Zipf ids "
              f"per bag, {args.threads} kernel thread(s); samples/s (median of {args.repeat} "
              f"x {args.steps} steps); neocomm's CPU kernels: {' and '.join(sorted(served))}")
        print(f"{'ids/bag':>7} {'sharding':<20} {'neocomm':>12} {'torchrec':>12} {'ratio':>7} "
              f"{'faults/step':>13}  shards of a table")
        for per_bag, sharding, ours, theirs, shards, our_f, their_f in rows:
            if theirs is None:
                why = "not available on CPU" if have_torchrec else "torchrec not installed"
                print(f"{per_bag:>7} {sharding:<20} {ours:>12,.0f} {why:>20} {our_f:>13,.0f}  "
                      f"{shards}")
            else:
                both = f"{our_f:,.0f} / {their_f:,.0f}"
                print(f"{per_bag:>7} {sharding:<20} {ours:>12,.0f} {theirs:>12,.0f} "
                      f"{ours / theirs:>6.2f}x {both:>13}  {shards}")
    if have_torchrec:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
