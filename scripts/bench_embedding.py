#!/usr/bin/env python
"""Benchmarks of the sharded-embedding core, each next to a PyTorch peer run in the same job.

CPU kernels (one process, one thread by default): the fused multi-table
lookup + backward + sparse optimizer (SGD, row-wise AdaGrad, Adam) of
neocomm's compiled kernels, beside FBGEMM's CPU table-batched embedding with
the same optimizer fused (where ``fbgemm_gpu`` loads), and on request
neocomm's NumPy kernels and ``torch.nn.EmbeddingBag(sparse=True)``, timed
interleaved (median of ``--repeat`` rounds of ``--iters`` steps), with the
bytes-touched bound: the bytes a step must move at least (every id's row
read, the pooled rows written and their gradient read, every touched row and
its state read and written once) over this machine's ``np.copyto`` rate;
``--lookup`` also times the pooled lookup alone, beside FBGEMM's forward::

    python scripts/bench_embedding.py cpu --dims 16 64 128 --ids-per-bag 1 8 32 --numpy
    python scripts/bench_embedding.py cpu --ids-per-bag 32 --variable --optimizers adam
    python scripts/bench_embedding.py cpu --dims 64 128 --ids-per-bag 32 --optimizers sgd --lookup

Sharded (under mpirun): forward + backward + row-wise AdaGrad of a
table-wise collection, against the same data path written with
``torch.distributed`` (gloo AlltoAll, EmbeddingBag, sparse Adagrad)::

    mpirun -n 2 python scripts/bench_embedding.py sharded --batch 2048

The sharded throughput is global samples per second, from the median step
time over ``--iters`` steps after ``--warmup`` steps; a step is the slowest
rank's. Before timing, the first step's pooled output is checked against the
peer's on the same weights and ids. Results print as lines and, with
``--json PATH``, as JSON. PyTorch is optional: without it the peer columns
say so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _median_rate(times, samples):
    t = statistics.median(times)
    return samples / t, t


# -- CPU kernels -------------------------------------------------------------------
def _bags(rng, t_count, rows, batch, per_bag, variable):
    """Feature-major bags: per table ``batch`` bags of ``per_bag`` Zipf ids (``variable``: 0
    to ``2 * per_bag``, the same mean) -> ``(ids, offsets)``."""
    n = t_count * batch
    lengths = (rng.integers(0, 2 * per_bag + 1, n) if variable else np.full(n, per_bag))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    table_of = np.repeat(np.arange(t_count), lengths.reshape(t_count, batch).sum(1))
    ids = ((rng.zipf(1.1, int(offsets[-1])) - 1) % rows).astype(np.int64)
    return ids, offsets, table_of


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes per second ``np.copyto`` moves here (read plus written), best of 5."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def bytes_touched(ids, table_of, t_count, dim, batch, kind, itemsize=4) -> int:
    """The bytes a lookup + fused backward must move at least: every id's row read, the
    pooled rows written and their gradient read, each touched row (and its optimizer state)
    read and written once."""
    unique = sum(np.unique(ids[table_of == t]).size for t in range(t_count))
    state = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2 * dim + 2}[kind]  # elements per row
    row = dim * itemsize
    return (ids.size * row + 2 * t_count * batch * row
            + 2 * unique * (row + state * itemsize))


def _fbgemm(torch, t_count, rows, dim, kind, init):
    """FBGEMM's CPU table-batched embedding with the optimizer fused into the backward, or
    ``(None, why)`` where it does not load."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (EmbeddingLocation,
                                                                          PoolingMode)
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
    except Exception as exc:  # not installed, or built for another torch
        return None, f"fbgemm_gpu does not load: {type(exc).__name__}"
    opt = {"sgd": EmbOptimType.EXACT_SGD,
           "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}.get(kind)
    if opt is None:
        return None, f"no fused {kind} on FBGEMM's CPU kernels"
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * t_count, optimizer=opt,
        learning_rate=0.01, eps=1e-8, pooling_mode=PoolingMode.SUM)
    with torch.no_grad():
        for t, w in enumerate(tbe.split_embedding_weights()):
            w.copy_(torch.from_numpy(init[t]))
    return tbe, "ok"


