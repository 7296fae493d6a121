"""One launch on a stand-in NCCL communicator (:mod:`cupy.cuda.nccl`), run on its stream's
worker: the point-to-point rendezvous and its deadlock detection, the collectives' check
that every rank issued the same calls, and NCCL's order of reduction."""
from __future__ import annotations

import collections
import json
import time

import numpy as np

from cupy.cuda.nccl import (_CTRL, _DATA, _OPS, NcclCommunicator, NcclError, _mpi,
                             _stall_seconds, ncclSystemError)

_UFUNC = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
          "avg": np.add}

class _Unit:
    """One launch on a communicator: a bare call, or the calls of one group."""

    def __init__(self, comm: NcclCommunicator, ops: list):
        self.comm, self.ops = comm, ops
        self.me = comm._rank
        self.sends = [o for o in ops if o.kind == "send"]
        self.recvs = [o for o in ops if o.kind == "recv"]
        self.colls = [o for o in ops if o.kind not in ("send", "recv")]
        self.summary = {"send_to": dict(collections.Counter(o.peer for o in self.sends)),
                        "recv_from": dict(collections.Counter(o.peer for o in self.recvs)),
                        "coll": bool(self.colls), "what": self.describe(),
                        "colls_done": comm._colls_done}

    def describe(self) -> str:
        if len(self.ops) == 1:
            return self.ops[0].describe()
        return "group{" + "; ".join(o.describe() for o in self.ops) + "}"

    def run(self) -> None:
        comm, mpi = self.comm, self.comm._mpi
        MPI = _mpi()

        # announce every point-to-point call to its peer: requests to send and to receive
        waiting_rtr: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        for o in self.sends:
            comm._post(o.peer, {"t": "rts", "nbytes": o.send[1].nbytes, "unit": self.summary,
                                "what": o.describe()})
            waiting_rtr[o.peer].append(o)
        data_reqs: list = []
        waiting_rts: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        for o in self.recvs:
            comm._post(o.peer, {"t": "rtr", "nbytes": o.recv[1].nbytes, "unit": self.summary,
                                "what": o.describe()})
            data_reqs.append(mpi.Irecv([o.recv[1].view(np.uint8), MPI.BYTE], source=o.peer,
                                       tag=_DATA))
            waiting_rts[o.peer].append(o)
        coll = _Collectives(self, mpi) if self.colls else None
        started = last_progress = time.monotonic()
        nap = 0.0001
        try:
            while True:
                progressed = self._drain(mpi)
                # a receive request from the peer lets the matching send go
                for peer, queue in waiting_rtr.items():
                    while queue and comm._rtr[peer]:
                        o, rtr = queue.popleft(), comm._rtr[peer].popleft()
                        if rtr["nbytes"] != o.send[1].nbytes:
                            raise comm._fail(f"rank {self.me} sends {o.send[1].nbytes} bytes to "
                                             f"rank {peer} ({o.describe()}) but rank {peer} "
                                             f"receives {rtr['nbytes']} bytes ({rtr['what']})")
                        data_reqs.append(mpi.Isend([o.send[1].view(np.uint8), MPI.BYTE],
                                                   dest=peer, tag=_DATA))
                        progressed = True
                # a send request from the peer is matched by the next receive
                for peer, queue in waiting_rts.items():
                    while queue and comm._rts[peer]:
                        o, rts = queue.popleft(), comm._rts[peer].popleft()
                        if rts["nbytes"] != o.recv[1].nbytes:
                            raise comm._fail(f"rank {self.me} receives {o.recv[1].nbytes} bytes "
                                             f"from rank {peer} ({o.describe()}) but rank "
                                             f"{peer} sends {rts['nbytes']} bytes "
                                             f"({rts['what']})")
                        progressed = True
                if data_reqs and MPI.Request.Testall(data_reqs):
                    data_reqs = []
                    progressed = True
                if coll is not None and coll.step():
                    progressed = True
                if (not data_reqs and not any(waiting_rtr.values())
                        and not any(waiting_rts.values()) and (coll is None or coll.done)):
                    break
                self._check_deadlock(waiting_rtr, waiting_rts)
                now = time.monotonic()
                if progressed:
                    last_progress, nap = now, 0.0001
                elif now - last_progress > _stall_seconds():
                    raise comm._fail(f"rank {self.me} made no progress for "
                                     f"{now - started:.0f} s in {self.describe()}: "
                                     f"{self._waiting(waiting_rtr, waiting_rts, coll)}")
                else:
                    time.sleep(nap)
                    nap = min(nap * 2, 0.002)
        except BaseException:
            for r in data_reqs:
                try:
                    r.Cancel()
                except Exception:  # noqa: BLE001 - a completed request
                    pass
            raise
        finally:
            comm._outbox = [r for r in comm._outbox if not r.Test()]

    def _drain(self, mpi) -> bool:
        MPI = _mpi()

        comm, got = self.comm, False
        status = MPI.Status()
        while mpi.iprobe(source=MPI.ANY_SOURCE, tag=_CTRL, status=status):
            src = status.Get_source()
            msg = mpi.recv(source=src, tag=_CTRL)
            got = True
            if msg["t"] == "abort":
                comm._aborted = comm._aborted or msg["msg"]
                raise NcclError(ncclSystemError, f"{msg['msg']} (reported by rank {msg['from']})")
            msg["from"] = src
            (comm._rts if msg["t"] == "rts" else comm._rtr)[src].append(msg)
        return got

    def _check_deadlock(self, waiting_rtr, waiting_rts) -> None:
        """Fail when a peer is stuck in a launch that can only finish after this one,
        while this one needs that peer to do what its launch does not contain."""
        comm = self.comm
        for peer in range(comm._ndev):
            # the peer's pending requests that nothing of this launch answers
            stuck = [m for m in comm._rts[peer]] if not waiting_rts.get(peer) else []
            stuck += [m for m in comm._rtr[peer]] if not waiting_rtr.get(peer) else []
            if not stuck:
                continue
            theirs = stuck[0]["unit"]
            need = None
            if waiting_rtr.get(peer) and not theirs["recv_from"].get(self.me):
                need = f"{waiting_rtr[peer][0].describe()} waits for rank {peer} to post a receive"
            elif waiting_rts.get(peer) and not theirs["send_to"].get(self.me):
                need = f"{waiting_rts[peer][0].describe()} waits for rank {peer} to post a send"
            elif (self.colls and not theirs["coll"]
                  and theirs["colls_done"] <= comm._colls_done):  # (else it took part)
                need = f"{self.colls[0].describe()} waits for rank {peer} to join it"
            if need is None:
                continue
            raise comm._fail(
                f"deadlock between rank {self.me} and rank {peer}: rank {self.me}'s "
                f"{need}, but rank {peer} is blocked in {theirs['what']}, which needs rank "
                f"{self.me} to go past its current call first. NCCL point-to-point calls that "
                f"must progress together (a send and a receive between the same ranks) have to "
                f"be in one groupStart()/groupEnd(), issued in the same order on every rank")

    def _waiting(self, waiting_rtr, waiting_rts, coll) -> str:
        parts = [f"{o.describe()} waits for rank {p}'s receive"
                 for p, q in waiting_rtr.items() for o in q]
        parts += [f"{o.describe()} waits for rank {p}'s send" for p, q in waiting_rts.items()
                  for o in q]
        if coll is not None and not coll.done:
            parts.append(f"{self.colls[0].describe()} waits for the other ranks to join")
        return "; ".join(parts) or "data in flight"


