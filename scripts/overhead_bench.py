"""Per-call overhead of neocomm's default path beside the raw mpi4py call, small messages.

    neocomm run -n 2 -- python scripts/overhead_bench.py [--bytes 256] [--iters 20000]

Each row times one way of calling a collective — repeated on the same buffers,
``async_op=True`` then ``wait()``, new buffers every call, no ``recvbuf``,
AlltoAllv with and without receive counts, OneToMany, ManyToMany, and calls
inside a step every rank agreed already (``collectives.control.StepControl``) — as the
mean of ``--iters`` calls between barriers (the slowest rank's), beside the
mpi4py call a user of MPI would make for the same exchange, measured in the
same run; ``overhead`` is the difference. Argument checks and agreement are on,
as a user's call runs. Rows are interleaved over ``--rounds`` rounds; the median
is printed.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np

from topology.sizes import size_arg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bytes", type=size_arg, default=256,
                    help="message size per rank (float32), a size such as 256 or 4K")
    ap.add_argument("--iters", type=int, default=20000, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (median reported)")
    args = ap.parse_args(argv)

    import neocomm
    import collectives as C
    from collectives.control import StepControl
    from mpi4py import MPI

    world = neocomm.init()
    comm, p, r = world.comm, world.size, world.rank
    n = max(p, args.bytes // 4 // p * p)
    a = np.arange(n, dtype=np.float32) + r
    b = np.empty_like(a)
    block = n // p
    c = np.full(p, block, np.int64)
    d = [int(x) for x in np.arange(p) * block]
    F = MPI.FLOAT
    others = [q for q in range(p) if q != 0]
    part = np.empty(block, np.float32)
    o2m_counts = [block] * len(others)
    o2m_send = np.arange(block * len(others), dtype=np.float32)
    right, left = (r + 1) % p, (r - 1) % p
    m2m_sc, m2m_sd = [0] * p, [0] * p
    m2m_rc, m2m_rd = [0] * p, [0] * p
    m2m_sc[right], m2m_rc[left] = block, block
    nb = np.empty(block, np.float32)
    o2m_sc, o2m_sd = [0] * p, [0] * p
    for i, q in enumerate(others):
        o2m_sc[q], o2m_sd[q] = block, i * block

    rows = [
        ("all_to_all, repeated", lambda: comm.Alltoall([a, F], [b, F]),
         lambda: C.all_to_all(a, b)),
        ("all_to_all, async_op=True", lambda: comm.Ialltoall([a, F], [b, F]).Wait(),
         lambda: C.all_to_all(a, b, async_op=True).wait()),
        ("all_to_all, no recvbuf", lambda: comm.Alltoall([a, F], [np.empty_like(a), F]),
         lambda: C.all_to_all(a)),
        ("all_to_all, new buffers", lambda: comm.Alltoall([a.copy(), F], [np.empty_like(a), F]),
         lambda: C.all_to_all(a.copy(), np.empty_like(a))),
        ("all_reduce, repeated", lambda: comm.Allreduce([a, F], [b, F], MPI.SUM),
         lambda: C.all_reduce(a, b)),
        ("all_reduce, async_op=True", lambda: comm.Iallreduce([a, F], [b, F], MPI.SUM).Wait(),
         lambda: C.all_reduce(a, b, async_op=True).wait()),
        ("all_to_all_v, both counts", lambda: comm.Alltoallv([a, c, d, F], [b, c, d, F]),
         lambda: C.all_to_all_v(a, c, b, c)),
        ("all_to_all_v, no recv counts",
         lambda: (comm.Alltoall(c, np.empty(p, np.int64)),
                  comm.Alltoallv([a, c, d, F], [np.empty_like(a), c, d, F])),
         lambda: C.all_to_all_v(a, c)),
        ("one_to_many (root 0, counts)",
         lambda: comm.Scatterv([o2m_send, o2m_sc, o2m_sd, F] if r == 0 else None,
                               [part, F] if r else [None, 0, F], 0),
         lambda: C.one_to_many(o2m_send if r == 0 else None, part if r else None, root=0,
                               ranks=others, counts=o2m_counts)),
        ("many_to_many (to the right)",
         lambda: comm.Alltoallv([a[:block], m2m_sc, m2m_sd, F], [nb, m2m_rc, m2m_rd, F]),
         lambda: C.many_to_many(a[:block], [right], [block], recv_peers=[left],
                                recv_counts=[block], recvbuf=nb)),
    ]
    # The same calls inside a step every rank agreed already (StepControl): no
    # per-call agreement.
    steps = {"all_to_all, in an agreed step": "all_to_all, repeated",
             "all_reduce, in an agreed step": "all_reduce, repeated",
             "all_to_all, async, agreed step": "all_to_all, async_op=True"}
    by_name = {name: (raw, ours) for name, raw, ours in rows}
    rows += [(name, *by_name[of]) for name, of in steps.items()]
    control = StepControl(None, "benchmark step")
    with control.step(calls=1):  # the first step of a shape is checked; the next trusted
        pass

    def timed(fn, agreed: bool = False) -> float:
        scope = control.step(calls=1) if agreed else contextlib.nullcontext()
        with scope:
            for _ in range(min(200, args.iters)):
                fn()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            dt = (time.perf_counter() - t0) / args.iters
        return comm.allreduce(dt, op=MPI.MAX) * 1e6

    results = {name: ([], []) for name, _, _ in rows}
    for _ in range(args.rounds):
        for name, raw, ours in rows:
            results[name][0].append(timed(raw))
            results[name][1].append(timed(ours, name in steps))
    if r == 0:
        print(f"# per-call time, {p} ranks, {n * 4} bytes per rank, median of {args.rounds} "
              f"rounds of {args.iters} calls (us)")
        print(f"# {'call':32s} {'mpi4py':>8s} {'neocomm':>8s} {'overhead':>9s} {'ratio':>6s}")
        for name, (raw, ours) in results.items():
            t_raw, t_ours = statistics.median(raw), statistics.median(ours)
            print(f"  {name:32s} {t_raw:8.2f} {t_ours:8.2f} {t_ours - t_raw:+9.2f} "
                  f"{t_raw / t_ours:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
