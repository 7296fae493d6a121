"""Link parameters for the cost models: bandwidth and latency per link class.

:func:`link_model` turns a discovered :class:`~topology.types.ClusterTopology`
into ``{LinkKind: LinkParams(bandwidth bytes/s, latency s)}``: NVLink from the
lane count times the per-lane rate of the GPU generation, PCIe from the GPU's
PCIe generation, RoCE/InfiniBand from the NIC port rate, TCP from the
interface speed, shared memory from a memory-copy figure. Bandwidths are one
direction, peak (line rate), not measured; ``neocomm fabric validate --measure``
measures the real thing.
"""
from __future__ import annotations

from typing import NamedTuple

from topology.types import ClusterTopology, HostTopology, LinkKind

__all__ = ["LinkParams", "link_model", "nvlink_generation", "nvlink_lane_bandwidth",
           "nvlink_max_lanes", "pcie_bandwidth", "nic_bandwidth", "inter_node_kind",
           "intra_node_kind", "memory_bandwidth", "compute_rate", "LATENCY", "SHM_BANDWIDTH",
           "TCP_DEFAULT_GBPS"]


class LinkParams(NamedTuple):
    """Peak one-direction ``bandwidth`` in bytes/s and per-message ``latency`` in s."""

    bandwidth: float
    latency: float


# NVLink: per link (lane), one direction, bytes/s, by NVLink generation. From NVIDIA's
# architecture whitepapers: P100 NVLink1 160 GB/s bidirectional over 4 links; V100
# NVLink2 300 GB/s over 6 links; A100 NVLink3 600 GB/s over 12 links; H100 NVLink4
# 900 GB/s over 18 links; B200 NVLink5 1.8 TB/s over 18 links.
_NVLINK = {1: (20e9, 4), 2: (25e9, 6), 3: (25e9, 12), 4: (25e9, 18), 5: (50e9, 18)}

# GPU name -> (NVLink generation, PCIe generation). PCIe per the product datasheets
# (V100 Gen3, A100 Gen4, H100 Gen5, B200 Gen5); first match wins.
_GENERATIONS = [("GB200", 5, 5), ("B200", 5, 5), ("B100", 5, 5), ("GH200", 4, 5),
                ("H200", 4, 5), ("H100", 4, 5), ("H800", 4, 5), ("A100", 3, 4),
                ("A800", 3, 4), ("V100", 2, 3), ("P100", 1, 3)]

# PCIe x16, one direction, bytes/s: GT/s per lane x 16 lanes x encoding / 8 bits
# (PCI-SIG: Gen3 8 GT/s 128b/130b = 15.75 GB/s; Gen4 16 GT/s = 31.5 GB/s; Gen5 32 GT/s
# = 63 GB/s).
_PCIE_X16 = {3: 15.75e9, 4: 31.5e9, 5: 63.0e9}

#: Latency per message, seconds. NVLink, PCIe and network figures are NCCL's
#: per-hop hardware latencies (src/graph/tuning.cc ``hwLat``, Tree/LL: NVLink 0.5 us,
#: PCI 1.0 us, NET 5.0 us). Shared memory: Open MPI's sm/vader transport delivers a
#: small message in well under a microsecond; taken as 1 us. TCP: a kernel TCP
#: one-way small-message latency on a datacenter LAN is tens of microseconds
#: (netperf TCP_RR round trips of 40-100 us); taken as 30 us.
LATENCY = {LinkKind.NVLINK: 0.5e-6, LinkKind.PCIE: 1.0e-6, LinkKind.ROCE: 5.0e-6,
           LinkKind.INFINIBAND: 5.0e-6, LinkKind.SHM: 1.0e-6, LinkKind.TCP: 30e-6}

#: Shared-memory bandwidth between two processes of one host, bytes/s. A one-core
#: memcpy of large buffers runs at 13-17 GB/s on our 2-core development class
#: (DESIGN.md section 7); MPI's shared-memory path copies twice (into and out of a
#: shared segment), so we take half of the low end: 6.5 GB/s.
SHM_BANDWIDTH = 6.5e9

#: TCP line rate assumed when the kernel does not report an interface speed
#: (virtual NICs report -1), Gb/s: a common 10 GbE datacenter port.
TCP_DEFAULT_GBPS = 10.0


# Device memory throughput, bytes/s, from NVIDIA's product datasheets (HBM peak):
# V100 SXM2 900 GB/s; A100 40GB 1555 GB/s; A100 80GB SXM 2039 GB/s; H100 PCIe
# 2.0 TB/s; H100 SXM 3.35 TB/s; H200 4.8 TB/s; B200 8 TB/s. Most specific first.
_MEMORY = [("B200", 8.0e12), ("H200", 4.8e12), ("H100 PCIE", 2.0e12), ("H100", 3.35e12),
           ("A100-SXM4-80GB", 2.039e12), ("A100 80GB", 2.039e12), ("A100", 1.555e12),
           ("V100", 0.9e12)]


# Peak FP32 (non-tensor-core) throughput, FLOP/s, from NVIDIA's product datasheets: V100 SXM2
# 15.7 TFLOPS; A100 19.5; H100 PCIe 51.2; H100 SXM and H200 66.9. (cuBLAS keeps FP32 GEMMs
# off the TF32 tensor cores unless asked, as CuPy and PyTorch do by default.)
_FP32 = [("H200", 66.9e12), ("H100 PCIE", 51.2e12), ("H100", 66.9e12), ("A100", 19.5e12),
         ("V100", 15.7e12)]