def bench_cpu(args) -> list[dict]:
    """One process: neocomm's fused lookup + backward + update (compiled kernels, and the
    NumPy ones), FBGEMM's CPU kernels and ``torch.nn.EmbeddingBag``, interleaved, beside the
    bytes-touched bound."""
    from embedding.kernels import Bags, FusedTables
    from embedding.types import OptimizerConfig, OptimizerKind

    torch = _torch()
    if torch is not None:
        torch.set_num_threads(args.threads)
    bandwidth = copy_bandwidth()
    t_count, rows, batch = args.tables, args.rows, args.batch
    results = []
    for dim in args.dims:
        rng = np.random.default_rng(0)
        init = ((rng.random((t_count, rows, dim), dtype=np.float32) - 0.5) * 0.02)
        for length in args.ids_per_bag:
            ids, offsets, table_of = _bags(rng, t_count, rows, batch, length, args.variable)
            grad = rng.standard_normal((batch, t_count * dim), dtype=np.float32)
            bags = Bags(ids, offsets, tuple(range(t_count)), tuple(range(0, t_count * dim, dim)),
                        (False,) * t_count, batch, t_count * dim)
            for kind in args.optimizers:
                steps, check = {}, "no peer"
                for impl in ("compiled", "numpy") if args.numpy else ("compiled",):
                    ours = FusedTables([rows] * t_count, [dim] * t_count,
                                       OptimizerConfig(OptimizerKind(kind), lr=0.01),
                                       threads=args.threads)
                    ours.weights[:] = init.reshape(-1)

                    def step(ours=ours, impl=impl):
                        os.environ["NEOCOMM_EMBEDDING_KERNELS"] = impl
                        ours.lookup(bags)
                        ours.backward_update(bags, grad)
                    steps[f"neocomm {impl}"] = step
                    if args.lookup and impl == "compiled":
                        def lookup(ours=ours):
                            os.environ["NEOCOMM_EMBEDDING_KERNELS"] = "compiled"
                            ours.lookup(bags)
                        steps["neocomm lookup"] = lookup
                if torch is not None:
                    t_ids, t_off = torch.from_numpy(ids), torch.from_numpy(offsets)
                    t_grad = torch.from_numpy(grad)
                    tbe, why = _fbgemm(torch, t_count, rows, dim, kind, init)
                    if tbe is not None:
                        def fb_step(tbe=tbe):
                            tbe(t_ids, t_off).backward(t_grad)
                        steps["fbgemm"] = fb_step
                        if args.lookup:
                            def fb_forward(tbe=tbe):
                                with torch.no_grad():
                                    tbe(t_ids, t_off)
                            steps["fbgemm forward"] = fb_forward
                        with torch.no_grad():
                            ref = tbe(t_ids, t_off).numpy()
                        got = FusedTables([rows] * t_count, [dim] * t_count,
                                          OptimizerConfig(OptimizerKind(kind), lr=0.01))
                        got.weights[:] = init.reshape(-1)
                        ok = np.allclose(got.lookup(bags), ref, rtol=1e-5, atol=1e-6)
                        check = "ok" if ok else "MISMATCH"
                    else:
                        check = why
                    if args.embedding_bag:
                        steps["torch EmbeddingBag"] = _embedding_bag_step(
                            torch, init, kind, ids, offsets, t_count, batch, grad)
                times = _interleaved(steps, args)
                bound = bytes_touched(ids, table_of, t_count, dim, batch, kind) / bandwidth
                ours_t = times["neocomm compiled"]
                row = dict(bench="cpu", clock=args.clock, tables=t_count, rows=rows, dim=dim,
                           batch=batch,
                           ids_per_bag=length, variable=args.variable, optimizer=kind,
                           threads=args.threads, check=check, bound_ms=bound * 1e3,
                           copy_gb_per_s=bandwidth / 1e9,
                           ms={k: v * 1e3 for k, v in times.items()},
                           over_bound=ours_t / bound)
                if "fbgemm" in times:
                    row["vs_fbgemm"] = times["fbgemm"] / ours_t
                if "fbgemm forward" in times:
                    row["lookup_vs_fbgemm"] = times["fbgemm forward"] / times["neocomm lookup"]
                results.append(row)
                print(_cpu_line(row), flush=True)
    return results


