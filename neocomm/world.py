"""Bootstrap from MPI: who am I, where am I, and which groups do I belong to."""
from __future__ import annotations

import logging
import os
import sys
import traceback

from neocomm import config, watchdog
from neocomm.group import StateHolder
from neocomm.types import GroupKind

__all__ = ["init", "World", "current_world", "group_or_world"]

_log = logging.getLogger(__name__)
_WORLD: "World | None" = None


class World(StateHolder):
    """This rank's place in the job.

    ``node``/``num_nodes`` come from MPI's shared-memory split, or from
    ``NEOCOMM_RANKS_PER_NODE=K`` (emulated nodes of K consecutive ranks; when K does
    not divide the world, the last node holds the rest, as a host with fewer slots would).
    Groups: ``world``; ``intra_node`` (the ranks of this node); ``rail`` (the
    ranks with this local rank on every node — the ranks that share a NIC
    rail on ZionEX). ``device`` is the CUDA device bound to this rank, or None:
    the ``host_rank``-th GPU of its real host (round robin when the host has
    fewer GPUs than ranks; NCCL then refuses the group, naming the ranks).
    Layers above keep their process-wide runtime state (the progress of
    outstanding operations) with :meth:`state`; it goes with :meth:`close`.
    """

    def __init__(self, comm, ranks_per_node: int = 0):
        from mpi4py import MPI

        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.emulated = ranks_per_node > 0
        #: why this world can no longer be used (None while it can): see :meth:`close`
        self.gone: str | None = None
        self._groups: list = []  # weak references to every group of this world, in order
        self._init_states()
        shm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        #: this rank's position among the ranks of its real host (emulated nodes share one)
        self.host_rank = shm.Get_rank()
        leader = comm.allgather(shm.allreduce(self.rank, op=MPI.MIN))  # one per real host
        shm.Free()
        if self.emulated:
            nodes = [r // ranks_per_node for r in range(self.size)]
            _refuse_nodes_across_hosts(comm, ranks_per_node, nodes, leader)
        else:
            order = sorted(set(leader))
            nodes = [order.index(x) for x in leader]
        self._node_of = tuple(nodes)
        self.node = nodes[self.rank]
        self.num_nodes = max(nodes) + 1
        self.node_ranks = tuple(r for r in range(self.size) if nodes[r] == self.node)
        self.local_rank = self.node_ranks.index(self.rank)
        self.local_size = len(self.node_ranks)
        from neocomm.group import ProcessGroup

        self.world = ProcessGroup(self, comm, GroupKind.WORLD, "world")
        self.intra_node = ProcessGroup(self, comm.Split(self.node, self.rank),
                                       GroupKind.INTRA_NODE, f"node{self.node}")
        self.rail = ProcessGroup(self, comm.Split(self.local_rank, self.rank),
                                 GroupKind.RAIL, f"rail{self.local_rank}")
        self.device = _bind_device(self.host_rank)

    def adopt(self, group) -> None:
        """Record ``group`` as one of this world's (it goes when the world is closed)."""
        import weakref

        self._groups = [g for g in self._groups if g() is not None] + [weakref.ref(group)]

    def close(self) -> None:
        """End this world (collective over its ranks): every group of it is freed, and any
        later call on one raises, naming the group. :func:`init` makes a new world."""
        global _WORLD
        from neocomm.agree import agree

        if self.gone is not None:
            return
        agree(self.comm, "World.close", None, [("size", self.size)])
        why = "world.close() ended its world; use a group of the current world"
        for ref in reversed(self._groups):  # the same order on every member of each group
            group = ref()
            if group is not None and group.gone is None:
                group._release(f"group {group.name!r} (world ranks {list(group.ranks)}): {why}")
        self._release_states()
        self.gone = f"the world was closed by world.close(); {why}"
        self.comm.Free()
        if _WORLD is self:
            _WORLD = None

    def node_of(self, rank: int) -> int:
        """Node index of world rank ``rank``."""
        return self._node_of[rank]

    def ranks_of_node(self, node: int) -> tuple[int, ...]:
        """World ranks on node ``node``."""
        return tuple(r for r, n in enumerate(self._node_of) if n == node)

    @property
    def uniform(self) -> bool:
        """True when every node has the same number of ranks (rails span every node)."""
        return len({len(self.ranks_of_node(n)) for n in range(self.num_nodes)}) == 1

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}, size={self.size}, node={self.node}/{self.num_nodes}, "
                f"local_rank={self.local_rank}/{self.local_size}"
                f"{', emulated' if self.emulated else ''})")


def _refuse_nodes_across_hosts(comm, per_node: int, nodes: list[int], leader: list[int]) -> None:
    """ValueError on every rank when an emulated node holds ranks of different real hosts:
    an emulated node only subdivides a host (its ranks share memory and the host's links;
    symmetric buffers and intra-node algorithms rely on it). Every rank decides from the
    same gathered facts, so all raise together."""
    spans = [n for n in sorted(set(nodes))
             if len({leader[r] for r in range(len(nodes)) if nodes[r] == n}) > 1]
    if not spans:
        return
    import socket

    names = comm.allgather(socket.gethostname())
    node = spans[0]
    members = [r for r in range(len(nodes)) if nodes[r] == node]
    parts = []
    for lead in dict.fromkeys(leader[r] for r in members):
        ranks = [r for r in members if leader[r] == lead]
        parts.append(f"{names[lead]} (ranks {_span(ranks)})")
    fits = [k for k in range(1, per_node) if len(nodes) % k == 0
            and all(len({leader[r] for r in range(i, i + k)}) == 1
                    for i in range(0, len(nodes), k))]
    hint = f" (here {', '.join(map(str, fits))})" if fits else ""
    raise ValueError(
        f"NEOCOMM_RANKS_PER_NODE={per_node} (--ranks-per-node): emulated node {node} (ranks "
        f"{_span(members)}) spans {len(parts)} hosts: {', '.join(parts)}; an emulated node "
        f"only subdivides one host. Use a value that splits each host's ranks{hint}, or "
        f"none: real hosts are found without it")


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks[-1] - ranks[0] == len(ranks) - 1 \
        else ", ".join(map(str, ranks))


