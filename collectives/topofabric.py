"""The fabric model from the discovered topology (:mod:`topology`).

Link parameters come from :func:`topology.link_model`: the intra-node link
class (NVLink or PCIe for device buffers, shared memory for host buffers),
the inter-node class (InfiniBand, RoCE or TCP; shared memory when the nodes
are emulated on one host) and the number of active RDMA NICs per node.
Chunk sizes per link class are ours (below, with their sources).
"""
from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass, replace

from collectives.types import (DEFAULT_COPY_BANDWIDTH, DEFAULT_REDUCE_BANDWIDTH, FabricModel,
                               LinkCost)

__all__ = ["fabric_from_topology", "fabric_from_spec", "spec_links", "discover_group_topology",
           "CHUNK_BYTES", "TERMS", "TCP_TERMS", "Term", "apply_model", "model_key"]

_log = logging.getLogger(__name__)

#: Chunk size per link class, bytes. NVLink and network: NCCL's point-to-point
#: chunk sizes (512 KiB over NVLink, 128 KiB over the network; DESIGN.md
#: section 7); PCIe as NVLink. Shared memory: 4 MiB. Over shared memory the
#: receiving process copies every message itself (single-copy CMA) and only
#: while it is inside MPI, so a chunk buys little overlap and costs a
#: rendezvous; in our chunk sweep (docs/collectives.md, "Chunk size") 1, 2
#: and 4 MiB chunks were within the noise of each other and 4 MiB best at 4
#: and 16 MiB. TCP: 256 KiB, a few socket buffers.
CHUNK_BYTES = {"nvlink": 512 << 10, "pcie": 512 << 10, "shm": 4 << 20, "roce": 128 << 10,
               "infiniband": 128 << 10, "tcp": 256 << 10}


def fabric_from_topology(cluster, *, device: bool = False) -> FabricModel:
    """A :class:`FabricModel` (shape of ``cluster``) from a ``topology.ClusterTopology``."""
    from topology import inter_node_kind, intra_node_kind, link_model
    from topology.linkmodel import memory_bandwidth
    from topology.types import LinkKind

    links = link_model(cluster)
    intra_kind = intra_node_kind(cluster, device=device)
    inter_kind = LinkKind.SHM if cluster.emulated else inter_node_kind(cluster)

    def link(kind) -> LinkCost:
        params = links.get(kind) or links[LinkKind.SHM]
        return LinkCost(latency=params.latency, bandwidth=params.bandwidth,
                    chunk_bytes=CHUNK_BYTES.get(kind.value, 1 << 20), kind=kind.value)

    nics = 1
    if inter_kind in (LinkKind.ROCE, LinkKind.INFINIBAND) and cluster.hosts:
        nics = max(1, min(sum(1 for n in h.nics if n.active and n.link_kind is inter_kind)
                          for h in cluster.hosts))
    copy_bw, reduce_bw = _local_rates([memory_bandwidth(g.name) for h in cluster.hosts
                                       for g in h.gpus] if device else [])
    nodes = max(1, cluster.num_nodes)
    per_node = max((len(n) for n in cluster.nodes), default=1) or 1
    return FabricModel(ranks_per_node=per_node, nodes=nodes, intra=link(intra_kind),
                       inter=link(inter_kind), nics_per_node=nics, copy_bandwidth=copy_bw,
                       reduce_bandwidth=reduce_bw,
                       source=f"topology: {intra_kind.value} within nodes, "
                              f"{inter_kind.value} x{nics} between nodes")


def _local_rates(memory_bandwidths) -> tuple[float, float]:
    """``(copy, reduce)`` bytes/s: from the slowest GPU's memory throughput (a device copy
    reads and writes; an in-place add streams three arrays), the host's defaults without."""
    mem = [m for m in memory_bandwidths if m > 0]
    if not mem:
        return DEFAULT_COPY_BANDWIDTH, DEFAULT_REDUCE_BANDWIDTH
    return min(mem) / 2, min(mem) / 3


