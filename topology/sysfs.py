"""Probes of Linux sysfs and procfs: RDMA NICs, NUMA layout, GPUDirect, PCI paths.

Every function takes ``root``, the directory holding ``sys/`` and ``proc/``
(``"/"`` on a live host, a materialised snapshot in tests), and warns with a
:class:`~topology.types.ProbeWarning` naming the file when a source is
absent, unreadable or malformed; the rest of discovery goes on.

Formats read (as the kernel writes them)::

    sys/class/infiniband/<dev>/ports/<p>/link_layer   InfiniBand | Ethernet
    sys/class/infiniband/<dev>/ports/<p>/state        4: ACTIVE
    sys/class/infiniband/<dev>/ports/<p>/rate         200 Gb/sec (4X HDR)
    sys/class/infiniband/<dev>/device                 -> ../../../0000:0c:00.0
    sys/class/infiniband/<dev>/device/numa_node       3   (-1: unknown)
    sys/devices/system/node/node<N>/cpulist           48-63,176-191
    sys/devices/system/node/node<N>/meminfo           Node 3 MemTotal:  131899292 kB
    proc/modules                                      nvidia_peermem 16384 0 - Live 0x0 (POE)
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from topology._common import normalize_bus_id, parse_cpulist, warn
from topology.sizes import parse_size
from topology.types import LinkLayer, NetInterface, Nic, NumaNode, PciPath, PortState

__all__ = ["probe_hostname", "probe_cpus", "probe_cache_bytes", "probe_thp_mode", "probe_numa",
           "probe_rdma_nics", "probe_gpudirect", "probe_net_interfaces", "pci_path", "pci_numa",
           "classify_pci", "PEER_MEMORY_MODULES"]

#: Kernel modules that let an RDMA NIC read and write GPU memory (GPUDirect RDMA):
#: ``nvidia_peermem`` ships with the NVIDIA driver (R470+), ``nv_peer_mem`` is the
#: older Mellanox OFED module.
PEER_MEMORY_MODULES = ("nvidia_peermem", "nv_peer_mem")
# Files whose presence NCCL's ncclIbGdrSupport() takes as "peer memory loaded".
_PEER_MEMORY_FILES = ("sys/kernel/mm/memory_peers/nv_mem/version",
                      "sys/kernel/mm/memory_peers/nv_mem_nc/version",
                      "sys/kernel/mm/memory_peers/nvidia-peermem/version")

_PCI_ADDR = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_PCI_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")
_STATE = re.compile(r"^\s*\d+\s*:\s*([A-Z_]+)\s*$")
_MEMTOTAL = re.compile(r"MemTotal:\s*(\d+)\s*kB")


def _read(path: Path, source: str = "sysfs", *, quiet_missing: bool = True,
          quiet_errors: bool = False) -> str | None:
    """Stripped text of ``path``; None (with a warning unless quiet) when unreadable."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        if not quiet_missing:
            warn(f"{source} {path}", "absent")
        return None
    except (OSError, UnicodeDecodeError) as exc:
        if not quiet_errors:
            warn(f"{source} {path}", f"unreadable ({exc.__class__.__name__}: {exc})")
        return None


def _live(root) -> bool:
    return Path(root).resolve() == Path("/")


def probe_hostname(root: str | Path = "/") -> str:
    """Host name from ``proc/sys/kernel/hostname`` (the socket's on a live host)."""
    name = _read(Path(root) / "proc/sys/kernel/hostname", "procfs")
    if name:
        return name
    if _live(root):
        return socket.gethostname()
    warn(f"procfs {Path(root) / 'proc/sys/kernel/hostname'}", "absent; host name unknown")
    return "unknown"


def probe_cpus(root: str | Path = "/") -> int:
    """Number of online logical CPUs (``sys/devices/system/cpu/online``; os.cpu_count())."""
    path = Path(root) / "sys/devices/system/cpu/online"
    text = _read(path)
    if text is not None:
        try:
            return len(parse_cpulist(text))
        except ValueError:
            warn(f"sysfs {path}", f"malformed CPU list {text!r}")
    if _live(root):
        return os.cpu_count() or 0
    return 0


def probe_cache_bytes(root: str | Path = "/") -> int:
    """Bytes of the last-level data (or unified) cache of CPU 0
    (``sys/devices/system/cpu/cpu0/cache/index*``); 0 when sysfs does not say."""
    best = (0, 0)
    base = Path(root) / "sys/devices/system/cpu/cpu0/cache"
    for index in sorted(base.glob("index*")):
        level, kind = _read(index / "level"), _read(index / "type")
        size = (_read(index / "size") or "").strip().upper()
        if not level or not size or (kind or "").strip() == "Instruction":
            continue
        try:
            best = max(best, (int(level), parse_size(size, zero=True)))
        except ValueError:
            warn(f"sysfs {index}", f"malformed cache level or size {level!r} {size!r}")
    return best[1]


