"""Hardware numbers for the planner from the topology layer's host model and link model.

A target host is a discovered :class:`~topology.types.HostTopology`: one of
the captured hosts shipped with :mod:`topology` (``dgx-a100``, ``dgx1-v100``,
``cpu-host`` …) or a topology JSON file written by ``neocomm topo --json``.
Its links are priced by :func:`topology.linkmodel.link_model` (between ranks
of a node: NVLink, else PCIe, else shared memory; between nodes: InfiniBand,
else RoCE, else TCP, one flow per active NIC of that kind) and its GPUs give
the device memory and the ranks per node.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import replace

from collectives.types import FabricModel, Link
from embedding.planner.types import Hardware

__all__ = ["load_host", "host_names", "fabric_of_host", "hardware_for_host",
           "device_bandwidth_of_host"]


def host_names() -> list[str]:
    """Names of the captured hosts :func:`load_host` accepts."""
    from topology.snapshot import fixture_names

    return fixture_names()


def load_host(spec: str):
    """The :class:`~topology.types.HostTopology` of a captured host name or a JSON file.

    A JSON file may hold a host or a cluster (its first host is taken).
    ValueError names the known hosts when ``spec`` is neither.
    """
    from topology import types as ttypes

    if os.path.isfile(spec):
        try:
            with open(spec, encoding="utf-8") as fh:
                text = fh.read()
            data = ttypes.from_json(text)
        except (OSError, ValueError) as exc:
            raise ValueError(f"fabric: cannot read a topology from {spec!r}: {exc}") from None
        if isinstance(data, ttypes.ClusterTopology):
            if not data.hosts:
                raise ValueError(f"fabric: {spec!r} holds a cluster without hosts")
            return data.hosts[0]
        if isinstance(data, ttypes.HostTopology):
            return data
        raise ValueError(f"fabric: {spec!r} holds a {type(data).__name__}, expected a host "
                         f"or cluster topology")
    names = host_names()
    if spec not in names:
        raise ValueError(f"fabric: expected a captured host {names} or a topology JSON "
                         f"file, got {spec!r}")
    from topology.host import discover_host
    from topology.snapshot import fixture
    from topology.types import ProbeWarning

    fx = fixture(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)
        return discover_host(fx.root, nvidia_smi_topo=fx.nvidia_smi_topo,
                             nvidia_smi_query=fx.nvidia_smi_query, live=False)


def fabric_of_host(host) -> FabricModel:
    """A :class:`FabricModel` with the links of ``host`` (shape: one rank, one node;
    :class:`Hardware` gives it the plan's shape)."""
    from topology import linkmodel
    from topology.types import ClusterTopology, LinkKind

    cluster = ClusterTopology.single(host)
    params = linkmodel.link_model(cluster)
    intra_kind = linkmodel.intra_node_kind(cluster, device=bool(host.gpus))
    inter_kind = linkmodel.inter_node_kind(cluster)
    intra, inter = params[intra_kind], params[inter_kind]
    nics = 1
    if inter_kind in (LinkKind.INFINIBAND, LinkKind.ROCE):
        nics = max(1, sum(1 for n in host.nics if n.active and n.link_kind is inter_kind))
    base = FabricModel()
    return replace(base, intra=Link(intra.latency, intra.bandwidth, base.intra.chunk_bytes),
                   inter=Link(inter.latency, inter.bandwidth, base.inter.chunk_bytes),
                   nics_per_node=nics,
                   source=f"link model of host {host.hostname}: {intra_kind.value} within "
                          f"a node, {nics} x {inter_kind.value} between nodes")


def device_bandwidth_of_host(host) -> float:
    """Device memory throughput of the host's GPUs (bytes/s) from the topology
    layer's link model, when the link model knows it; 0.0 otherwise."""
    from topology import linkmodel

    lookup = getattr(linkmodel, "memory_bandwidth", None)
    if lookup is None or not host.gpus:
        return 0.0
    rates = [lookup(g.name) for g in host.gpus]
    return float(min(rates)) if all(rates) else 0.0


def hardware_for_host(host, world_size: int, *, ranks_per_node: int | None = None,
                      device_memory: int | None = None, reserve: float = 0.0,
                      min_column_dim: int = 32,
                      memory_bandwidth: float | None = None) -> Hardware:
    """:class:`Hardware` of ``world_size`` ranks on hosts like ``host``.

    ``ranks_per_node`` defaults to the host's GPUs (its CPUs without GPUs,
    at most ``world_size``); ``device_memory`` to its smallest GPU's memory;
    ``memory_bandwidth`` (bytes/s) to :func:`device_bandwidth_of_host`.
    """
    if memory_bandwidth is None:
        memory_bandwidth = device_bandwidth_of_host(host)
    if ranks_per_node is None:
        per_host = len(host.gpus) or max(1, host.cpus)
        ranks_per_node = max(1, min(per_host, world_size))
    if device_memory is None:
        sizes = [g.memory_bytes for g in host.gpus if g.memory_bytes]
        if not sizes:
            raise ValueError(f"memory: host {host.hostname!r} reports no GPU memory; give "
                             f"the device memory explicitly")
        device_memory = min(sizes)
    return Hardware(world_size=world_size, ranks_per_node=ranks_per_node,
                    device_memory=int(device_memory), fabric=fabric_of_host(host),
                    reserve=reserve, min_column_dim=min_column_dim,
                    memory_bandwidth=float(memory_bandwidth))
