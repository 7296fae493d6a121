"""Symmetric memory: host buffers that every rank of a node can read directly.

``empty(shape, dtype, group=group)`` allocates, collectively over a group,
one buffer per rank inside one shared-memory region of each node (a file
on ``/dev/shm``, mapped by every rank of the node and unlinked as soon as
all have mapped it, so nothing is left behind when a job dies). Every rank
gets a plain NumPy array of the requested shape and dtype; its memory
lives as long as any view of it does.

Collectives on such buffers can use the ``symmetric`` algorithm
(:mod:`collectives.algorithms.symmetric`): a rank reads its peers' buffers
in place, so an AllReduce is one reduction of its own segment straight
from every peer's input and one copy of the others' reduced segments,
with no message through MPI at all. It is the host analogue of NCCL's
registered buffers (``ncclMemAlloc`` + ``ncclCommRegister``) and of
PyTorch's symmetric memory. A buffer is symmetric for a call when it lies
in such a region at the same offset on every rank of the call's group,
and the group lies within one node; views (slices) of a symmetric buffer
qualify too. The offsets and sizes are checked on every call.

Example, 2 ranks::

    buf = symmetric.empty(1 << 20, np.float32)   # collective
    buf[:] = local_gradients
    collectives.all_reduce(buf)                  # "symmetric" chosen by the cost model
"""
from __future__ import annotations

import mmap
import os
import secrets
import weakref
import zlib

import numpy as np

from neocomm.agree import Problem, agree
from collectives.validate import dtype_code_of
from neocomm.world import group_or_world

from collectives.types import SYMMETRIC_RECV, SYMMETRIC_SEND

__all__ = ["empty", "zeros", "is_symmetric", "peers", "describe", "node_views", "availability",
           "SEND", "RECV"]

#: Bits of :attr:`collectives.types.Request.symmetric`: which side of a call is symmetric.
SEND, RECV = SYMMETRIC_SEND, SYMMETRIC_RECV

_PAGE = 4096
_SHM_DIR = "/dev/shm"


class _Region:
    """One mapped region: ``ranks`` (world ranks, segment order) hold one
    ``seg`` bytes segment each; ``ref`` is a weak reference to the whole map,
    ``ident`` a number the same on every rank of the region (and on no other)."""

    __slots__ = ("ref", "ident", "base", "seg", "mine", "index", "__weakref__")

    def __init__(self, whole: np.ndarray, ident: int, seg: int, ranks: tuple[int, ...],
                 mine: int):
        self.ref, self.ident = weakref.ref(whole), ident
        self.base = whole.__array_interface__["data"][0]
        self.seg, self.mine = seg, mine
        self.index = {w: i for i, w in enumerate(ranks)}


_REGIONS: list[_Region] = []
_NODE_COMMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def availability() -> tuple[bool, str]:
    """Whether this host can back symmetric memory: ``(True, where and how much
    is free)`` or ``(False, why not)``."""
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError as exc:
        return False, f"{_SHM_DIR}: {exc.strerror or exc}"
    if not os.access(_SHM_DIR, os.W_OK):
        return False, f"{_SHM_DIR} is not writable"
    return True, f"{_SHM_DIR}, {st.f_bavail * st.f_frsize / 2**30:.1f} GiB free"


def _node_comm(group):
    """The ranks of ``group`` that share memory with this one and sit on its
    (possibly emulated) node, as an mpi4py communicator (collective, cached)."""
    found = _NODE_COMMS.get(group)
    if found is None:
        from mpi4py import MPI

        shared = group.comm.Split_type(MPI.COMM_TYPE_SHARED, key=group.rank)
        node = group.world.node_of(group.ranks[group.rank])
        found = shared.Split(node, group.rank)
        shared.Free()
        _NODE_COMMS[group] = found
    return found


def empty(shape, dtype="float32", *, group=None) -> np.ndarray:
    """A symmetric host array of ``shape`` and ``dtype`` (collective over ``group``).

    Every rank of the group must call it with the same shape and dtype;
    otherwise :class:`~neocomm.errors.CollectiveArgumentError` is raised on
    every rank, as it is when the node's shared memory cannot hold the
    region. The memory starts zeroed.
    """
    g = group_or_world(group)
    problem, nbytes, code, shp = None, 0, 0, ()
    try:
        dt = np.dtype(dtype)
        code = 0 if dt.hasobject else dtype_code_of(np.empty(0, dt))
    except TypeError:
        code = 0
    if code == 0:
        problem = Problem("dtype", f"symmetric.empty: dtype: expected a numeric dtype "
                                   f"neocomm moves, got {dtype!r}")
    try:
        shp = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        shp = None
    if shp is None or any(s < 0 for s in shp):
        problem = problem or Problem("shape", f"symmetric.empty: shape: expected sizes "
                                              f">= 0, got {shape!r}")
    elif code:
        nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
    agree(g.comm, "symmetric.empty", problem,
          [("op", 1), ("dtype", code), ("shape", zlib.crc32(repr(shp).encode()) & 0x7FFFFFFF)],
          call=lambda: f"symmetric.empty({shape!r:.80}, "
                       f"dtype={repr(dt.name) if code else repr(dtype)})")
    comm = _node_comm(g)
    seg = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
    whole, ident, problem = _map(comm, seg)
    agree(g.comm, "symmetric.empty", problem, [("op", 2)])
    ranks = tuple(comm.allgather(g.world.rank))
    region = _Region(whole, ident, seg, ranks, comm.rank)
    _REGIONS[:] = [r for r in _REGIONS if r.ref() is not None] + [region]
    start = comm.rank * seg
    return whole[start:start + nbytes].view(dt).reshape(shp)