def _embedding_bag_step(torch, init, kind, ids, offsets, t_count, batch, grad):
    """``torch.nn.EmbeddingBag(sparse=True)`` per table with torch's sparse SGD or Adagrad
    (element-wise: torch has no row-wise one)."""
    embs = [torch.nn.EmbeddingBag(init.shape[1], init.shape[2], mode="sum", sparse=True)
            for _ in range(t_count)]
    with torch.no_grad():
        for t, e in enumerate(embs):
            e.weight.copy_(torch.from_numpy(init[t]))
    params = [e.weight for e in embs]
    opt = (torch.optim.SGD(params, lr=0.01) if kind == "sgd"
           else torch.optim.Adagrad(params, lr=0.01))
    per = [(torch.from_numpy(ids[offsets[t * batch]:offsets[(t + 1) * batch]]),
            torch.from_numpy(offsets[t * batch:(t + 1) * batch] - offsets[t * batch]))
           for t in range(t_count)]
    t_grad = torch.from_numpy(grad)

    def step():
        out = torch.cat([e(i, o) for e, (i, o) in zip(embs, per)], dim=1)
        opt.zero_grad()
        out.backward(t_grad)
        opt.step()
    return step


def _interleaved(steps: dict, args) -> dict:
    """Median seconds per step of each of ``steps``: after ``--warmup`` steps each,
    ``--repeat`` rounds, each timing ``--iters`` steps of every one in turn."""
    for fn in steps.values():
        for _ in range(args.warmup):
            fn()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    per = {k: [] for k in steps}
    for _ in range(args.repeat):
        for name, fn in steps.items():
            t0 = clock()
            for _ in range(args.iters):
                fn()
            per[name].append((clock() - t0) / args.iters)
    return {k: statistics.median(v) for k, v in per.items()}


def _cpu_line(r) -> str:
    ms = "  ".join(f"{k} {v:.1f}" for k, v in r["ms"].items())
    vs = f"  compiled/FBGEMM speed {r['vs_fbgemm']:.2f}x" if "vs_fbgemm" in r else ""
    if "lookup_vs_fbgemm" in r:
        vs += f" (lookup alone {r['lookup_vs_fbgemm']:.2f}x)"
    return (f"[{r['clock']}] dim {r['dim']:>3}  ids/bag {'~' if r['variable'] else ''}{r['ids_per_bag']:<3} "
            f"{r['optimizer']:<16} ms/step: {ms}  bound {r['bound_ms']:.1f} "
            f"({r['over_bound']:.1f}x){vs}  check {r['check']}")