class _Collectives:
    """The collectives of one launch: compare the calls across ranks, then move the data."""

    def __init__(self, unit: _Unit, mpi):
        MPI = _mpi()

        self.unit, self.mpi, self.done = unit, mpi, False
        self.n = unit.comm._ndev
        desc = json.dumps([[o.kind, o.count, int(o.dcode), o.op, o.root, o.describe()]
                           for o in unit.colls]).encode()
        self._len = np.array([len(desc)], np.int64)
        self._lens = np.empty(self.n, np.int64)
        self._desc = desc
        self._req = mpi.Iallgather([self._len, MPI.INT64_T], [self._lens, MPI.INT64_T])
        self._stage = "lens"

    def step(self) -> bool:
        MPI = _mpi()

        if self.done or not self._req.Test():
            return False
        if self._stage == "lens":
            width = int(self._lens.max())
            self._mine = np.zeros(width, np.uint8)
            self._mine[:len(self._desc)] = np.frombuffer(self._desc, np.uint8)
            self._all = np.empty((self.n, width), np.uint8)
            self._req = self.mpi.Iallgather([self._mine, MPI.BYTE], [self._all, MPI.BYTE])
            self._stage = "desc"
        elif self._stage == "desc":
            calls = [json.loads(bytes(row[:int(k)])) for row, k in zip(self._all, self._lens)]
            keys = [[c[:5] for c in rank_calls] for rank_calls in calls]
            if any(k != keys[0] for k in keys):
                detail = "; ".join(f"rank {r}: " + ", ".join(c[5] for c in cs)
                                   for r, cs in enumerate(calls))
                raise self.unit.comm._fail(f"collective calls differ across ranks (NCCL would "
                                           f"hang or corrupt data): {detail}")
            self._payload = np.concatenate(
                [o.send[1].view(np.uint8).reshape(-1) if o.send is not None else
                 np.zeros(self._send_bytes(o), np.uint8) for o in self.unit.colls] or
                [np.zeros(0, np.uint8)])
            self._gathered = np.empty((self.n, self._payload.size), np.uint8)
            self._req = self.mpi.Iallgather([self._payload, MPI.BYTE],
                                            [self._gathered, MPI.BYTE])
            self._stage = "data"
        else:
            self._finish()
            self.done = True
        return True

    @staticmethod
    def _send_bytes(o) -> int:
        return o.count * o.dtype.itemsize if o.kind in ("broadcast", "bcast", "reduce") else 0

    def _finish(self) -> None:
        me, n, pos = self.unit.me, self.n, 0
        for o in self.unit.colls:
            nbytes = self._send_bytes(o) if o.send is None else o.send[1].nbytes
            block = self._gathered[:, pos:pos + nbytes]
            pos += nbytes
            data = np.ascontiguousarray(block).view(o.dtype).reshape(n, -1)
            if o.kind in ("allReduce", "reduce", "reduceScatter"):
                red = _reduce(data, _OPS[o.op], n)
                if o.kind == "reduceScatter":
                    red = red[me * o.count:(me + 1) * o.count]
                if o.recv is not None:
                    o.recv[1][...] = red
            elif o.kind == "allGather":
                o.recv[1][...] = data.reshape(-1)
            else:  # broadcast / bcast: the root's block
                o.recv[1][...] = data[o.root]


def _reduce(data: np.ndarray, op: str, n: int) -> np.ndarray:
    """Element-wise reduction over ranks in rank order, as NCCL's ring reduces: one step
    per rank, each step's result stored in the type itself (integers wrap). float16 and
    bfloat16 are computed in float32 and rounded to the type once per step, as NCCL's
    kernels do, so a sum of ``n`` ranks rounds ``n - 1`` times. ncclAvg divides integer
    sums by ``n`` (ncclDevSumPostDiv) and multiplies each float input by ``1/n`` in the
    type before summing (ncclDevPreMulSum)."""
    uf = _UFUNC[op]
    dtype = data.dtype
    half = dtype.name in ("float16", "bfloat16")
    with np.errstate(over="ignore", invalid="ignore"):
        if op == "avg" and dtype.kind == "f":
            scale = np.asarray(1.0 / n).astype(dtype)
            data = (data.astype(np.float32 if half else dtype) * scale).astype(dtype)
        acc = data[0].copy()
        for r in range(1, n):
            if half:
                acc[...] = uf(acc.astype(np.float32), data[r].astype(np.float32))
            else:
                uf(acc, data[r], out=acc)
        if op == "avg" and dtype.kind in "iu":
            acc = (acc // n).astype(dtype)
    return acc
