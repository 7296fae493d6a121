"""Vocabulary of the fabric model: hosts, NUMA nodes, GPUs, NICs and links.

Everything here is a frozen dataclass or an Enum and round-trips through
JSON (:func:`to_json` / :func:`from_json`) without pickle, so a topology can
be gathered over MPI as plain dicts, written to a file and read back.

Units: bandwidths in bytes/s, latencies in seconds, memory in bytes, NIC
rates in Gb/s (as the kernel reports them), everything else counts.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import types as _pytypes
import typing
from dataclasses import dataclass, field

__all__ = [
    "LinkLayer", "PortState", "PciPath", "LinkKind",
    "NumaNode", "Gpu", "Nic", "NetInterface", "Link", "GpuNicPair", "HostTopology",
    "RankPlacement", "ClusterTopology", "ProbeWarning", "TopologyError",
    "to_dict", "from_dict", "to_json", "from_json", "FORMAT_VERSION",
]

#: Version of the JSON layout written by :func:`to_json`.
FORMAT_VERSION = 1


class ProbeWarning(UserWarning):
    """A probe's source was absent, unreadable or malformed; discovery went on."""


class TopologyError(ValueError):
    """A topology (JSON file, gathered dict) is malformed; ``where`` names the field."""

    def __init__(self, message: str, *, where: str = ""):
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where


class LinkLayer(enum.Enum):
    """Link layer of an RDMA port as sysfs ``ports/<p>/link_layer`` spells it."""

    INFINIBAND = "InfiniBand"
    ETHERNET = "Ethernet"  # RDMA over Converged Ethernet (RoCE)

    @property
    def link_kind(self) -> "LinkKind":
        return LinkKind.INFINIBAND if self is LinkLayer.INFINIBAND else LinkKind.ROCE


class PortState(enum.Enum):
    """Logical port state, sysfs ``ports/<p>/state`` (``"4: ACTIVE"``)."""

    NOP = "NOP"
    DOWN = "DOWN"
    INIT = "INIT"
    ARMED = "ARMED"
    ACTIVE = "ACTIVE"
    ACTIVE_DEFER = "ACTIVE_DEFER"
    UNKNOWN = "UNKNOWN"


class PciPath(enum.Enum):
    """PCIe path class between two devices, nearest first (``nvidia-smi topo -m`` legend).

    PIX: at most one PCIe switch; PXB: several PCIe bridges without the host
    bridge; PHB: through a PCIe host bridge; NODE: between host bridges of one
    NUMA node; SYS: across the SMP interconnect between NUMA nodes.
    """

    PIX = "PIX"
    PXB = "PXB"
    PHB = "PHB"
    NODE = "NODE"
    SYS = "SYS"

    @property
    def distance(self) -> int:
        """0 for PIX up to 4 for SYS: smaller is closer."""
        return _PCI_ORDER.index(self)

    def within(self, limit: "PciPath") -> bool:
        """True when this path is ``limit`` or closer."""
        return self.distance <= limit.distance


_PCI_ORDER = [PciPath.PIX, PciPath.PXB, PciPath.PHB, PciPath.NODE, PciPath.SYS]