def _bind_device(host_rank: int) -> int | None:
    """Bind the GPU of this rank's place on its real host (``host_rank``), never its
    place in an emulated node: emulated nodes share the host's GPUs. CuPy is asked only
    when this process has imported it already or the CUDA driver reports a device: on a
    host without a GPU, importing it would cost every rank most of a second."""
    import sys

    from neocomm.cuda_libs import driver_devices

    if "cupy" not in sys.modules and driver_devices() < 1:
        return None
    try:
        import cupy
    except ImportError:
        return None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, no device
        return None
    if count == 0:
        return None
    device = host_rank % count
    cupy.cuda.Device(device).use()
    return device


def init(comm=None, *, ranks_per_node: int | None = None) -> World:
    """Bootstrap neocomm from MPI and return the :class:`World` (idempotent).

    ``comm`` defaults to a duplicate of ``MPI.COMM_WORLD`` (neocomm's traffic
    never mixes with the application's). ``ranks_per_node`` overrides
    ``NEOCOMM_RANKS_PER_NODE``. Installs the stall watchdog and, unless
    ``NEOCOMM_ABORT_ON_EXCEPTION=0``, a hook that aborts the whole job when
    any rank dies of an unhandled exception.
    """
    global _WORLD
    if _WORLD is not None and comm is None and ranks_per_node is None:
        return _WORLD
    from neocomm.mpistart import start_mpi

    start_mpi()
    from mpi4py import MPI

    settings = config.settings()
    from neocomm.hostmem import keep_freed_memory

    keep_freed_memory(settings["HOST_KEEP_FREED"])
    if comm is None:
        _refuse_a_foreign_launcher(MPI.COMM_WORLD.Get_size())
    base = (comm or MPI.COMM_WORLD).Dup()
    k = settings["RANKS_PER_NODE"] if ranks_per_node is None else int(ranks_per_node)
    from neocomm.agree import Problem, agree

    problem = None
    if k < 0:
        problem = Problem("ranks_per_node", f"ranks_per_node: expected >= 0, got {k}")
    agree(base, "init", problem, [("ranks_per_node", k)])
    world = World(base, k)
    if settings["ABORT_ON_EXCEPTION"]:
        install_abort_hook(world.rank)
    watchdog.configure(settings["TIMEOUT"], world.rank, comm=base.Dup())
    _log.debug("initialised %r", world)
    _WORLD = world
    return world


def _refuse_a_foreign_launcher(mpi_size: int) -> None:
    """NeocommError when torchrun started more processes than MPI sees: each would
    otherwise go on as a world of its own, training apart without a word."""
    import os

    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    try:
        launched = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if launched > mpi_size:
        from neocomm.errors import NeocommError

        raise NeocommError(
            f"neocomm.init: torchrun started this process as rank "
            f"{os.environ.get('RANK', '?')} of {launched} (WORLD_SIZE={launched}), but MPI "
            f"sees {mpi_size} rank(s): MPI cannot join processes it did not start. Launch "
            f"with `neocomm run -n {launched} -- python ...` (or mpirun/srun) and start "
            f"torch.distributed from neocomm's world (embedding.torch.init_process_group); "
            f"pass comm=MPI.COMM_SELF to run a one-rank world in each process on purpose")


def current_world() -> World:
    """The World of the last :func:`init` (initialising on first use)."""
    return _WORLD if _WORLD is not None else init()


def rank_device() -> int | None:
    """The GPU this rank's device collectives run on (None: no world yet, or no GPU)."""
    return _WORLD.device if _WORLD is not None else None


def group_or_world(group):
    """``group``, or the world group of :func:`current_world` when it is None; TypeError
    naming what was given when it is neither. A :class:`World` stands for its world
    group."""
    if group is None:
        return current_world().world
    if isinstance(group, World):
        group = group.world
    if not (hasattr(group, "comm") and hasattr(group, "backend")):
        raise TypeError(f"group: expected a neocomm ProcessGroup (world.world, "
                        f"world.intra_node, world.rail, or one from ProcessGroup.split) or "
                        f"None for the world, got {type(group).__name__} {group!r:.60}")
    gone = getattr(group, "gone", None)
    if gone is not None:
        from neocomm.errors import GroupGoneError

        raise GroupGoneError(gone, ranks=group.ranks)
    return group


def install_abort_hook(rank: int) -> None:
    """An unhandled exception prints its traceback with the rank and aborts the job.

    Without this, the other ranks would wait forever in their next collective.
    """
    def hook(etype, value, tb):
        text = "".join(traceback.format_exception(etype, value, tb))
        try:
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a closed or odd stream: the message goes anyway
            pass
        # straight to file descriptor 2: a hook chained in front of this one (torch.distributed
        # installs one) may have pointed sys.stderr at a buffer it prints after we return,
        # and we do not return
        message = (f"neocomm: rank {rank} failed with an unhandled exception; aborting the "
                   f"job.\n{text}").encode("utf-8", "replace")
        while message:
            try:
                message = message[os.write(2, message):]
            except OSError:
                break
        try:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        finally:
            os._exit(1)

    sys.excepthook = hook