def spec_links(spec, *, device: bool) -> FabricModel:
    """The links a fabric spec (:mod:`topology.spec`) declares, at their line rates, in a
    :class:`FabricModel` of one rank (give it a shape with ``with_shape``).

    ``device`` prices device buffers: NVLink inside a node at the spec's
    ``min_bandwidth_gbs`` (else lanes x the lane rate of the GPU generation), PCIe
    without ``[nvlink]``, the GPUs' memory for local copies and reductions; host
    buffers go over shared memory. Between nodes: ``[nic] count`` ports of
    ``min_rate_gbps`` each; without a ``[nic]`` table, TCP over ``[tcp] count`` ports of
    ``rate_gbps`` each (one port of :data:`~topology.linkmodel.TCP_DEFAULT_GBPS` when the
    spec has no ``[tcp]`` either).
    """
    from topology.linkmodel import (LATENCY, SHM_BANDWIDTH, TCP_DEFAULT_GBPS, memory_bandwidth,
                                    nic_bandwidth, nvlink_lane_bandwidth, pcie_bandwidth)
    from topology.types import LinkKind, LinkLayer

    def link(kind, bandwidth: float) -> LinkCost:
        return LinkCost(latency=LATENCY[kind], bandwidth=bandwidth,
                    chunk_bytes=CHUNK_BYTES.get(kind.value, 1 << 20), kind=kind.value)

    if not device:
        intra, what = link(LinkKind.SHM, SHM_BANDWIDTH), "shm"
    elif spec.nvlink is not None:
        bw = (spec.nvlink.min_bandwidth_gbs * 1e9 if spec.nvlink.min_bandwidth_gbs else
              spec.nvlink.min_lanes * nvlink_lane_bandwidth(spec.gpu_model))
        intra, what = link(LinkKind.NVLINK, bw), "nvlink"
    else:
        intra, what = link(LinkKind.PCIE, pcie_bandwidth(spec.gpu_model)), "pcie"
    nics = 1
    if spec.nic is not None:
        kind = LinkKind.INFINIBAND if spec.nic.link_layer is LinkLayer.INFINIBAND else \
            LinkKind.ROCE
        inter, nics = link(kind, nic_bandwidth(spec.nic.min_rate_gbps)), spec.nic.count
    else:
        kind = LinkKind.TCP
        rate = spec.tcp.rate_gbps if spec.tcp is not None else TCP_DEFAULT_GBPS
        inter = link(kind, nic_bandwidth(rate))
        nics = spec.tcp.count if spec.tcp is not None else 1
    copy_bw, reduce_bw = _local_rates([memory_bandwidth(spec.gpu_model)] if device else [])
    fabric = FabricModel(intra=intra, inter=inter, nics_per_node=nics, copy_bandwidth=copy_bw,
                         reduce_bandwidth=reduce_bw,
                         source=f"fabric spec {spec.name!r}: {what} within nodes, "
                                f"{kind.value} x{nics} between nodes (line rates)")
    model = dict(spec.model)
    if model and model.get("buffers") == ("device" if device else "host"):
        fabric = apply_model(fabric, model)
    return fabric


