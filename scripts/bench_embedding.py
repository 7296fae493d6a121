#!/usr/bin/env python
"""Benchmarks of the sharded-embedding core, each next to a PyTorch peer run in the same job.

CPU kernels (one process): fused multi-table lookup + backward + sparse
optimizer, against ``torch.nn.EmbeddingBag(sparse=True)`` with
``torch.optim.Adagrad`` and with ``torch.optim.SparseAdam``::

    python scripts/bench_embedding.py cpu --ids-per-bag 1 8

Sharded (under mpirun): forward + backward + row-wise AdaGrad of a
table-wise collection, against the same data path written with
``torch.distributed`` (gloo AlltoAll, EmbeddingBag, sparse Adagrad)::

    mpirun -n 2 python scripts/bench_embedding.py sharded --batch 2048

Throughput is samples per second (global for the sharded run), from the
median step time over ``--iters`` steps after ``--warmup`` steps; a step
that is the slowest rank's. Before timing, the first step's pooled output
is checked against the peer's on the same weights and ids. Results print as
a table and, with ``--json PATH``, as JSON. PyTorch is optional: without it
the peer columns say so.
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
def bench_cpu(args) -> list[dict]:
    from embedding.kernels import Bags, FusedTables
    from embedding.types import OptimizerConfig, OptimizerKind

    torch = _torch()
    t_count, rows, dim, batch = args.tables, args.rows, args.dim, args.batch
    rng = np.random.default_rng(0)
    init = (rng.random((t_count, rows, dim), dtype=np.float32) - 0.5) * 0.02
    results = []
    for length in args.ids_per_bag:
        ids = rng.integers(0, rows, (t_count, batch * length))
        offsets = np.arange(0, t_count * batch * length + 1, length, dtype=np.int64)
        grad = rng.standard_normal((batch, t_count * dim), dtype=np.float32)
        bags = Bags(ids.reshape(-1), offsets, tuple(range(t_count)),
                    tuple(range(0, t_count * dim, dim)), (False,) * t_count, batch,
                    t_count * dim)
        for kind, peer in ((OptimizerKind.ROWWISE_ADAGRAD, "Adagrad"),
                           (OptimizerKind.ADAM, "SparseAdam")):
            if peer not in args.peers:
                continue
            ours = FusedTables([rows] * t_count, [dim] * t_count,
                               OptimizerConfig(kind, lr=0.01), threads=args.threads)
            ours.weights[:] = init.reshape(-1)

            def ours_step():
                ours.lookup(bags)
                ours.backward_update(bags, grad)

            check = "no peer"
            peer_rate = None
            if torch is not None:
                embs = [torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
                        for _ in range(t_count)]
                with torch.no_grad():
                    for t, e in enumerate(embs):
                        e.weight.copy_(torch.from_numpy(init[t]))
                params = [e.weight for e in embs]
                opt = (torch.optim.Adagrad(params, lr=0.01) if peer == "Adagrad"
                       else torch.optim.SparseAdam(params, lr=0.01))
                t_ids = [torch.from_numpy(ids[t]) for t in range(t_count)]
                t_off = torch.arange(0, batch * length, length)
                t_grad = torch.from_numpy(grad)

                def torch_step():
                    out = torch.cat([e(i, t_off) for e, i in zip(embs, t_ids)], dim=1)
                    opt.zero_grad()
                    out.backward(t_grad)
                    opt.step()
                    return out

                with torch.no_grad():
                    ref = torch.cat([e(i, t_off) for e, i in zip(embs, t_ids)], dim=1).numpy()
                got = ours.lookup(bags)
                ok = np.allclose(got, ref, rtol=1e-5, atol=1e-6)
                check = "ok" if ok else f"MISMATCH (max {np.abs(got - ref).max():.3g})"
                peer_rate = _time(torch_step, args, batch)
            rate = _time(ours_step, args, batch)
            results.append(dict(bench="cpu", tables=t_count, rows=rows, dim=dim, batch=batch,
                                ids_per_bag=length, optimizer=kind.value, threads=args.threads,
                                samples_per_s=rate, peer=f"torch EmbeddingBag + {peer}",
                                peer_threads=torch.get_num_threads() if torch else None,
                                peer_samples_per_s=peer_rate,
                                ratio=rate / peer_rate if peer_rate else None, check=check))
    return results


def _time(step, args, samples) -> float:
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return _median_rate(times, samples)[0]


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
    t_count, rows, dim, batch, length = (args.tables, args.rows, args.dim, args.batch,
                                         args.ids_per_bag[0])
    opt = OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.01)
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

    torch = _torch() if args.peers else None
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
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=None,
                   help="samples per step (per rank when sharded); default 4096 cpu, 2048 sharded")
    p.add_argument("--ids-per-bag", type=int, nargs="+", default=None,
                   help="default: 1 8 (cpu), 1 (sharded)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="threads of the NumPy kernels (default: CPUs / ranks on this host)")
    p.add_argument("--dedup", action="store_true", help="sharded: deduplicate ids")
    p.add_argument("--peers", nargs="*", default=["Adagrad", "SparseAdam"],
                   help="cpu: torch optimizers to compare with (none: no peer)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    sharded = args.mode == "sharded"
    args.batch = args.batch or (2048 if sharded else 4096)
    args.ids_per_bag = args.ids_per_bag or ([1] if sharded else [1, 8])
    if args.threads is None and not sharded:
        args.threads = os.cpu_count() or 1
    results = bench_sharded(args) if sharded else bench_cpu(args)
    if results:
        for r in results:
            peer = (f"{r['peer_samples_per_s']:,.0f}" if r["peer_samples_per_s"] else "n/a")
            ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "n/a"
            what = (f"{r['bench']} ids/bag={r['ids_per_bag']} {r['optimizer']}"
                    + (f" ranks={r['ranks']}" if sharded else ""))
            print(f"{what:<44} ours {r['samples_per_s']:>10,.0f} samples/s   peer {peer:>10} "
                  f"({r['peer']})   ratio {ratio}   check {r['check']}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
