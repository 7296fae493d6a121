"""Discovery of one host: run the probes and merge what they say.

Sources, each optional: sysfs/procfs under ``root`` (CPUs, NUMA, RDMA NICs,
network interfaces, GPUDirect, PCI paths), NVML, and captured ``nvidia-smi
topo -m`` / ``--query-gpu`` output. On a live host (``root="/"``) NVML and
``nvidia-smi`` are asked directly; on a snapshot only the captured text is
used. Each absent source is a :class:`~topology.types.ProbeWarning`, recorded
in ``HostTopology.warnings``, and discovery goes on with the others.
"""
from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path

from topology import linkmodel, nvml as _nvml, smi, sysfs
from topology._common import natural_key, parse_cpulist, warn
from topology.types import (Gpu, GpuNicPair, HostTopology, Link, LinkKind, Nic, PciPath,
                            ProbeWarning)

__all__ = ["discover_host", "assign_nics", "GPUDIRECT_MAX_PATH"]

#: Farthest GPU-NIC PCIe path over which GPUDirect RDMA is used: NCCL's default
#: ``NCCL_NET_GDR_LEVEL`` (PXB: the GPU and the NIC share a PCIe switch tree).
GPUDIRECT_MAX_PATH = PciPath.PXB


def discover_host(root: str | Path = "/", *, nvml=None, nvidia_smi_topo: str | None = None,
                  nvidia_smi_query: str | None = None, live: bool | None = None) -> HostTopology:
    """Probe one host and return its :class:`HostTopology`.

    ``root``: directory holding ``sys/`` and ``proc/``. ``nvml``: a pynvml-like
    module (default: import ``pynvml`` on a live host). ``nvidia_smi_topo`` /
    ``nvidia_smi_query``: captured output text (default: run ``nvidia-smi`` on a
    live host). ``live`` defaults to ``root == "/"``.
    """
    root = Path(root)
    if live is None:
        live = root.resolve() == Path("/")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProbeWarning)
        host = _discover(root, nvml, nvidia_smi_topo, nvidia_smi_query, live)
    messages = []
    for w in caught:
        if issubclass(w.category, ProbeWarning):
            messages.append(str(w.message))
        else:  # pragma: no cover - foreign warnings pass through
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    for msg in messages:
        warnings.warn(msg, ProbeWarning, stacklevel=2)
    return dataclasses.replace(host, warnings=tuple(dict.fromkeys(messages)))


def _discover(root: Path, nvml, topo_text, query_text, live: bool) -> HostTopology:
    sources = ["sysfs"]
    hostname = sysfs.probe_hostname(root)
    cpus = sysfs.probe_cpus(root)
    numa_nodes = sysfs.probe_numa(root)
    nics = sysfs.probe_rdma_nics(root)
    interfaces = sysfs.probe_net_interfaces(root)
    module = sysfs.probe_gpudirect(root)

    info = _nvml.probe_nvml(nvml) if (live or nvml is not None) else None
    if info is not None:
        sources.append("nvml")
    want_query = query_text is None and live and info is None
    want_topo = topo_text is None and live and (info is None or bool(info.gpus))
    if (want_query or want_topo) and shutil.which("nvidia-smi") is None:
        warn("nvidia-smi", "not on PATH (no NVIDIA driver on this host?); no GPU found by it")
    elif want_query or want_topo:
        query_text = smi.capture(smi.QUERY_ARGS) if want_query else query_text
        topo_text = smi.capture(smi.TOPO_ARGS) if want_topo else topo_text
    matrix = smi.parse_topo_matrix(topo_text) if topo_text else smi.SmiMatrix()
    if matrix.labels:
        sources.append("nvidia-smi topo -m")
    queried = smi.parse_query_gpu(query_text) if query_text else ()
    if queried:
        sources.append("nvidia-smi --query-gpu")

    gpus = _merge_gpus(root, info, queried, matrix, numa_nodes)
    nic_names = {n.name for n in nics}
    for label in matrix.nic_labels:
        if matrix.nic_name(label) not in nic_names:
            warn("nvidia-smi topo -m", f"lists NIC {matrix.nic_name(label)} that sysfs "
                     "does not show; left out")
    links, lanes, nvswitch = _gpu_links(gpus, info, matrix)
    gpus = tuple(Gpu(g.index, g.name, g.uuid, g.pci_bus_id, g.memory_bytes, g.numa,
                     lanes.get(g.index, 0)) for g in gpus)
    pairs, nic_links = _nic_links(root, gpus, nics, matrix, module)
    net = [Link(n.name, "network", n.link_kind, bandwidth=linkmodel.nic_bandwidth(n.rate_gbps),
                latency=linkmodel.LATENCY[n.link_kind]) for n in nics]
    net += [Link(i.name, "network", LinkKind.TCP,
                 bandwidth=linkmodel.nic_bandwidth(i.speed_gbps or linkmodel.TCP_DEFAULT_GBPS),
                 latency=linkmodel.LATENCY[LinkKind.TCP]) for i in interfaces]
    return HostTopology(hostname, cpus, numa_nodes, gpus, nics, interfaces,
                        tuple(links + nic_links + net), pairs, module, nvswitch, tuple(sources))


