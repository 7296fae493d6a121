"""Text rendering of a topology: a GPU/NIC matrix in the style of ``nvidia-smi
topo -m``, the NIC table, GPUDirect status, CPUs/NUMA and the node grouping."""
from __future__ import annotations

from topology import linkmodel
from topology._common import format_cpulist, natural_key
from topology.sizes import GIB
from topology.types import ClusterTopology, HostTopology, LinkKind

__all__ = ["render_host", "render_cluster", "render_link_model"]

_LEGEND = """Legend:
  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges
         within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks"""


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows)))]
    return ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]


def _matrix(h: HostTopology) -> list[str]:
    nic_names = sorted({n.name for n in h.nics}, key=natural_key)
    labels = [f"GPU{g.index}" for g in h.gpus] + [f"NIC{i}" for i in range(len(nic_names))]
    ends = [f"GPU{g.index}" for g in h.gpus] + nic_names
    numa_cpus = {n.id: n.cpus for n in h.numa_nodes}
    rows = [[""] + labels + ["CPU Affinity", "NUMA Affinity"]]
    for lab, a in zip(labels, ends):
        row = [lab]
        for b in ends:
            if a == b:
                row.append("X")
                continue
            link = h.link(a, b)
            if link is None:
                row.append("?")
            elif link.kind is LinkKind.NVLINK:
                row.append(f"NV{link.lanes}")
            else:
                row.append(link.path.value if link.path else "?")
        if a.startswith("GPU"):
            numa = h.gpu(int(a[3:])).numa
            row += [format_cpulist(numa_cpus.get(numa, ())) or "N/A",
                    "N/A" if numa is None else str(numa)]
        rows.append(row)
    out = _table(rows)
    out += ["", _LEGEND]
    if nic_names:
        out += ["", "NIC Legend:"] + [f"  NIC{i}: {n}" for i, n in enumerate(nic_names)]
    return out


def render_host(h: HostTopology) -> str:
    """Everything discovered about one host."""
    out = [f"host {h.hostname}: {h.cpus} CPUs, {len(h.numa_nodes)} NUMA node"
           f"{'s' * (len(h.numa_nodes) != 1)}; sources: {', '.join(h.sources) or 'none'}"]
    for n in h.numa_nodes:
        mem = f", {n.memory_bytes / GIB:.1f} GiB" if n.memory_bytes else ""
        out.append(f"  NUMA {n.id}: CPUs {format_cpulist(n.cpus) or '?'}{mem}")
    if h.cpu_only:
        out.append("CPU-only host: no NVIDIA GPU found; ranks exchange host buffers over "
                   "shared memory within the host and TCP or RDMA between hosts.")
    else:
        out.append("")
        out.append("GPUs:")
        rows = [["", "name", "uuid", "bus id", "memory", "NUMA", "NVLinks"]]
        for g in h.gpus:
            mem = f"{g.memory_bytes / GIB:g} GiB" if g.memory_bytes else "?"
            rows.append([f"GPU{g.index}", g.name or "?", g.uuid or "?", g.pci_bus_id or "?", mem,
                         "?" if g.numa is None else str(g.numa), str(g.nvlink_lanes)])
        out += ["  " + r for r in _table(rows)]
        out.append(f"  NVSwitch: {'yes' if h.nvswitch else 'no'}")
    if h.gpus or h.nics:
        out += ["", "Topology matrix:"] + _matrix(h)
    out.append("")
    if h.nics:
        out.append("RDMA NICs:")
        rows = [["", "port", "link layer", "state", "rate", "bus id", "NUMA"]]
        for n in h.nics:
            layer = "Ethernet (RoCE)" if n.link_layer.value == "Ethernet" else n.link_layer.value
            rows.append([n.name, str(n.port), layer, n.state.value, f"{n.rate_gbps:g} Gb/s",
                         n.pci_bus_id or "?", "?" if n.numa is None else str(n.numa)])
        out += ["  " + r for r in _table(rows)]
    else:
        out.append("RDMA NICs: none (no InfiniBand or RoCE device)")
    if h.interfaces:
        out.append("Network interfaces (TCP): " + ", ".join(
            f"{i.name} {i.state}" + (f" {i.speed_gbps:g} Gb/s" if i.speed_gbps else "")
            for i in h.interfaces))
    gdr = [p for p in h.gpu_nic if p.gpudirect]
    if h.gpudirect_module:
        out.append(f"GPUDirect RDMA: {h.gpudirect_module} loaded; {len(gdr)} GPU-NIC pairs "
                   f"within PXB can use it")
    else:
        out.append("GPUDirect RDMA: off (no nvidia_peermem / nv_peer_mem module)")
    if h.warnings:
        out.append("")
        out.append("Probe warnings:")
        out += [f"  {w}" for w in h.warnings]
    return "\n".join(out)


def render_link_model(cluster: ClusterTopology) -> str:
    """The link model of :func:`topology.link_model` as a small table."""
    model = linkmodel.link_model(cluster)
    rows = [["link class", "bandwidth", "latency"]]
    for kind, p in model.items():
        rows.append([kind.value, f"{p.bandwidth / 1e9:g} GB/s", f"{p.latency * 1e6:g} us"])
    return "\n".join(["Link model (peak, one direction):"] + ["  " + r for r in _table(rows)])


def render_cluster(cluster: ClusterTopology) -> str:
    """Node grouping and rank map, then each host."""
    out = [f"cluster: {len(cluster.hosts)} host{'s' * (len(cluster.hosts) != 1)}, "
           f"{cluster.num_nodes} node{'s' * (cluster.num_nodes != 1)}, "
           f"{cluster.size} rank{'s' * (cluster.size != 1)}"
           + (" (emulated nodes: several nodes share a host)" if cluster.emulated else "")]
    for node, ranks in enumerate(cluster.nodes):
        hosts = sorted({cluster.ranks[r].host for r in ranks})
        out.append(f"  node {node}: ranks {format_cpulist(ranks)} on {', '.join(hosts)}")
    rows = [["rank", "host", "node", "local", "GPU", "NIC"]]
    for p in cluster.ranks:
        rows.append([str(p.rank), p.host, str(p.node), str(p.local_rank),
                     "-" if p.gpu is None else f"GPU{p.gpu}", p.nic or "-"])
    out += ["  " + r for r in _table(rows)]
    inter = linkmodel.inter_node_kind(cluster).value
    if cluster.emulated and len(cluster.hosts) == 1:
        inter += " (modelled; emulated nodes on one host really talk over shm)"
    out.append(f"  inter-node link: {inter}; intra-node link: "
               f"{linkmodel.intra_node_kind(cluster).value}")
    out.append(render_link_model(cluster))
    for h in cluster.hosts:
        out += ["", render_host(h)]
    return "\n".join(out)