# -- sharded ------------------------------------------------------------------------
def bench_sharded(args) -> list[dict]:
    import neocomm
    import collectives
    from embedding.collection import ShardedEmbeddingCollection
    from embedding.jagged import KeyedJagged
    from embedding.types import (OptimizerConfig, OptimizerKind, Shard, ShardingPlan,
                                 ShardingType, TableConfig, TablePlan)

    world = neocomm.init()
    group = world.world
    size, rank = group.size, group.rank
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // world.local_size)
    t_count, rows, dim, batch, length = (args.tables, args.rows, args.dims[0], args.batch,
                                         args.ids_per_bag[0])
    opt = OptimizerConfig(OptimizerKind(args.optimizers[0]), lr=0.01)
    tables = [TableConfig(f"t{i}", rows, dim, optimizer=opt) for i in range(t_count)]
    plan = ShardingPlan(size, size, tuple(
        TablePlan(t.name, ShardingType.TABLE_WISE, (Shard(i % size, 0, rows, 0, dim),))
        for i, t in enumerate(tables)))
    coll = ShardedEmbeddingCollection(tables, plan, group, threads=args.threads,
                                      dedup=args.dedup)
    rng = np.random.default_rng(100 + rank)
    n_batches = 4
    ids = [rng.integers(0, rows, (t_count, batch * length)) for _ in range(n_batches)]
    kjts = [KeyedJagged([t.name for t in tables], x.reshape(-1),
                        np.full(t_count * batch, length, np.int64)) for x in ids]
    grad = rng.standard_normal((batch, t_count * dim), dtype=np.float32)
    step_no = [0]

    def ours_step():
        k = kjts[step_no[0] % n_batches]
        step_no[0] += 1
        coll.forward(k)
        coll.backward(grad)

    torch = _torch() if args.peer else None
    peer_rate, check = None, "no peer"
    if torch is not None:
        import torch.distributed as dist

        port = np.array([29500 + (os.getpid() % 2000)], np.int64)
        collectives.broadcast(port, root=0, group=group)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(int(port[0]))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        peer = _TorchTableWise(torch, tables, size, rank, batch, length)
        for s in coll.local_shards():
            peer.load(int(s.table[1:]), np.asarray(s.weight))
        got = coll.forward(kjts[0])
        coll.backward(np.zeros_like(got))  # zero gradient: AdaGrad leaves the rows as they were
        ref = peer.forward(ids[0]).detach().numpy()
        ok = np.allclose(got, ref, rtol=1e-5, atol=1e-6)
        ok = bool(collectives.all_reduce(np.array([0 if ok else 1], np.int64), group=group)[0]
                  == 0)
        check = "ok" if ok else "MISMATCH"
        peer_no = [0]

        def peer_step():
            x = ids[peer_no[0] % n_batches]
            peer_no[0] += 1
            peer.step(x, grad)

        peer_rate = _time_group(peer_step, args, batch * size, group, collectives)
    rate = _time_group(ours_step, args, batch * size, group, collectives)
    if rank != 0:
        return []
    return [dict(bench="sharded", sharding="table_wise", ranks=size, tables=t_count, rows=rows,
                 dim=dim, batch_per_rank=batch, ids_per_bag=length, optimizer=opt.kind.value,
                 dedup=args.dedup, threads=args.threads, samples_per_s=rate,
                 peer="torch.distributed gloo table-wise (EmbeddingBag + Adagrad)",
                 peer_samples_per_s=peer_rate, ratio=rate / peer_rate if peer_rate else None,
                 check=check)]


def _time_group(step, args, samples, group, collectives) -> float:
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.iters):
        collectives.all_reduce(np.zeros(1), group=group)  # start together
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    slowest = collectives.all_reduce(np.asarray(times), op="max", group=group)
    return _median_rate(list(slowest), samples)[0]


class _TorchTableWise:
    """Table-wise sharding written directly with torch.distributed (the peer)."""

    def __init__(self, torch, tables, size, rank, batch, length):
        self.torch, self.size, self.rank = torch, size, rank
        self.batch, self.length = batch, length
        self.t_count = len(tables)
        self.dim = tables[0].dim
        self.owned = [i for i in range(self.t_count) if i % size == rank]
        self.by_owner = [[i for i in range(self.t_count) if i % size == r] for r in range(size)]
        self.embs = {i: torch.nn.EmbeddingBag(tables[i].num_rows, self.dim, mode="sum",
                                              sparse=True) for i in self.owned}
        self.opt = torch.optim.Adagrad([e.weight for e in self.embs.values()], lr=0.01)

    def load(self, table: int, weights) -> None:
        with self.torch.no_grad():
            self.embs[table].weight.copy_(self.torch.from_numpy(weights))

    def forward(self, ids):
        torch, dist = self.torch, self.torch.distributed
        b, n, d = self.batch, self.batch * self.length, self.dim
        send = torch.from_numpy(np.concatenate([ids[self.by_owner[r]].reshape(-1)
                                                for r in range(self.size)]))
        recv = torch.empty(self.size * len(self.owned) * n, dtype=send.dtype)
        dist.all_to_all_single(recv, send, [len(o) * n for o in self.by_owner],
                               [len(self.owned) * n] * self.size)
        recv = recv.view(self.size, len(self.owned), n)
        offsets = torch.arange(0, self.size * n, self.length)
        self.pooled = torch.stack([self.embs[t](recv[:, k].reshape(-1), offsets)
                                   for k, t in enumerate(self.owned)], dim=1)  # [W*B, T_me, D]
        send_out = self.pooled.detach().reshape(-1)
        out = torch.empty(sum(b * len(o) * d for o in self.by_owner))
        dist.all_to_all_single(out, send_out, [b * len(self.owned) * d] * self.size,
                               [b * len(o) * d for o in self.by_owner])
        full = torch.empty(b, self.t_count, d)
        at = 0
        for r in range(self.size):
            k = len(self.by_owner[r])
            full[:, self.by_owner[r]] = out[at:at + b * k * d].view(b, k, d)
            at += b * k * d
        return full.view(b, self.t_count * d)

    def step(self, ids, grad) -> None:
        torch, dist = self.torch, self.torch.distributed
        b, d = self.batch, self.dim
        self.forward(ids)
        g = torch.from_numpy(grad).view(b, self.t_count, d)
        send = torch.cat([g[:, self.by_owner[r]].reshape(-1) for r in range(self.size)])
        recv = torch.empty(self.size * b * len(self.owned) * d)
        dist.all_to_all_single(recv, send, [b * len(o) * d for o in self.by_owner],
                               [b * len(self.owned) * d] * self.size)
        self.opt.zero_grad()
        self.pooled.backward(recv.view(self.size * b, len(self.owned), d))
        self.opt.step()