def _merge_gpus(root, info, queried, matrix, numa_nodes) -> list[Gpu]:
    by_index: dict[int, Gpu] = {}
    for g in queried:
        by_index[g.index] = g
    if info is not None:
        for g in info.gpus:
            by_index[g.index] = g
    for label in matrix.gpu_labels:
        by_index.setdefault(int(label[3:]), Gpu(int(label[3:])))
    out = []
    for index in sorted(by_index):
        g = by_index[index]
        numa = sysfs.pci_numa(root, g.pci_bus_id) if g.pci_bus_id else None
        if numa is None:
            numa = matrix.numa.get(f"GPU{index}")
        if numa is None and matrix.cpu_affinity.get(f"GPU{index}"):
            numa = _numa_of_cpus(matrix.cpu_affinity[f"GPU{index}"], numa_nodes)
        out.append(Gpu(g.index, g.name, g.uuid, g.pci_bus_id, g.memory_bytes, numa))
    return out


def _numa_of_cpus(text: str, numa_nodes) -> int | None:
    try:
        cpus = set(parse_cpulist(text))
    except ValueError:
        return None
    hits = [n.id for n in numa_nodes if cpus and cpus <= set(n.cpus)]
    return hits[0] if len(hits) == 1 else None


def _gpu_links(gpus, info, matrix):
    """GPU-GPU links, NVLink lanes per GPU and the NVSwitch flag."""
    links: list[Link] = []
    lanes: dict[int, int] = {}
    nvswitch = False
    names = {g.index: g.name for g in gpus}
    pair_lanes: dict[tuple[int, int], int] = {}
    pair_path: dict[tuple[int, int], PciPath] = {}
    if info is not None:
        pair_lanes, pair_path = dict(info.nvlink), dict(info.pcie)
        lanes, nvswitch = dict(info.lanes), info.nvswitch
    elif matrix.labels:
        for (a, b), cell in matrix.cells.items():
            if not (a.startswith("GPU") and b.startswith("GPU")):
                continue
            i, j = int(a[3:]), int(b[3:])
            key = (min(i, j), max(i, j))
            if cell.startswith("NV"):
                pair_lanes[key] = int(cell[2:])
            elif cell in PciPath.__members__:
                pair_path[key] = PciPath[cell]
        for g in gpus:
            row = [n for (i, j), n in pair_lanes.items() if g.index in (i, j)]
            cap = linkmodel.nvlink_max_lanes(g.name or "") or 0
            total = sum(row)
            # more lanes than the GPU has: the peers are reached through NVSwitch
            switched = bool(row) and ((cap and total > cap) or
                                      (not cap and len(row) == len(gpus) - 1 > 2
                                       and len(set(row)) == 1 and total > 18))
            lanes[g.index] = max(row) if switched else total
            nvswitch = nvswitch or switched
    for (i, j) in sorted(set(pair_lanes) | set(pair_path)):
        if (i, j) in pair_lanes:
            n = pair_lanes[(i, j)]
            bw = n * min(linkmodel.nvlink_lane_bandwidth(names.get(i, "")),
                         linkmodel.nvlink_lane_bandwidth(names.get(j, "")))
            links.append(Link(f"GPU{i}", f"GPU{j}", LinkKind.NVLINK, lanes=n, bandwidth=bw,
                              latency=linkmodel.LATENCY[LinkKind.NVLINK]))
        else:
            bw = min(linkmodel.pcie_bandwidth(names.get(i, "")),
                     linkmodel.pcie_bandwidth(names.get(j, "")))
            links.append(Link(f"GPU{i}", f"GPU{j}", LinkKind.PCIE, path=pair_path[(i, j)],
                              bandwidth=bw, latency=linkmodel.LATENCY[LinkKind.PCIE]))
    return links, lanes, nvswitch