class LinkKind(enum.Enum):
    """The transport of a link; the link classes of the cost model."""

    NVLINK = "nvlink"
    PCIE = "pcie"
    ROCE = "roce"
    INFINIBAND = "infiniband"
    TCP = "tcp"
    SHM = "shm"


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its logical CPUs and memory (bytes; None when unknown)."""

    id: int
    cpus: tuple[int, ...] = ()
    memory_bytes: int | None = None


@dataclass(frozen=True)
class Gpu:
    """One GPU of a host.

    ``pci_bus_id`` is normalised to ``DDDD:BB:DD.F`` in lower case;
    ``nvlink_lanes`` is the number of active NVLink links of the GPU (0: none).
    """

    index: int
    name: str = ""
    uuid: str = ""
    pci_bus_id: str = ""
    memory_bytes: int | None = None
    numa: int | None = None
    nvlink_lanes: int = 0


@dataclass(frozen=True)
class Nic:
    """One port of an RDMA NIC (``/sys/class/infiniband/<name>/ports/<port>``).

    ``rate_gbps`` is the port rate in Gb/s; ``pci_path`` the chain of PCI
    addresses from the root port down to the NIC's own function.
    """

    name: str
    port: int = 1
    link_layer: LinkLayer = LinkLayer.INFINIBAND
    state: PortState = PortState.UNKNOWN
    rate_gbps: float = 0.0
    pci_bus_id: str = ""
    pci_path: tuple[str, ...] = ()
    numa: int | None = None

    @property
    def link_kind(self) -> LinkKind:
        return self.link_layer.link_kind

    @property
    def active(self) -> bool:
        return self.state is PortState.ACTIVE


@dataclass(frozen=True)
class NetInterface:
    """A kernel network interface (``/sys/class/net``) usable for TCP."""

    name: str
    speed_gbps: float | None = None
    state: str = "unknown"


@dataclass(frozen=True)
class Link:
    """A link between two endpoints of one host, named as ``nvidia-smi`` does
    (``GPU0``, ``mlx5_0``).

    ``lanes`` counts NVLink links (NVLink only); ``path`` is the PCIe path class
    (PCIe only). ``bandwidth`` is one direction in bytes/s, ``latency`` in
    seconds, both from :mod:`topology.linkmodel`.
    """

    a: str
    b: str
    kind: LinkKind
    lanes: int = 0
    path: PciPath | None = None
    bandwidth: float = 0.0
    latency: float = 0.0


@dataclass(frozen=True)
class GpuNicPair:
    """PCIe distance between a GPU and a NIC of the same host, and whether
    GPUDirect RDMA can move data between them without host memory."""

    gpu: int
    nic: str
    path: PciPath
    gpudirect: bool = False


@dataclass(frozen=True)
class HostTopology:
    """What the probes found on one host.

    ``gpudirect_module`` names the loaded peer-memory module
    (``nvidia_peermem``, ``nv_peer_mem``) or is empty; ``nvswitch`` is True
    when GPUs reach each other through NVSwitch; ``sources`` lists the probes
    that answered and ``warnings`` what the others said.
    """

    hostname: str
    cpus: int = 0
    numa_nodes: tuple[NumaNode, ...] = ()
    gpus: tuple[Gpu, ...] = ()
    nics: tuple[Nic, ...] = ()
    interfaces: tuple[NetInterface, ...] = ()
    links: tuple[Link, ...] = ()
    gpu_nic: tuple[GpuNicPair, ...] = ()
    gpudirect_module: str = ""
    nvswitch: bool = False
    sources: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def cpu_only(self) -> bool:
        """True when no GPU was found."""
        return not self.gpus

    def gpu(self, index: int) -> Gpu:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        raise KeyError(f"GPU {index!r} not on host {self.hostname!r} (its GPUs: "
                       f"{[g.index for g in self.gpus]})")

    def nic(self, name: str) -> Nic:
        for nic in self.nics:
            if nic.name == name:
                return nic
        raise KeyError(f"NIC {name!r} not on host {self.hostname!r} (its NICs: "
                       f"{[n.name for n in self.nics]})")

    def link(self, a: str, b: str) -> Link | None:
        """The link between endpoints ``a`` and ``b`` (either order), or None."""
        for link in self.links:
            if (link.a, link.b) in ((a, b), (b, a)):
                return link
        return None

    def pair(self, gpu: int, nic: str) -> GpuNicPair | None:
        for pair in self.gpu_nic:
            if pair.gpu == gpu and pair.nic == nic:
                return pair
        return None


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank runs: host, runtime node (emulated nodes included),
    rank within the node, and its GPU and NIC (None on CPU-only hosts)."""

    rank: int
    host: str
    node: int
    local_rank: int
    gpu: int | None = None
    nic: str | None = None