def probe_thp_mode(root: str | Path = "/") -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``: the
    bracketed word of ``sys/kernel/mm/transparent_hugepage/enabled``); "" when sysfs does
    not say."""
    text = _read(Path(root) / "sys/kernel/mm/transparent_hugepage/enabled") or ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end].strip() if 0 <= start < end else ""


def probe_numa(root: str | Path = "/") -> tuple[NumaNode, ...]:
    """NUMA nodes with their CPUs and memory (``sys/devices/system/node``)."""
    base = Path(root) / "sys/devices/system/node"
    if not base.is_dir():
        warn(f"sysfs {base}", "absent; NUMA layout unknown")
        return ()
    nodes = []
    for entry in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        node_id = int(entry.name[4:])
        cpus: tuple[int, ...] = ()
        text = _read(entry / "cpulist", quiet_missing=False)
        if text is not None:
            try:
                cpus = parse_cpulist(text)
            except ValueError:
                warn(f"sysfs {entry / 'cpulist'}", f"malformed CPU list {text!r}")
        memory = None
        meminfo = _read(entry / "meminfo")
        if meminfo is not None:
            m = _MEMTOTAL.search(meminfo)
            memory = int(m.group(1)) * 1024 if m else None
        nodes.append(NumaNode(node_id, cpus, memory))
    return tuple(nodes)


def _pci_chain(real: str) -> tuple[str, ...]:
    """``("pci0000:00", bridge, ..., device)`` from a resolved sysfs device path."""
    parts = Path(real).parts
    for i, part in enumerate(parts):
        if _PCI_ROOT.match(part):
            chain = [part]
            for p in parts[i + 1:]:
                if not _PCI_ADDR.match(p):
                    break
                chain.append(p)
            return tuple(chain) if len(chain) > 1 else ()
    return ()


def pci_path(root: str | Path, bus_id: str) -> tuple[str, ...]:
    """PCI chain of device ``bus_id`` (``sys/bus/pci/devices/<id>``): host bridge,
    bridges from the root port down, then the device; ``()`` when unknown."""
    bus = normalize_bus_id(bus_id)
    if not bus:
        return ()
    link = Path(root) / "sys/bus/pci/devices" / bus
    if not link.exists():
        return ()
    return _pci_chain(os.path.realpath(link))


def pci_numa(root: str | Path, bus_id: str) -> int | None:
    """NUMA node of PCI device ``bus_id`` (None when unknown or -1)."""
    bus = normalize_bus_id(bus_id)
    if not bus:
        return None
    path = Path(root) / "sys/bus/pci/devices" / bus / "numa_node"
    return _parse_numa(_read(path), path)


def _parse_numa(text: str | None, path: Path) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        warn(f"sysfs {path}", f"malformed NUMA node {text!r}")
        return None
    return value if value >= 0 else None


def classify_pci(a: tuple[str, ...], b: tuple[str, ...], numa_a: int | None = None,
                 numa_b: int | None = None) -> PciPath | None:
    """PCIe path class between two devices from their :func:`pci_path` chains.

    Same rules as the ``nvidia-smi topo -m`` legend: different host bridges are
    NODE on one NUMA node, SYS across nodes; a shared host bridge but no shared
    bridge is PHB; devices at most one bridge below their closest common bridge
    are PIX; otherwise PXB. None when either chain is unknown.
    """
    if len(a) < 2 or len(b) < 2:
        return None
    if a[0] != b[0]:
        same_numa = numa_a is not None and numa_a == numa_b
        return PciPath.NODE if same_numa else PciPath.SYS
    bridges_a, bridges_b = a[1:-1], b[1:-1]
    common = 0
    for x, y in zip(bridges_a, bridges_b):
        if x != y:
            break
        common += 1
    if common == 0:
        return PciPath.PHB
    if len(bridges_a) - common <= 1 and len(bridges_b) - common <= 1:
        return PciPath.PIX
    return PciPath.PXB


def _int_key(p: Path) -> tuple[int, str]:
    return (int(p.name), p.name) if p.name.isdigit() else (1 << 30, p.name)


def probe_rdma_nics(root: str | Path = "/") -> tuple[Nic, ...]:
    """RDMA NIC ports (InfiniBand or RoCE) from ``sys/class/infiniband``."""
    base = Path(root) / "sys/class/infiniband"
    if not base.is_dir():
        warn(f"sysfs {base}", "absent; no RDMA NICs (no InfiniBand/RoCE driver loaded)")
        return ()
    nics = []
    for dev in sorted(base.iterdir(), key=lambda p: p.name):
        device = dev / "device"
        chain = _pci_chain(os.path.realpath(device)) if device.exists() else ()
        bus = chain[-1] if chain else ""
        if not bus:  # a copied tree without symlinks still has the uevent file
            uevent = _read(device / "uevent") or ""
            m = re.search(r"^PCI_SLOT_NAME=(\S+)$", uevent, re.M)
            bus = normalize_bus_id(m.group(1)) if m else ""
        numa = _parse_numa(_read(device / "numa_node"), device / "numa_node")
        ports_dir = dev / "ports"
        if not ports_dir.is_dir():
            warn(f"sysfs {ports_dir}", "absent; NIC skipped")
            continue
        for port in sorted(ports_dir.iterdir(), key=_int_key):
            nic = _probe_port(dev.name, port, bus, chain, numa)
            if nic is not None:
                nics.append(nic)
    return tuple(nics)


def _probe_port(name: str, port: Path, bus: str, chain: tuple[str, ...],
                numa: int | None) -> Nic | None:
    layer_text = _read(port / "link_layer", quiet_missing=False)
    try:
        layer = LinkLayer(layer_text)
    except ValueError:
        if layer_text is not None:
            warn(f"sysfs {port / 'link_layer'}", f"unknown link layer {layer_text!r}; port skipped")
        return None
    state = PortState.UNKNOWN
    text = _read(port / "state", quiet_missing=False)
    if text is not None:
        m = _STATE.match(text)
        if m and m.group(1) in PortState.__members__:
            state = PortState[m.group(1)]
        else:
            warn(f"sysfs {port / 'state'}",
                 f"malformed port state {text!r} (expected e.g. '4: ACTIVE')")
    rate = 0.0
    text = _read(port / "rate", quiet_missing=False)
    if text is not None:
        m = _RATE.match(text)
        if m:
            rate = float(m.group(1))
        else:
            warn(f"sysfs {port / 'rate'}",
                 f"malformed rate {text!r} (expected e.g. '200 Gb/sec (4X HDR)')")
    port_no = int(port.name) if port.name.isdigit() else 1
    return Nic(name, port_no, layer, state, rate, bus, chain, numa)


def probe_gpudirect(root: str | Path = "/") -> str:
    """Name of the loaded GPUDirect RDMA peer-memory module, or ``""``.

    Looks in ``proc/modules``, ``sys/module/<name>`` and the memory-peer files
    that NCCL checks (``sys/kernel/mm/memory_peers/nv_mem/version``, ...).
    """
    root = Path(root)
    modules_path = root / "proc/modules"
    text = _read(modules_path, "procfs")
    if text is not None:
        loaded = {line.split()[0] for line in text.splitlines() if line.split()}
        for name in PEER_MEMORY_MODULES:
            if name in loaded:
                return name
    for name in PEER_MEMORY_MODULES:
        if (root / "sys/module" / name).is_dir():
            return name
    for rel in _PEER_MEMORY_FILES:
        if (root / rel).exists():
            return "nv_peer_mem" if "/nv_mem" in rel else "nvidia_peermem"
    if text is None and not (root / "sys/module").is_dir():
        warn(f"procfs {modules_path}", "absent and no sys/module; GPUDirect RDMA status unknown "
             "(reported as off)")
    elif text is None:
        warn(f"procfs {modules_path}", "absent; GPUDirect RDMA looked up in sys/module only")
    return ""


def probe_net_interfaces(root: str | Path = "/") -> tuple[NetInterface, ...]:
    """Physical network interfaces (``sys/class/net``, virtual ones left out),
    with their speed in Gb/s (None when the kernel does not say)."""
    base = Path(root) / "sys/class/net"
    if not base.is_dir():
        warn(f"sysfs {base}", "absent; no network interfaces found")
        return ()
    out = []
    for entry in sorted(base.iterdir(), key=lambda p: p.name):
        if "/devices/virtual/" in os.path.realpath(entry):
            continue
        state = _read(entry / "operstate") or "unknown"
        speed = None
        text = _read(entry / "speed", quiet_errors=True)  # EINVAL while the link is down
        if text is not None:
            try:
                mbps = int(text)
                speed = mbps / 1000.0 if mbps > 0 else None
            except ValueError:
                warn(f"sysfs {entry / 'speed'}", f"malformed speed {text!r} (expected Mb/s)")
        out.append(NetInterface(entry.name, speed, state))
    return tuple(out)