def _nic_links(root, gpus, nics, matrix, module):
    """GPU-NIC pairs (with GPUDirect) and PCIe links GPU-NIC and NIC-NIC."""
    label_of = {matrix.nic_name(label): label for label in matrix.nic_labels}
    chains = {f"GPU{g.index}": sysfs.pci_path(root, g.pci_bus_id) for g in gpus}
    numa = {f"GPU{g.index}": g.numa for g in gpus}
    for n in nics:
        chains[n.name] = n.pci_path
        numa[n.name] = n.numa
    names = {f"GPU{g.index}": g.name for g in gpus}

    def path(a: str, b: str) -> PciPath | None:
        cell = matrix.cells.get((label_of.get(a, a), label_of.get(b, b)))
        if cell in PciPath.__members__:
            return PciPath[cell]
        return sysfs.classify_pci(chains.get(a, ()), chains.get(b, ()), numa.get(a), numa.get(b))

    pairs, links = [], []
    for g in gpus:
        for n in nics:
            p = path(f"GPU{g.index}", n.name)
            if p is None:
                continue
            gdr = bool(module) and p.within(GPUDIRECT_MAX_PATH)
            pairs.append(GpuNicPair(g.index, n.name, p, gdr))
            bw = min(linkmodel.pcie_bandwidth(names[f"GPU{g.index}"]),
                     linkmodel.nic_bandwidth(n.rate_gbps) or float("inf"))
            links.append(Link(f"GPU{g.index}", n.name, LinkKind.PCIE, path=p, bandwidth=bw,
                              latency=linkmodel.LATENCY[LinkKind.PCIE]))
    seen = set()
    for a in nics:
        for b in nics:
            if a.name >= b.name or (a.name, b.name) in seen:
                continue
            seen.add((a.name, b.name))
            p = path(a.name, b.name)
            if p is not None:
                links.append(Link(a.name, b.name, LinkKind.PCIE, path=p,
                                  bandwidth=linkmodel.nic_bandwidth(min(a.rate_gbps, b.rate_gbps)),
                                  latency=linkmodel.LATENCY[LinkKind.PCIE]))
    return tuple(pairs), links


def assign_nics(host: HostTopology, nics: list[Nic] | tuple[Nic, ...] | None = None,
                ) -> dict[int, GpuNicPair]:
    """Pair each GPU with its own NIC, nearest first.

    Candidate pairs are taken in order of PCIe distance, then NUMA locality,
    then GPU index and NIC name; each GPU and each NIC is used once. ``nics``
    restricts the candidates (default: every NIC port of the host). GPUs left
    without a NIC are absent from the result.
    """
    allowed = {n.name for n in (host.nics if nics is None else nics)}
    numa = {n.name: n.numa for n in host.nics}
    gpu_numa = {g.index: g.numa for g in host.gpus}
    candidates = sorted(
        (p for p in host.gpu_nic if p.nic in allowed),
        key=lambda p: (p.path.distance,
                       0 if gpu_numa.get(p.gpu) is not None
                       and gpu_numa.get(p.gpu) == numa.get(p.nic) else 1,
                       p.gpu, natural_key(p.nic)))
    out: dict[int, GpuNicPair] = {}
    used: set[str] = set()
    for p in candidates:
        if p.gpu in out or p.nic in used:
            continue
        out[p.gpu] = p
        used.add(p.nic)
    return out
