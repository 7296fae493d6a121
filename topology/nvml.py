"""Probe of NVIDIA GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``).

Reads each GPU's name, UUID, PCI bus id and memory, the state and remote
end of each NVLink, the NVLink P2P status and the PCIe common ancestor of
every GPU pair. The NVML module can be passed in (any object with the
``pynvml`` functions and constants), which is how it is tested without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from topology._common import normalize_bus_id, warn
from topology.types import Gpu, PciPath

__all__ = ["NvmlInfo", "probe_nvml"]

# nvmlGpuTopologyLevel_t -> PCIe path class (nvml.h: INTERNAL 0, SINGLE 10,
# MULTIPLE 20, HOSTBRIDGE 30, NODE 40, SYSTEM 50).
_LEVELS = {0: PciPath.PIX, 10: PciPath.PIX, 20: PciPath.PXB, 30: PciPath.PHB,
           40: PciPath.NODE, 50: PciPath.SYS}
_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS in nvml.h (H100 and B200 have 18)


@dataclass(frozen=True)
class NvmlInfo:
    """What NVML says about the GPUs of this host.

    ``nvlink[(i, j)]`` (i < j) is the number of NVLink lanes joining GPUs i and
    j (through NVSwitch: the lanes each has into the switch); ``pcie[(i, j)]``
    their PCIe path class; ``lanes[i]`` GPU i's active NVLinks; ``nvswitch``
    is True when some link ends at a device that is not a GPU.
    """

    gpus: tuple[Gpu, ...] = ()
    nvlink: dict = field(default_factory=dict)
    pcie: dict = field(default_factory=dict)
    lanes: dict = field(default_factory=dict)
    nvswitch: bool = False


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def probe_nvml(nvml=None, source: str = "NVML") -> NvmlInfo | None:
    """Query NVML; None with a warning when NVML or its driver is absent."""
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[no-redef]
        except ImportError:
            warn(f"{source} (nvidia-ml-py)", "module pynvml is not installed; "
                 "`pip install nvidia-ml-py` to probe GPUs and NVLink through NVML")
            return None
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        warn(source, f"nvmlInit failed ({exc}); no NVIDIA driver on this host?")
        return None
    try:
        return _probe(nvml, source)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # pragma: no cover - shutdown failures do not matter here
            pass


def _call(source: str, nvml, name: str, *args, default=None):
    """``nvml.<name>(*args)``; ``default`` with a warning naming the call when it fails."""
    try:
        return getattr(nvml, name)(*args)
    except Exception as exc:
        warn(source, f"{name} failed ({exc})")
        return default


def _probe(nvml, source: str) -> NvmlInfo:
    count = _call(source, nvml, "nvmlDeviceGetCount", default=0)
    handles, gpus, remotes = [], [], []
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", _MAX_LINKS)
    for i in range(count):
        h = _call(source, nvml, "nvmlDeviceGetHandleByIndex", i)
        if h is None:
            continue
        pci = _call(source, nvml, "nvmlDeviceGetPciInfo", h)
        bus = normalize_bus_id(_text(getattr(pci, "busId", ""))) if pci is not None else ""
        mem = _call(source, nvml, "nvmlDeviceGetMemoryInfo", h)
        gpus.append(Gpu(i, _text(_call(source, nvml, "nvmlDeviceGetName", h, default="")),
                        _text(_call(source, nvml, "nvmlDeviceGetUUID", h, default="")), bus,
                        int(mem.total) if mem is not None else None))
        handles.append(h)
        links = []
        for link in range(max_links):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(h, link)
            except Exception:  # NOT_SUPPORTED / INVALID_ARGUMENT past the last link
                continue
            if state != enabled:
                continue
            remote = _call(source, nvml, "nvmlDeviceGetNvLinkRemotePciInfo", h, link)
            links.append(normalize_bus_id(_text(getattr(remote, "busId", ""))) if remote else "")
        remotes.append(links)
    bus_of = {g.pci_bus_id: g.index for g in gpus}
    lanes = {g.index: len(r) for g, r in zip(gpus, remotes)}
    to_switch = {g.index: sum(1 for b in r if b not in bus_of) for g, r in zip(gpus, remotes)}
    nvswitch = any(to_switch.values())
    nvlink, pcie = {}, {}
    ok = getattr(nvml, "NVML_P2P_STATUS_OK", 0)
    caps = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    for a in range(len(gpus)):
        for b in range(a + 1, len(gpus)):
            ga, gb = gpus[a], gpus[b]
            direct = sum(1 for bus in remotes[a] if bus == gb.pci_bus_id)
            if not direct and to_switch[ga.index] and to_switch[gb.index]:
                status = _call(source, nvml, "nvmlDeviceGetP2PStatus", handles[a], handles[b],
                               caps)
                if status == ok:
                    direct = min(to_switch[ga.index], to_switch[gb.index])
            if direct:
                nvlink[(ga.index, gb.index)] = direct
            level = _call(source, nvml, "nvmlDeviceGetTopologyCommonAncestor", handles[a],
                          handles[b])
            if level is not None:
                pcie[(ga.index, gb.index)] = _LEVELS.get(int(level), PciPath.SYS)
    return NvmlInfo(tuple(gpus), nvlink, pcie, lanes, nvswitch)
