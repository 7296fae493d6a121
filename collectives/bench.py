"""Bandwidth tests of the collectives, in the style of nccl-tests.

For every size of a sweep, every chosen algorithm runs ``warmup`` untimed
and ``iters`` timed iterations between barriers (the slowest rank's time
counts), repeated ``repeat`` times with the algorithms interleaved (the
median is reported, so that a noisy neighbour hurts every algorithm alike).
The peer, ``mpi``, is the native MPI call (``MPI_Alltoall``,
``MPI_Allreduce`` … on the group's communicator, as the MPI backend makes it
directly: :meth:`~neocomm.backends.mpi.MpiBackend.direct`), measured in the
same run. ``check`` iterations then fill the inputs with a known pattern and
count wrong output elements, summed over the ranks: elements that differ
from the exact result, or for float16 and bfloat16 reductions that differ
by more than the error bound of :mod:`neocomm.reduction` for ``p - 1``
rounding steps (:meth:`_Case.tolerance`).

With ``device=True`` (``neocomm bench --device``) the buffers are CuPy
arrays, allocated once per size, so every call runs over the device backend
(NCCL); the peer is then that backend's own collective, the ``native``
algorithm, and each timed loop synchronises the current stream before the
clock is read. Results are checked on the host (``.get()``).

Bandwidths follow nccl-tests: ``algbw = size / time``; ``busbw = algbw *
factor`` with factor ``2 (n - 1) / n`` for AllReduce, ``(n - 1) / n`` for
ReduceScatter, AllGather, AlltoAll(v) and ManyToMany, 1 for Broadcast and
OneToMany. ``size`` is the per-rank buffer nccl-tests reports (the send
buffer of AlltoAll, the input of ReduceScatter, the output of AllGather).
"""
from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

import collectives as C
from collectives.algorithms import names
from collectives.chunking import staging_pool
from collectives.simulate import bus_factor, count_of, many_to_many_peers, sweep
from collectives.types import CollectiveOp
from neocomm.errors import CollectiveArgumentError
from neocomm.reduction import error_bound
from neocomm.types import is_half
from neocomm import types
from neocomm.types import ReduceOp

__all__ = ["BenchConfig", "Row", "run_bench", "bench_algos", "bus_factor", "peer_name",
           "PEER", "DEVICE_PEER"]

#: Name of the native MPI peer in tables and JSON (host buffers).
PEER = "mpi"
#: Name of the peer on device buffers: the backend's own collective (NCCL's).
DEVICE_PEER = "native"


@dataclass
class BenchConfig:
    """One sweep: ``op`` from ``min_bytes`` to ``max_bytes`` by ``factor``."""

    op: CollectiveOp
    min_bytes: int = 1 << 16
    max_bytes: int = 1 << 26
    factor: float = 2.0
    iters: int = 20
    warmup: int = 5
    check: int = 1
    repeat: int = 3
    algos: tuple[str, ...] = ("auto",)
    dtype: str = "float32"
    reduce_op: str = "sum"
    root: int = 0
    prepared: bool = False  # ours through collectives.prepare_* (the peer stays plain)
    symmetric: bool = False  # buffers from collectives.symmetric (nccl-tests' -R)
    device: bool = False  # CuPy buffers; the peer is the device backend's native call


@dataclass
class Row:
    """One (size, algorithm) measurement. Times in seconds, bandwidths in GB/s."""

    size: int
    count: int
    algo: str
    time: float
    algbw: float
    busbw: float
    wrong: int
    ratio: float | None = None  # peer time / this time (> 1: faster than MPI)
    times: list = field(default_factory=list)
    chosen: str = ""  # the algorithm "auto" ran

    def to_dict(self) -> dict:
        return asdict(self)


def peer_name(cfg: BenchConfig) -> str:
    """The peer measured next to our algorithms: ``mpi`` on host, ``native`` on device."""
    return DEVICE_PEER if cfg.device else PEER


def _cupy():
    import cupy

    return cupy


def _sync(cfg: BenchConfig) -> None:
    """Wait for the device work queued so far (device runs only)."""
    if cfg.device:
        _cupy().cuda.get_current_stream().synchronize()