def fabric_from_spec(spec, ranks: int, ranks_per_node: int | None = None, *,
                     device: bool | None = None) -> FabricModel:
    """The :class:`FabricModel` of ``ranks`` ranks on the cluster a fabric spec declares:
    its links (:func:`spec_links`) in nodes of ``ranks_per_node``.

    ``ranks_per_node`` defaults to the spec's GPUs per node (on GPU-less nodes, the ranks
    spread evenly over the spec's nodes); ``device`` defaults to whether the nodes have
    GPUs. ValueError naming the value when the spec's cluster cannot hold the ranks.
    """
    ranks = int(ranks)
    if ranks < 1:
        raise ValueError(f"ranks: expected >= 1, got {ranks}")
    device = spec.gpus > 0 if device is None else bool(device)
    if device and spec.gpus == 0:
        raise ValueError(f"fabric {spec.name!r} has no GPUs ([node] gpus = 0): price host "
                         f"buffers instead")
    if ranks_per_node is not None:
        per_node = int(ranks_per_node)
    else:  # a rank per GPU; on GPU-less nodes the ranks spread evenly over the nodes
        per_node = spec.gpus if spec.gpus else -(-ranks // spec.nodes)
    if per_node < 1:
        raise ValueError(f"ranks_per_node: expected >= 1, got {ranks_per_node}")
    if device and per_node > spec.gpus:
        raise ValueError(f"ranks_per_node: {per_node} ranks per node need {per_node} GPUs, but a "
                         f"node of fabric {spec.name!r} has {spec.gpus}")
    if ranks % per_node:
        raise ValueError(f"ranks: {ranks} ranks do not fill nodes of {per_node} "
                         f"(ranks_per_node); use a multiple of {per_node}")
    nodes = ranks // per_node
    if nodes > spec.nodes:
        raise ValueError(f"ranks: {ranks} ranks at {per_node} per node need {nodes} nodes, but "
                         f"fabric {spec.name!r} has {spec.nodes} ({spec.nodes * per_node} ranks "
                         f"at most)")
    return spec_links(spec, device=device).with_shape(per_node, nodes)


_HOST = None


def discover_group_topology(group):
    """The ``ClusterTopology`` of a group (collective over the group; this host is
    probed once per process). None when discovery fails (on every rank alike)."""
    global _HOST
    from topology import TopologyError, discover_host, discover_world

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # probes warn about missing tools; not our business
        if _HOST is None:
            try:
                _HOST = discover_host()
            except Exception as exc:  # noqa: BLE001 - any probe failure: no host model
                _log.debug("host probe failed: %s", exc)
        node_of = [group.node_of(r) for r in range(group.size)]
        try:
            return discover_world(group.comm, node_of, host=_HOST)
        except (TopologyError, ValueError) as exc:
            _log.info("topology discovery failed (%s); using the default fabric model", exc)
            return None


@dataclass(frozen=True)
class Term:
    """One fitted term: its name in fabric files, unit, how to read and set it on a
    :class:`FabricModel`, and the shift that keeps it positive in log space."""

    name: str
    unit: str
    scale: float
    get: object
    set: object
    floor: float = 0.0
    #: the largest value (the fraction of a line rate: 1); a setter clamps to it
    ceiling: float = math.inf

    def value(self, fabric: FabricModel) -> float:
        return float(self.get(fabric))


def _link_term(which: str, field: str, unit: str, scale: float) -> Term:
    return Term(f"{which}_{field}", unit, scale, lambda f: getattr(getattr(f, which), field),
                lambda f, v: replace(f, **{which: replace(getattr(f, which), **{field: v})}))


def _field_term(name: str, field: str, unit: str, scale: float, floor: float = 0.0,
                ceiling: float = math.inf) -> Term:
    return Term(name, unit, scale, lambda f: getattr(f, field),
                lambda f, v: replace(f, **{field: min(v, ceiling)}), floor, ceiling)


#: Every term :func:`fit` may fit, with its name in a fabric file's ``[model]`` table
#: (value in ``unit``: the file's number times ``scale`` is the model's SI value).
TERMS = (
    _link_term("intra", "latency", "us", 1e-6),
    _link_term("intra", "bandwidth", "GB/s", 1e9),
    _link_term("inter", "latency", "us", 1e-6),
    _link_term("inter", "bandwidth", "GB/s", 1e9),
    _field_term("node_bandwidth", "node_bandwidth", "GB/s", 1e9),
    _field_term("copy_bandwidth", "copy_bandwidth", "GB/s", 1e9),
    _field_term("reduce_bandwidth", "reduce_bandwidth", "GB/s", 1e9),
    _field_term("step_overhead", "step_overhead", "us", 1e-6),
    _field_term("call_overhead", "call_overhead", "us", 1e-6),
    _field_term("cache_speedup", "cache_speedup", "x", 1.0, floor=1.0),
    _field_term("switch_latency", "switch_latency", "us", 1e-6),
    _field_term("page_cost", "page_cost", "us", 1e-6),
    _field_term("tcp_fraction", "tcp_fraction", "x", 1.0, ceiling=1.0),
    _field_term("tcp_copy_bandwidth", "tcp_copy_bandwidth", "GB/s", 1e9),
    _field_term("tcp_message_overhead", "tcp_message_overhead", "us", 1e-6),
    _field_term("tcp_call_overhead", "tcp_call_overhead", "us", 1e-6),
)

#: the terms of a TCP link between nodes (:class:`~collectives.types.FabricModel`): fitted
#: and written only for a fabric whose nodes talk TCP
TCP_TERMS = ("tcp_fraction", "tcp_copy_bandwidth", "tcp_message_overhead",
             "tcp_call_overhead")


def model_key(term: Term) -> str:
    """A term's key in a fabric file's ``[model]`` table."""
    return term.name + {"us": "_us", "GB/s": "_gbs"}.get(term.unit, "")


def apply_model(fabric: FabricModel, model: dict) -> FabricModel:
    """``fabric`` (links from a spec's line rates) with the terms of a ``[model]`` table:
    link classes, latencies, rates, overheads, cache and efficiency factors. A link of
    another class than the spec's (the shared memory between nodes emulated on one host)
    takes the chunk size of the spec's link of that class."""
    for which in ("intra", "inter"):
        kind = model.get(f"{which}_link")
        link = getattr(fabric, which)
        if kind and kind != link.kind:
            same = fabric.intra if fabric.intra.kind == kind else link
            fabric = replace(fabric, **{which: replace(link, kind=kind,
                                                       chunk_bytes=same.chunk_bytes)})
    for term in TERMS:
        if model_key(term) in model:
            fabric = term.set(fabric, float(model[model_key(term)]) * term.scale)
    fabric = replace(fabric, cache_bytes=int(float(model.get("cache_mib", 0)) * (1 << 20)),
                     cores_per_node=int(model.get("cores_per_node", 0)),
                     huge_page_bytes=int(float(model.get("huge_page_mib", 0)) * (1 << 20)),
                     algorithm_factors=tuple(sorted(
                         (str(k), float(v)) for k, v in model.get("factors", {}).items())),
                     overhead_factors=tuple(sorted(
                         (str(k), float(v)) for k, v in
                         model.get("overhead_factors", {}).items())))
    where = f" on {model['measured_on']}" if model.get("measured_on") else ""
    return replace(fabric, source=f"{fabric.source.split(':')[0]}: {fabric.intra.kind} within "
                                  f"nodes, {fabric.inter.kind} x{fabric.nics_per_node} between "
                                  f"nodes (calibrated{where})")