def zeros(shape, dtype="float32", *, group=None) -> np.ndarray:
    """:func:`empty`, filled with zeros (it is already: the name says so)."""
    out = empty(shape, dtype, group=group)
    out[...] = 0
    return out


def _map(comm, seg: int) -> tuple[np.ndarray | None, int, Problem | None]:
    """Create (node leader), map (everyone) and unlink the region of ``comm``;
    returns the map, the region's number and the problem (None when mapped)."""
    total = seg * comm.size
    created, error, token = None, None, secrets.token_hex(6)
    try:
        if comm.rank == 0:
            path = os.path.join(_SHM_DIR, f"neocomm-{os.getpid()}-{token}")
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                created = path
                try:
                    if hasattr(os, "posix_fallocate"):
                        os.posix_fallocate(fd, 0, total)  # ENOSPC now, not SIGBUS later
                    else:  # pragma: no cover - non-Linux
                        os.ftruncate(fd, total)
                finally:
                    os.close(fd)
            except OSError as exc:
                error = f"cannot create {total} bytes of shared memory in {_SHM_DIR}: {exc}"
        path, error, token = comm.bcast((created, error, token), root=0)
        whole = None
        if error is None:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, total, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                whole = np.frombuffer(mm, np.uint8)
            except OSError as exc:
                error = f"cannot map the shared memory region {path}: {exc}"
        comm.Barrier()  # everyone has mapped it (or failed): the name can go
    finally:
        if created is not None:
            try:
                os.unlink(created)
            except OSError:
                pass
    problem = None if error is None else Problem("memory", f"symmetric.empty: {error}")
    return whole, int(token, 16), problem


def _find(buf) -> tuple[_Region, np.ndarray, int] | None:
    """The live region holding ``buf`` in this rank's segment, its map and the offset."""
    if not _REGIONS or type(buf) is not np.ndarray:
        return None
    addr = buf.__array_interface__["data"][0]
    for region in _REGIONS:
        whole = region.ref()
        if whole is None:
            _REGIONS[:] = [r for r in _REGIONS if r.ref() is not None]
            return _find(buf)
        off = addr - region.base - region.seg * region.mine
        if 0 <= off and off + buf.nbytes <= region.seg:
            return region, whole, off
    return None


def peers(group, buf, members=None) -> tuple[tuple[np.ndarray, ...], int, int] | None:
    """``buf``'s counterpart on every rank of ``group`` (or on the group ranks
    ``members``), as flat views in that order, its region's number and its
    byte offset in this rank's segment; None when ``buf`` is not symmetric
    memory shared by all of them. An empty array is symmetric anywhere
    (there is nothing to read)."""
    ranks = group.ranks if members is None else [group.ranks[m] for m in members]
    if type(buf) is np.ndarray and buf.size == 0:  # nothing to read: trivially symmetric
        return (np.empty(0, buf.dtype),) * len(ranks), 0, 0
    found = _find(buf)
    if found is None or not buf.flags.c_contiguous:
        return None
    region, whole, off = found
    index = [region.index.get(w) for w in ranks]
    if None in index:
        return None
    n, seg = buf.nbytes, region.seg
    views = tuple(whole[i * seg + off:i * seg + off + n].view(buf.dtype) for i in index)
    return views, region.ident, off


def is_symmetric(buf, group=None) -> bool:
    """Whether ``buf`` is symmetric memory that every rank of ``group`` can read
    (local test: the offsets on the other ranks are checked by each call)."""
    return peers(group_or_world(group), buf) is not None


_NONE: dict = {}


def node_views(group, members, send, recv):
    """For a hierarchical algorithm: the views of ``send`` and ``recv`` (the
    output, or ``send`` itself in place) on the group ranks ``members`` of this
    rank's node, and the numbers every member must agree on before using them
    (dtype, allocations, offsets, sizes); ``(None, None, (-1,) * 7)`` when
    they are not both symmetric among ``members``."""
    mine = peers(group, send, members) if send is not None else None
    theirs = mine if (recv is send and mine) else (
        peers(group, recv, members) if mine and recv is not None else None)
    if mine is None or theirs is None:
        return None, None, (-1,) * 7
    check = ((dtype_code_of(send),) + mine[1:] + (send.nbytes,) + theirs[1:]
             + (recv.nbytes,))
    return mine[0], theirs[0], check


def describe(group, send, recv=None) -> tuple[int, dict]:
    """The :attr:`~collectives.types.Request.symmetric` bits of a call on ``group``
    and the :class:`~collectives.algorithms.Call` fields the ``symmetric``
    algorithm reads (``peer_send``, ``peer_recv``, ``sym_check``). ``recv`` is
    the output when the algorithm reads the peers' outputs (AllReduce), the
    same object as ``send`` for an in-place call, else None."""
    if send is None or (not _REGIONS and getattr(send, "size", 1) != 0):
        return 0, _NONE
    mine = peers(group, send)
    if mine is None:
        return 0, _NONE
    theirs = mine if recv is send else (peers(group, recv) if recv is not None else None)
    bits = SEND | (RECV if theirs is not None else 0)
    check = ((dtype_code_of(send),) + mine[1:] + (send.nbytes,)
             + (theirs[1:] + (recv.nbytes,) if theirs else (-1,) * 3))
    return bits, {"peer_send": mine[0], "peer_recv": theirs[0] if theirs else None,
                  "sym_check": check}