@dataclass(frozen=True)
class ClusterTopology:
    """The topology of a whole job: one entry per host and one per rank."""

    hosts: tuple[HostTopology, ...]
    ranks: tuple[RankPlacement, ...] = field(default=())

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """Ranks of each runtime node, by node index."""
        count = 1 + max((p.node for p in self.ranks), default=-1)
        return tuple(tuple(p.rank for p in self.ranks if p.node == n) for n in range(count))

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def host(self, name: str) -> HostTopology:
        for host in self.hosts:
            if host.hostname == name:
                return host
        raise KeyError(f"host {name!r} not in the topology")

    def host_of(self, rank: int) -> HostTopology:
        return self.host(self.ranks[rank].host)

    @property
    def emulated(self) -> bool:
        """True when some host carries more than one runtime node."""
        seen: dict[str, set[int]] = {}
        for p in self.ranks:
            seen.setdefault(p.host, set()).add(p.node)
        return any(len(v) > 1 for v in seen.values())

    @classmethod
    def single(cls, host: HostTopology) -> "ClusterTopology":
        """A one-host, one-rank cluster (rank 0 on GPU0 and its NIC when present)."""
        gpu = host.gpus[0].index if host.gpus else None
        nic = None
        if gpu is not None:
            pairs = sorted((p for p in host.gpu_nic if p.gpu == gpu),
                           key=lambda p: (p.path.distance, p.nic))
            nic = pairs[0].nic if pairs else None
        return cls((host,), (RankPlacement(0, host.hostname, 0, 0, gpu, nic),))


# -- JSON ------------------------------------------------------------------

def to_dict(obj) -> typing.Any:
    """A JSON-able structure (dicts, lists, str, numbers) for a model object."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_dict(x) for x in obj]
    return obj


def from_dict(cls: type, data: typing.Any, where: str = "") -> typing.Any:
    """Rebuild a model object of type ``cls`` from :func:`to_dict` output.

    Raises :class:`TopologyError` naming the field on a missing field, an
    unknown field or a value of the wrong type.
    """
    return _decode(cls, data, where or cls.__name__)


def to_json(obj, *, indent: int | None = 2) -> str:
    """JSON text of a model object, tagged with the format version."""
    body = to_dict(obj)
    if isinstance(body, dict):
        body = {"format": FORMAT_VERSION, "type": type(obj).__name__, **body}
    return json.dumps(body, indent=indent)


def from_json(text: str, cls: type | None = None):
    """Parse :func:`to_json` output; ``cls`` defaults to the type tag in the text."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TopologyError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TopologyError(f"expected a JSON object, got {type(data).__name__}")
    data = dict(data)
    version = data.pop("format", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise TopologyError(f"format {version!r} is not supported (expected {FORMAT_VERSION})",
                            where="format")
    tag = data.pop("type", None)
    if cls is None:
        known = {c.__name__: c for c in (ClusterTopology, HostTopology)}
        if tag not in known:
            raise TopologyError(f"expected one of {sorted(known)}, got {tag!r}", where="type")
        cls = known[tag]
    return from_dict(cls, data)


_HINTS: dict[type, dict[str, typing.Any]] = {}


def _hints(cls: type) -> dict[str, typing.Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _decode(tp, data, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, _pytypes.UnionType):
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _decode(inner[0], data, where)
    if origin is tuple:
        if not isinstance(data, list):
            raise TopologyError(f"expected a list, got {type(data).__name__}", where=where)
        item = typing.get_args(tp)[0]
        return tuple(_decode(item, x, f"{where}[{i}]") for i, x in enumerate(data))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            raise TopologyError(f"expected one of {[m.value for m in tp]}, got {data!r}",
                                where=where) from None
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise TopologyError(f"expected an object, got {type(data).__name__}", where=where)
        hints = _hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise TopologyError(f"unknown field(s) {unknown}", where=where)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise TopologyError("missing field", where=f"{where}.{f.name}")
                continue
            kwargs[f.name] = _decode(hints[f.name], data[f.name], f"{where}.{f.name}")
        return tp(**kwargs)
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise TopologyError(f"expected a number, got {data!r}", where=where)
        return float(data)
    if tp in (int, str, bool):
        if not isinstance(data, tp) or (tp is int and isinstance(data, bool)):
            raise TopologyError(f"expected {tp.__name__}, got {data!r}", where=where)
        return data
    raise TopologyError(f"cannot decode type {tp!r}", where=where)  # pragma: no cover
