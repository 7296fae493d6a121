"""Bandwidth of a job's links, measured over the runtime: ``neocomm fabric validate --measure``.

:func:`measure` times point-to-point transfers of one pair of ranks inside a
node and of one pair across nodes, and the all-reduce bus bandwidth, on host
buffers through the world group's backend. It returns plain numbers (GB/s per
link class) and notes; :func:`topology.validate` checks them against a fabric
spec's ``[bandwidth]`` minimums.
"""
from __future__ import annotations

from topology.sizes import MIB, format_size

__all__ = ["measure"]


def measure(world, cluster, nbytes: int = 32 * MIB, iters: int = 5):
    """Measured GB/s per link class and how each was measured (collective).

    Point-to-point: rank a streams ``iters`` messages of ``nbytes`` to rank b
    after a warm-up, timed at b; one pair inside a node, one across nodes. The
    class is the physical path: ``shm`` when both ranks share a host (emulated
    nodes included), else the inter-node link of the cluster. All-reduce bus
    bandwidth uses nccl-tests' factor 2(n-1)/n on float32 buffers. ``world`` is
    the job's :class:`~neocomm.world.World` (:func:`neocomm.init`): its
    ``comm``, ``size`` and the host backend of its ``world`` group are used.
    """
    import numpy as np

    from topology import inter_node_kind

    group = world.world
    buf = np.zeros(nbytes, dtype=np.uint8)
    backend = group.backend(buf)
    nodes = cluster.nodes
    pairs = []
    intra = next((n for n in nodes if len(n) >= 2), None)
    if intra is not None:
        pairs.append(("same node", intra[0], intra[1]))
    if len(nodes) >= 2:
        pairs.append(("different nodes", nodes[0][0], nodes[1][0]))
    results: dict[str, float] = {}
    notes: dict[str, str] = {}
    size = format_size(nbytes)
    for where, a, b in pairs:
        same_host = cluster.ranks[a].host == cluster.ranks[b].host
        cls = "shm" if same_host else inter_node_kind(cluster).value
        gbs = _p2p(world, backend, buf, a, b, iters)
        note = (f"ranks {a}->{b} {where}, {'same host' if same_host else 'two hosts'}: "
                f"{gbs:.3g} GB/s")
        # a class measured twice keeps its slower figure; the note shows both
        notes[cls] = f"{notes[cls]}; {note}" if cls in notes else note
        results[cls] = min(gbs, results.get(cls, gbs))
    for cls in results:
        notes[cls] += f"; {size} x {iters}"
    if world.size >= 2:
        results["allreduce_bus"] = _allreduce(world, backend, nbytes, iters)
        notes["allreduce_bus"] = f"{world.size} ranks, float32; {size} x {iters}"
    else:
        notes["allreduce_bus"] = "not measured: needs at least 2 ranks"
    if not pairs:
        for cls in ("shm", "tcp", "roce", "infiniband"):
            notes[cls] = "not measured: needs at least 2 ranks"
    for cls in ("nvlink", "pcie"):
        notes.setdefault(cls, "not measured: --measure moves host buffers only")
    return results, notes


def _p2p(world, backend, buf, a: int, b: int, iters: int) -> float:
    from mpi4py import MPI

    comm = world.comm
    rank = comm.Get_rank()
    seconds = 0.0
    for rep in range(iters + 1):  # the first round is a warm-up
        comm.Barrier()
        t0 = MPI.Wtime()
        if rank == a:
            backend.send(buf, b, tag=17)
        elif rank == b:
            backend.recv(buf, a, tag=17)
        if rep:
            seconds += MPI.Wtime() - t0
    gbs = buf.nbytes * iters / seconds / 1e9 if rank == b and seconds > 0 else 0.0
    return comm.bcast(gbs, root=b)


def _allreduce(world, backend, nbytes: int, iters: int) -> float:
    import numpy as np
    from mpi4py import MPI

    comm = world.comm
    n = world.size
    data = np.ones(max(nbytes // 4, 1), dtype=np.float32)
    backend.all_reduce(data)  # warm-up
    comm.Barrier()
    t0 = MPI.Wtime()
    for _ in range(iters):
        backend.all_reduce(data)
    elapsed = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
    algbw = data.nbytes * iters / elapsed / 1e9
    return algbw * 2 * (n - 1) / n
