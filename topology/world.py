"""World discovery: each host probed once, gathered over MPI into one cluster topology.

Topology sits below the runtime, so it takes what it needs as arguments: an
mpi4py communicator and the runtime node index of every rank (the runtime
passes ``world.comm`` and its node grouping, emulated nodes included). Only
builtin dicts and strings cross the wire (mpi4py's lowercase ``allgather``),
never the model's own types.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

from topology._common import natural_key
from topology.host import assign_nics, discover_host
from topology.sysfs import probe_hostname
from topology.types import (ClusterTopology, HostTopology, RankPlacement, TopologyError,
                            from_dict, to_dict)

__all__ = ["discover_world", "place_ranks"]


def discover_world(comm, node_of_rank: Sequence[int], *, host: HostTopology | None = None,
                   root: str | Path = "/", probe: Callable[..., HostTopology] | None = None,
                   **probe_kwargs) -> ClusterTopology:
    """Gather the topology of every host of the job onto every rank.

    ``comm``: an mpi4py communicator over the job. ``node_of_rank[r]``: the
    runtime node index of rank r (``len == comm.size``). Ranks are grouped by
    host name; the lowest rank of each host probes it (``probe``, default
    :func:`~topology.host.discover_host` with ``root`` and ``probe_kwargs``)
    unless ``host`` is given (then it is used as this rank's host). A probe
    that raises on one rank raises :class:`TopologyError` on every rank.
    Collective: every rank of ``comm`` must call it.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    nodes = [int(n) for n in node_of_rank]
    error = None
    if len(nodes) != size:
        error = f"node_of_rank: expected {size} entries (one per rank), got {len(nodes)}"
    elif any(n < 0 for n in nodes):
        error = f"node_of_rank: expected node indices >= 0, got {nodes}"
    if host is not None and not isinstance(host, HostTopology):
        error = f"host: expected HostTopology or None, got {type(host).__name__}"
    hostname = ""
    if error is None:
        try:
            hostname = host.hostname if host is not None else probe_hostname(root)
        except Exception as exc:  # pragma: no cover - hostname probing does not raise
            error = f"{type(exc).__name__}: {exc}"
    names = comm.allgather({"host": hostname, "error": error})
    _raise_errors(names, "argument check")
    hostnames = [d["host"] for d in names]
    payload, error = None, None
    if hostnames.index(hostname) == rank:
        try:
            if host is None:
                host = (probe or discover_host)(root=root, **probe_kwargs)
            payload = to_dict(host)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    gathered = comm.allgather({"host": payload, "error": error})
    _raise_errors(gathered, "host discovery")
    hosts = []
    for r, item in enumerate(gathered):
        if item["host"] is not None:
            h = from_dict(HostTopology, item["host"], where=f"host of rank {r}")
            if h.hostname != hostnames[r]:
                h = dataclasses.replace(h, hostname=hostnames[r])
            hosts.append(h)
    return ClusterTopology(tuple(hosts), place_ranks(hosts, hostnames, nodes))


def _raise_errors(items: list[dict], stage: str) -> None:
    errors = {r: d["error"] for r, d in enumerate(items) if d.get("error")}
    if errors:
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
        raise TopologyError(f"world discovery failed at {stage} on rank(s) "
                            f"{sorted(errors)}: {detail}")


def place_ranks(hosts: Sequence[HostTopology], hostnames: Sequence[str],
                nodes: Sequence[int]) -> tuple[RankPlacement, ...]:
    """Rank placements: the k-th rank of a host gets its k-th GPU (round robin when
    there are more ranks than GPUs) and that GPU's own NIC (see
    :func:`~topology.host.assign_nics`; the nearest active one when GPUs
    outnumber NICs)."""
    by_name = {h.hostname: h for h in hosts}
    seen_host: dict[str, int] = {}
    seen_node: dict[int, int] = {}
    out = []
    for r, (name, node) in enumerate(zip(hostnames, nodes)):
        k = seen_host.get(name, 0)
        seen_host[name] = k + 1
        local = seen_node.get(node, 0)
        seen_node[node] = local + 1
        h = by_name[name]
        gpu = nic = None
        if h.gpus:
            gpu = h.gpus[k % len(h.gpus)].index
            nic = _nic_for(h, gpu)
        out.append(RankPlacement(r, name, node, local, gpu, nic))
    return tuple(out)


def _nic_for(h: HostTopology, gpu: int) -> str | None:
    active = [n for n in h.nics if n.active]
    own = assign_nics(h, active).get(gpu)
    if own is not None:
        return own.nic
    pairs = sorted((p for p in h.gpu_nic if p.gpu == gpu and p.nic in {n.name for n in active}),
                   key=lambda p: (p.path.distance, natural_key(p.nic)))
    return pairs[0].nic if pairs else None