def compute_rate(gpu_name: str) -> float:
    """Peak FP32 floating-point operations per second of a GPU model; 0.0 when unknown."""
    return _by_model(_FP32, gpu_name)


def _by_model(table, gpu_name: str) -> float:
    """The figure of the first key of ``table`` in the GPU's name; 0.0 when none is."""
    upper = gpu_name.upper()
    return next((value for key, value in table if key in upper), 0.0)


def memory_bandwidth(gpu_name: str) -> float:
    """Peak device memory throughput of a GPU model in bytes/s; 0.0 when unknown."""
    return _by_model(_MEMORY, gpu_name)


def nvlink_generation(gpu_name: str) -> int | None:
    """NVLink generation of a GPU model name (``NVIDIA A100-SXM4-80GB`` -> 3)."""
    upper = gpu_name.upper()
    for key, nvl, _ in _GENERATIONS:
        if key in upper:
            return nvl
    return None


def nvlink_lane_bandwidth(gpu_name: str) -> float:
    """Bytes/s per NVLink lane and direction; NVLink3's 25 GB/s when the model is unknown."""
    gen = nvlink_generation(gpu_name)
    return _NVLINK[gen if gen is not None else 3][0]


def nvlink_max_lanes(gpu_name: str) -> int | None:
    """NVLink links per GPU of the model (A100: 12), None when unknown."""
    gen = nvlink_generation(gpu_name)
    return _NVLINK[gen][1] if gen is not None else None


def pcie_bandwidth(gpu_name: str) -> float:
    """Bytes/s of the GPU's PCIe x16 link, one direction (Gen3 when the model is unknown)."""
    upper = gpu_name.upper()
    gen = next((pcie for key, _, pcie in _GENERATIONS if key in upper), 3)
    return _PCIE_X16[gen]


def nic_bandwidth(rate_gbps: float) -> float:
    """Bytes/s of a port with ``rate_gbps`` Gb/s line rate."""
    return rate_gbps * 1e9 / 8


def _rdma_nics(host: HostTopology):
    return [n for n in host.nics if n.active]


def inter_node_kind(cluster: ClusterTopology) -> LinkKind:
    """Link class between nodes: InfiniBand or RoCE when every host has an
    active port of that kind (InfiniBand preferred), else TCP."""
    if not cluster.hosts:
        return LinkKind.TCP
    for kind in (LinkKind.INFINIBAND, LinkKind.ROCE):
        if all(any(n.link_kind is kind for n in _rdma_nics(h)) for h in cluster.hosts):
            return kind
    return LinkKind.TCP


def intra_node_kind(cluster: ClusterTopology, device: bool = True) -> LinkKind:
    """Link class between ranks of one node: NVLink when every GPU host's GPUs
    are NVLinked, PCIe for GPUs without it, shared memory for host buffers
    (``device=False``) or CPU-only hosts."""
    gpu_hosts = [h for h in cluster.hosts if h.gpus]
    if not device or not gpu_hosts or len(gpu_hosts) != len(cluster.hosts):
        return LinkKind.SHM
    if all(any(link.kind is LinkKind.NVLINK for link in h.links) for h in gpu_hosts):
        return LinkKind.NVLINK
    return LinkKind.PCIE


def link_model(cluster: ClusterTopology | HostTopology) -> dict[LinkKind, LinkParams]:
    """``{link class: LinkParams(bandwidth bytes/s, latency s)}`` for the classes
    present in ``cluster``; each bandwidth is the slowest instance (the bottleneck).

    SHM and TCP are always present (every job has host memory and a TCP path);
    NVLink and PCIe when GPUs are; RoCE/InfiniBand per active NIC port kind.
    """
    if isinstance(cluster, HostTopology):
        cluster = ClusterTopology.single(cluster)
    out: dict[LinkKind, LinkParams] = {LinkKind.SHM: LinkParams(SHM_BANDWIDTH,
                                                                LATENCY[LinkKind.SHM])}
    nvlink = [link.bandwidth for h in cluster.hosts for link in h.links
              if link.kind is LinkKind.NVLINK and link.a.startswith("GPU")
              and link.b.startswith("GPU")]
    if nvlink:
        out[LinkKind.NVLINK] = LinkParams(min(nvlink), LATENCY[LinkKind.NVLINK])
    gpus = [g for h in cluster.hosts for g in h.gpus]
    if gpus:
        out[LinkKind.PCIE] = LinkParams(min(pcie_bandwidth(g.name) for g in gpus),
                                        LATENCY[LinkKind.PCIE])
    used = {(p.host, p.nic) for p in cluster.ranks if p.nic}
    for kind in (LinkKind.ROCE, LinkKind.INFINIBAND):
        rates = [n.rate_gbps for h in cluster.hosts for n in _rdma_nics(h)
                 if n.link_kind is kind and (not used or (h.hostname, n.name) in used)]
        rates = rates or [n.rate_gbps for h in cluster.hosts for n in _rdma_nics(h)
                          if n.link_kind is kind]
        if rates:
            out[kind] = LinkParams(nic_bandwidth(min(rates)), LATENCY[kind])
    speeds = []
    for h in cluster.hosts:
        up = [i.speed_gbps for i in h.interfaces if i.state == "up" and i.speed_gbps]
        speeds.append(max(up) if up else TCP_DEFAULT_GBPS)
    out[LinkKind.TCP] = LinkParams(nic_bandwidth(min(speeds) if speeds else TCP_DEFAULT_GBPS),
                                   LATENCY[LinkKind.TCP])
    return out