def _dtype(name: str) -> np.dtype:
    return np.dtype(types.bfloat16) if name == "bfloat16" else np.dtype(name)


def _fill(rank: int, idx: np.ndarray, it: int, dtype) -> np.ndarray:
    """The test pattern: small integers, exact in every dtype and in their sums."""
    return (((rank * 131 + idx * 7 + it * 3) % 17) - 8).astype(dtype)


class _Case:
    """Buffers and calls of one op at one size on one group."""

    def __init__(self, cfg: BenchConfig, group, size: int):
        self.cfg, self.group, self.op = cfg, group, cfg.op
        self.held: list = []  # prepared collectives of this case, freed by close()
        p, r = group.size, group.rank
        self.dtype = _dtype(cfg.dtype)
        item = self.dtype.itemsize
        op = self.op
        self.count = count_of(op, size, item, p)
        self.size = self.count * item
        n = self.count
        half = many_to_many_peers(p)
        self.peers = [(r + d) % p for d in range(1, half + 1)] if p > 1 else [r]
        self.senders = sorted((r - d) % p for d in range(1, half + 1)) if p > 1 else [r]
        empty = self._alloc
        if op is CollectiveOp.ALL_GATHER:
            self.send, self.recv = empty(n // p), empty(n)
        elif op is CollectiveOp.REDUCE_SCATTER:
            self.send, self.recv = empty(n), empty(n // p)
        elif op is CollectiveOp.BROADCAST and cfg.symmetric:
            self.send = self.recv = empty(n)  # one buffer: the same allocation everywhere
        elif op in (CollectiveOp.BROADCAST, CollectiveOp.ONE_TO_MANY):
            self.send, self.recv = empty(n), empty(n)
        elif op is CollectiveOp.MANY_TO_MANY:
            per = n // len(self.peers)
            self.send = empty(per * len(self.peers))
            self.recv = empty(per * len(self.senders))
            self.per = per
        else:
            self.send, self.recv = empty(n), empty(n)
        self.fill(0)

    def _alloc(self, n: int) -> np.ndarray:
        if self.cfg.symmetric:
            from collectives import symmetric

            return symmetric.empty(n, self.dtype, group=self.group)
        if self.cfg.device:
            return _cupy().empty(n, self.dtype)
        return np.empty(n, self.dtype)

    def fill(self, it: int) -> None:
        step = 1 << 22  # in pieces: no temporaries as large as the buffer
        put = _cupy().asarray if self.cfg.device else (lambda a: a)
        for lo in range(0, self.send.size, step):
            hi = min(self.send.size, lo + step)
            self.send[lo:hi] = put(_fill(self.group.rank, np.arange(lo, hi), it, self.dtype))
        if self.recv is not self.send or self.group.rank != self.cfg.root:
            self.recv[:] = 0
        _sync(self.cfg)

    # -- the calls ---------------------------------------------------------
    def peer(self):
        """The peer: the native MPI call on host buffers, the device backend's
        own collective (``native``) on device buffers."""
        if self.cfg.device:
            return self.ours(DEVICE_PEER)
        return self.mpi()

    def mpi(self):
        """The native MPI peer: MPI's own call, one mpi4py call per run (the MPI
        backend's direct call, 2-byte floats as it moves and reduces them)."""
        op, s, r, g, cfg = self.op, self.send, self.recv, self.group, self.cfg
        direct = g.backend(s).direct
        kw = {"reduce_op": ReduceOp.parse(cfg.reduce_op)} \
            if op in (CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER) else {}
        if op in (CollectiveOp.BROADCAST, CollectiveOp.ONE_TO_MANY):
            buf = s if g.rank == cfg.root else r
            bcast = direct("broadcast", self.dtype, root=cfg.root)
            return lambda: bcast(buf)
        if op in (CollectiveOp.ALL_TO_ALL_V, CollectiveOp.MANY_TO_MANY):
            kw["counts"] = self._dense_counts()
        name = {CollectiveOp.ALL_TO_ALL: "all_to_all", CollectiveOp.ALL_TO_ALL_V: "all_to_all_v",
                CollectiveOp.ALL_REDUCE: "all_reduce",
                CollectiveOp.REDUCE_SCATTER: "reduce_scatter",
                CollectiveOp.ALL_GATHER: "all_gather",
                CollectiveOp.MANY_TO_MANY: "all_to_all_v"}[op]
        run = direct(name, self.dtype, **kw)
        return lambda: run(s, r)

    def _dense_counts(self):
        """The peer's AlltoAllv counts and displacements, every rank's (zero for the ranks
        a ManyToMany leaves out; its blocks lie in peer order, not rank order)."""
        p = self.group.size
        if self.op is CollectiveOp.ALL_TO_ALL_V:
            block = self.send.size // p
            offsets = [i * block for i in range(p)]
            return [block] * p, offsets, [block] * p, offsets
        sc, rc, sd, rd = [0] * p, [0] * p, [0] * p, [0] * p
        for i, q in enumerate(self.peers):
            sc[q], sd[q] = self.per, i * self.per
        for i, q in enumerate(self.senders):
            rc[q], rd[q] = self.per, i * self.per
        return sc, sd, rc, rd

    def ours(self, algo: str | None):
        op, s, r, g = self.op, self.send, self.recv, self.group
        kw = {"algo": algo, "group": g}
        if self.cfg.prepared and op in _PREPARABLE:
            return self._prepared(kw)
        if op is CollectiveOp.ALL_TO_ALL:
            return lambda: C.all_to_all(s, r, **kw)
        if op is CollectiveOp.ALL_TO_ALL_V:
            c = [s.size // g.size] * g.size
            return lambda: C.all_to_all_v(s, c, r, c, **kw)
        if op is CollectiveOp.ALL_REDUCE:
            return lambda: C.all_reduce(s, r, op=self.cfg.reduce_op, **kw)
        if op is CollectiveOp.REDUCE_SCATTER:
            return lambda: C.reduce_scatter(s, r, op=self.cfg.reduce_op, **kw)
        if op is CollectiveOp.ALL_GATHER:
            return lambda: C.all_gather(s, r, **kw)
        if op is CollectiveOp.BROADCAST:
            buf = s if g.rank == self.cfg.root else r
            return lambda: C.broadcast(buf, root=self.cfg.root, **kw)
        if op is CollectiveOp.ONE_TO_MANY:
            ranks = [q for q in range(g.size) if q != self.cfg.root]
            root = self.cfg.root
            return lambda: C.one_to_many(s if g.rank == root else None,
                                         r if g.rank != root else None, root=root,
                                         ranks=ranks, **kw)
        counts = [self.per] * len(self.peers)
        rcounts = [self.per] * len(self.senders)
        return lambda: C.many_to_many(s, self.peers, counts, recv_peers=self.senders,
                                      recv_counts=rcounts, recvbuf=r, **kw)

    def _prepared(self, kw):
        """Our call as a prepared collective (``--prepared``); one that cannot be
        prepared (e.g. an algorithm that does not fit) raises when called."""
        op, s, r, g, cfg = self.op, self.send, self.recv, self.group, self.cfg
        try:
            if op is CollectiveOp.ALL_TO_ALL:
                prep = C.prepare_all_to_all(s, r, **kw)
            elif op is CollectiveOp.ALL_TO_ALL_V:
                c = [s.size // g.size] * g.size
                prep = C.prepare_all_to_all_v(s, c, r, c, **kw)
            elif op is CollectiveOp.ALL_REDUCE:
                prep = C.prepare_all_reduce(s, r, op=cfg.reduce_op, **kw)
            elif op is CollectiveOp.REDUCE_SCATTER:
                prep = C.prepare_reduce_scatter(s, r, op=cfg.reduce_op, **kw)
            elif op is CollectiveOp.ALL_GATHER:
                prep = C.prepare_all_gather(s, r, **kw)
            else:
                prep = C.prepare_broadcast(s if g.rank == cfg.root else r, root=cfg.root, **kw)
        except CollectiveArgumentError as exc:  # agreed: every rank gets the same error
            def refuse(exc=exc):
                raise exc
            return refuse
        self.held.append(prep)
        return prep

    def close(self) -> None:
        """Free the prepared collectives of this case."""
        for prep in self.held:
            prep.free()
        self.held.clear()

    # -- checking -----------------------------------------------------------
    def expected(self, it: int) -> np.ndarray:
        p, r, op, dt = self.group.size, self.group.rank, self.op, self.dtype
        n = self.count

        def f(rank, lo, hi):
            return _fill(rank, np.arange(lo, hi), it, np.float64)

        if op in (CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V):
            b = n // p
            return np.concatenate([f(i, r * b, (r + 1) * b) for i in range(p)]).astype(dt)
        red = {"sum": np.add, "max": np.maximum, "min": np.minimum,
               "prod": np.multiply}[ReduceOp.parse(self.cfg.reduce_op).value]
        if op in (CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER):
            lo, hi = (0, n) if op is CollectiveOp.ALL_REDUCE else (r * (n // p),
                                                                    (r + 1) * (n // p))
            acc = f(0, lo, hi)
            for i in range(1, p):
                acc = red(acc, f(i, lo, hi))
            return acc if is_half(dt) else acc.astype(dt)  # 16-bit: exact, see tolerance()
        if op is CollectiveOp.ALL_GATHER:
            return np.concatenate([f(i, 0, n // p) for i in range(p)]).astype(dt)
        if op in (CollectiveOp.BROADCAST, CollectiveOp.ONE_TO_MANY):
            return f(self.cfg.root, 0, n).astype(dt)
        parts = []
        for q in self.senders:
            q_peers = [(q + d) % p for d in range(1, max(2, p // 2 + 1))] if p > 1 else [q]
            k = q_peers.index(r)
            parts.append(f(q, k * self.per, (k + 1) * self.per))
        return np.concatenate(parts).astype(dt)

    def output(self) -> np.ndarray:
        if self.op in (CollectiveOp.BROADCAST, CollectiveOp.ONE_TO_MANY) \
                and self.group.rank == self.cfg.root:
            return self.send
        return self.recv

    def tolerance(self, it: int):
        """How far from :meth:`expected` an element may be: 0, except for float16 and
        bfloat16 reductions, whose results may be off by the error bound of
        :mod:`neocomm.reduction` with ``p - 1`` rounding steps (the deepest reduction
        tree over ``p`` ranks, whatever the algorithm)."""
        op, p, r, n = self.op, self.group.size, self.group.rank, self.count
        if op not in (CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER) \
                or not is_half(self.dtype):
            return 0
        lo, hi = (0, n) if op is CollectiveOp.ALL_REDUCE else (r * (n // p),
                                                                (r + 1) * (n // p))
        inputs = [_fill(i, np.arange(lo, hi), it, self.dtype) for i in range(p)]
        return error_bound(inputs, ReduceOp.parse(self.cfg.reduce_op), max(0, p - 1))

    def wrong(self, run, it: int) -> int:
        """Run once on pattern ``it``; count elements on this rank off by more than
        :meth:`tolerance`."""
        self.fill(it)
        run()
        _sync(self.cfg)
        if self.op is CollectiveOp.ONE_TO_MANY and self.group.rank == self.cfg.root:
            return 0
        out = self.output()
        got = (out.get() if self.cfg.device else out).astype(np.float64)
        want = self.expected(it).astype(np.float64)
        return int(np.count_nonzero(~(np.abs(got - want) <= self.tolerance(it))))


_PREPARABLE = (CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V, CollectiveOp.ALL_REDUCE,
               CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_GATHER, CollectiveOp.BROADCAST)


def sizes(cfg: BenchConfig) -> list[int]:
    """The sweep's sizes in bytes."""
    return sweep(cfg.min_bytes, cfg.max_bytes, cfg.factor)


def _time(group, fn, iters: int, cfg: BenchConfig) -> float:
    from mpi4py import MPI

    _sync(cfg)
    group.comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(cfg)  # device work is queued: the clock stops when it is done
    elapsed = (time.perf_counter() - t0) / max(1, iters)
    return group.comm.allreduce(elapsed, op=MPI.MAX)


def bench_algos(cfg: BenchConfig, group) -> tuple[list[str], set]:
    """``(algorithms, optional)`` the sweep of ``cfg`` on ``group`` times, the peer first;
    ``optional`` are those ``all`` added, left out where they cannot run. Raises ValueError
    naming the option at fault (what ``neocomm bench`` checks for every op before it runs
    any)."""
    op = cfg.op
    peer = peer_name(cfg)
    if cfg.device and cfg.symmetric:
        raise ValueError("--device: symmetric buffers (-R) are host memory; use one or "
                         "the other")
    if cfg.device and DEVICE_PEER not in names(op):
        raise ValueError(f"--device: {op.value} has no native backend call to measure "
                         f"against; expected one of "
                         f"{[o.value for o in CollectiveOp if DEVICE_PEER in names(o)]}")
    wanted = list(cfg.algos) if cfg.algos else ["auto"]
    optional: set = set()
    if "all" in wanted:
        optional = {a for a in names(op) if a not in wanted}
        wanted = [a for a in wanted if a != "all"] + [a for a in names(op) if a not in wanted]
    for name in wanted:
        if name not in ("auto", peer) and name not in names(op):
            raise ValueError(f"--algo: unknown algorithm {name!r} for {op.value}; expected "
                             f"one of {['auto', peer] + list(names(op))}")
    algos = [peer] + [a for a in wanted if a != peer]
    if op in (CollectiveOp.ONE_TO_MANY, CollectiveOp.BROADCAST) and not \
            0 <= cfg.root < group.size:
        raise ValueError(f"--root: expected a rank in [0, {group.size}), got {cfg.root}")
    return algos, optional


def run_bench(cfg: BenchConfig, group, on_row=None) -> list[Row]:
    """Run the sweep on ``group``; ``on_row(size_rows)`` is called after each size."""
    from mpi4py import MPI

    op = cfg.op
    peer = peer_name(cfg)
    algos, optional = bench_algos(cfg, group)
    rows: list[Row] = []
    for size in sizes(cfg):
        case = _Case(cfg, group, size)
        calls = {a: case.peer() if a == peer else case.ours(None if a == "auto" else a)
                 for a in algos}
        for a in list(algos):
            try:
                for _ in range(max(1, cfg.warmup)):
                    calls[a]()
            except CollectiveArgumentError as exc:
                if a in optional and exc.field == "algo":  # cannot run here: leave it out
                    algos.remove(a)
                    del calls[a]
                    continue
                raise ValueError(f"--algo {a}: {exc}") from None
        times = {a: [] for a in algos}
        for _ in range(max(1, cfg.repeat)):
            for a in algos:
                times[a].append(_time(group, calls[a], cfg.iters, cfg))
        size_rows = []
        for a in algos:
            wrong = sum(case.wrong(calls[a], it + 1) for it in range(cfg.check))
            wrong = group.comm.allreduce(wrong, op=MPI.SUM)
            t = statistics.median(times[a])
            algbw = case.size / t / 1e9 if t > 0 else 0.0
            size_rows.append(Row(case.size, case.count, a, t, algbw,
                                 algbw * bus_factor(op, group.size), wrong,
                                 times=times[a], chosen=_chosen(case, a, calls[a])))
        peer_time = size_rows[0].time
        for row in size_rows[1:]:
            row.ratio = peer_time / row.time if row.time > 0 else None
        rows.extend(size_rows)
        case.close()
        if on_row is not None:
            on_row(size_rows)
    return rows


def _chosen(case: _Case, algo: str, run) -> str:
    """The algorithm a call with ``algo`` runs: ``auto`` resolved by its plan (a prepared
    collective's, or the one the group keeps for the call, run once more here)."""
    if algo != "auto":
        return algo
    if isinstance(run, C.PreparedCollective):
        return run.algo
    run()
    plan = C.state_of(case.group).plans.latest(case.op.value)
    return "auto" if plan is None else plan.algo


def peak_rss_bytes(group) -> int:
    """Largest peak resident set size over the group's ranks, bytes."""
    from mpi4py import MPI

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return group.comm.allreduce(int(kib) * 1024, op=MPI.MAX)


def staging_high_water(group) -> int:
    """Largest staging pool high-water mark over the group's ranks, bytes."""
    from mpi4py import MPI

    return group.comm.allreduce(int(staging_pool(np).high_water), op=MPI.MAX)