# -- command line ---------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("cpu", "sharded"))
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dims", type=int, nargs="+", default=[64], help="embedding dims")
    p.add_argument("--batch", type=int, default=None,
                   help="samples per step (per rank when sharded); default 4096 cpu, 2048 sharded")
    p.add_argument("--ids-per-bag", type=int, nargs="+", default=None,
                   help="ids per bag (default: 1 8 32 cpu, 1 sharded)")
    p.add_argument("--variable", action="store_true",
                   help="cpu: bags of 0 to twice --ids-per-bag ids (the same mean)")
    p.add_argument("--optimizers", nargs="+", default=None,
                   choices=("sgd", "rowwise_adagrad", "adam"),
                   help="default: sgd rowwise_adagrad (cpu), rowwise_adagrad (sharded)")
    p.add_argument("--iters", type=int, default=5, help="steps per timing")
    p.add_argument("--repeat", type=int, default=3, help="cpu: interleaved timings (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None,
                   help="kernel threads (default: 1 cpu, CPUs / ranks on this host sharded)")
    p.add_argument("--numpy", action="store_true", help="cpu: also time the NumPy kernels")
    p.add_argument("--lookup", action="store_true",
                   help="cpu: also time the pooled lookup alone (FBGEMM's forward beside it)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: time steps by the wall clock, or by the CPU time of the one "
                   "thread that runs them all (--threads 1 only; steadier on a shared host, "
                   "since time spent waiting for a core is not counted)")
    p.add_argument("--embedding-bag", action="store_true",
                   help="cpu: also time torch.nn.EmbeddingBag(sparse=True)")
    p.add_argument("--dedup", action="store_true", help="sharded: deduplicate ids")
    p.add_argument("--no-peer", dest="peer", action="store_false",
                   help="sharded: no torch.distributed peer")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    sharded = args.mode == "sharded"
    args.batch = args.batch or (2048 if sharded else 4096)
    args.ids_per_bag = args.ids_per_bag or ([1] if sharded else [1, 8, 32])
    args.optimizers = args.optimizers or (["rowwise_adagrad"] if sharded
                                          else ["sgd", "rowwise_adagrad"])
    if args.threads is None:
        args.threads = 1 if not sharded else None
    if args.clock == "cpu" and (sharded or args.threads != 1):
        p.error("--clock cpu: one thread runs every step only in cpu mode with --threads 1")
    if sharded:
        results = bench_sharded(args)
        for r in results:
            peer = (f"{r['peer_samples_per_s']:,.0f}" if r["peer_samples_per_s"] else "n/a")
            ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "n/a"
            what = f"sharded ids/bag={r['ids_per_bag']} {r['optimizer']} ranks={r['ranks']}"
            print(f"{what:<44} ours {r['samples_per_s']:>10,.0f} samples/s   peer {peer:>10} "
                  f"({r['peer']})   ratio {ratio}   check {r['check']}")
    else:
        results = bench_cpu(args)
    if results and args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
