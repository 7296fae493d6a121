"""Process groups: a set of ranks, their MPI communicator, and their backends."""
from __future__ import annotations

import logging
from typing import Sequence

import threading

from neocomm.backends import backend_class, device_backend_kind
from neocomm.errors import BackendUnavailableError, GroupGoneError
from neocomm.types import BackendKind, GroupKind

__all__ = ["ProcessGroup", "StateHolder", "is_device_array"]

_log = logging.getLogger(__name__)


class StateHolder:
    """Runtime state that layers above keep for an object (a group, the world), created
    on first use and released with it: caches, sequence numbers, progress, buffers.

    ``state(key, factory)`` returns the object of ``key``, made by ``factory(self)`` the
    first time (under a lock: safe from several threads); :meth:`_release_states` calls
    ``close()`` on every state that has one, newest first, and forgets them all.
    """

    def _init_states(self) -> None:
        self._states: dict = {}
        self._states_lock = threading.Lock()

    def state(self, key: str, factory):
        """This object's state ``key`` (made by ``factory(self)`` on first use)."""
        found = self._states.get(key)
        if found is None:
            gone = getattr(self, "gone", None)
            if gone is not None:
                raise GroupGoneError(gone, ranks=getattr(self, "ranks", ()))
            with self._states_lock:
                found = self._states.get(key)
                if found is None:
                    found = self._states[key] = factory(self)
        return found

    def _release_states(self) -> None:
        with self._states_lock:
            states, self._states = list(self._states.values()), {}
        for found in reversed(states):
            close = getattr(found, "close", None)
            if close is not None:
                close()


def is_device_array(buf) -> bool:
    """True for CuPy (CUDA) arrays, without importing CuPy."""
    return hasattr(buf, "__cuda_array_interface__")


class ProcessGroup(StateHolder):
    """An ordered set of ranks that run collectives together.

    ``ranks`` are world ranks in group order; ``rank`` is this process's
    position in the group. ``comm`` is the group's own mpi4py communicator
    (control plane, and data plane for host buffers). ``nodes`` lists the
    group ranks on each node, in node order. Layers above keep their runtime state of
    the group with :meth:`state`; it goes when the group is freed.
    """

    def __init__(self, world, comm, kind: GroupKind, name: str):
        self.world = world
        self.comm = comm
        self.kind = kind
        self.name = name
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ranks: tuple[int, ...] = tuple(comm.allgather(world.rank))
        by_node: dict[int, list[int]] = {}
        for group_rank, world_rank in enumerate(self.ranks):
            by_node.setdefault(world.node_of(world_rank), []).append(group_rank)
        self.node_ids: tuple[int, ...] = tuple(sorted(by_node))
        self.nodes: tuple[tuple[int, ...], ...] = tuple(tuple(by_node[n]) for n in self.node_ids)
        self._backends: dict[BackendKind, object] = {}
        self._init_states()
        #: why this group can no longer be used: freed, or its world closed (None while
        #: it can); ``world.close()`` releases every group of the world
        self.gone: str | None = None
        world.adopt(self)

    def __repr__(self) -> str:
        return f"ProcessGroup({self.name!r}, rank={self.rank}, size={self.size})"

    def free(self) -> None:
        """Release the group (collective over its ranks, like ``MPI_Comm_free``): its
        backends and communicator go, and any later call on it raises, naming it."""
        from neocomm.agree import agree

        if self.gone is not None:
            return
        agree(self.comm, "free", None, [("size", self.size)])
        self._release(f"group {self.name!r} (world ranks {list(self.ranks)}) was freed by "
                      f"group.free(); use a live group")

    def _release(self, why: str) -> None:
        self._release_states()  # what layers above keep of the group (plans, its fabric)
        self.close()
        self.gone = why
        if self.comm is not self.world.comm:
            self.comm.Free()

    # -- layout --------------------------------------------------------
    def node_of(self, group_rank: int) -> int:
        """Position (0..len(nodes)-1) of the node that holds ``group_rank``."""
        return self.node_ids.index(self.world.node_of(self.ranks[group_rank]))

    @property
    def ranks_per_node(self) -> int | None:
        """Ranks on each node when every node has the same number, else None."""
        sizes = {len(n) for n in self.nodes}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    # -- backends ------------------------------------------------------
    def backend(self, buf=None, kind: BackendKind | str | None = None):
        """The backend that moves ``buf`` (or the one named by ``kind``).

        Host (NumPy) buffers go over MPI. Device buffers go over NCCL when it
        is available, else over the staged backend; ``NEOCOMM_BACKEND``
        forces one.
        """
        if kind is None:
            kind = device_backend_kind() if buf is not None and is_device_array(buf) \
                else BackendKind.MPI
        kind = BackendKind(kind)
        backend = self._backends.get(kind)
        if backend is None:
            if self.gone is not None:
                raise GroupGoneError(self.gone, ranks=self.ranks)
            cls = backend_class(kind)
            ok, reason = cls.availability()
            if not ok:
                raise BackendUnavailableError(kind.value, reason or "unknown reason")
            backend = cls(self)
            self._backends[kind] = backend
        return backend

    def split(self, ranks: Sequence[int], name: str | None = None) -> "ProcessGroup | None":
        """A subgroup of these group ranks (collective over this group).

        Every rank of this group must call it with the same ``ranks``;
        members get the subgroup, the others None.
        """
        from neocomm.agree import Problem, agree

        ranks = [int(r) for r in ranks]
        problem = None
        if not ranks:
            problem = Problem("ranks", "split: ranks must name at least one rank")
        elif len(set(ranks)) != len(ranks):
            problem = Problem("ranks", f"split: ranks has duplicates: {ranks}")
        elif not all(0 <= r < self.size for r in ranks):
            problem = Problem("ranks", f"split: ranks must lie in [0, {self.size}), got {ranks}")
        import zlib

        digest = zlib.crc32(repr(ranks).encode())
        agree(self.comm, "split", problem, [("op", 1), ("ranks", digest)])
        from mpi4py import MPI

        member = self.rank in ranks
        color = 0 if member else MPI.UNDEFINED
        key = ranks.index(self.rank) if member else 0
        sub = self.comm.Split(color, key)
        if not member:
            return None
        return ProcessGroup(self.world, sub, GroupKind.SUB, name or f"{self.name}/sub{ranks}")

    def close(self) -> None:
        for backend in self._backends.values():
            backend.close()
        self._backends.clear()
