"""Fabric specs: what a cluster should be, declared in TOML.

A spec has these tables (every key is listed; anything else is an error)::

    [fabric]     name (str), description (str, optional)
    [cluster]    nodes (int >= 1): number of hosts
    [node]       gpus (int >= 0), gpu_model (str, substring of the GPU name),
                 min_gpu_memory_gib (float), min_cpus (int)
    [nvlink]     topology ("all-to-all" | "hybrid-cube-mesh"), min_lanes (NVLink
                 links per GPU), min_bandwidth_gbs (GB/s per GPU, one direction)
    [nic]        count (compute NICs per node, at least), link_layer ("roce" |
                 "infiniband"), min_rate_gbps (Gb/s), gpu_affinity ("one-per-gpu" |
                 "any"), max_path (farthest GPU-NIC PCIe class: PIX..SYS),
                 numa_local (bool), gpudirect (bool)
    [tcp]        rate_gbps (Gb/s line rate of a node's Ethernet port that carries TCP
                 between nodes), count (such ports per node, default 1): the link
                 between nodes of a fabric without ``[nic]`` (MPI over kernel sockets)
    [bandwidth]  minimum measured GB/s per link class: nvlink, pcie, roce,
                 infiniband, tcp, shm, and allreduce_bus (all-reduce bus bandwidth)
    [model]      the cost model's terms measured on this fabric, written by
                 ``neocomm simulate calibrate`` (see :data:`MODEL_KEYS`): they
                 replace the line rates the other tables imply

``[nvlink]``, ``[nic]``, ``[tcp]``, ``[bandwidth]`` and ``[model]`` are optional; without
``[nic]`` or ``[tcp]`` the nodes are taken to talk TCP over a 10 Gb/s port. Presets ship in
``topology/presets/``; :func:`load_spec` takes a path or a preset name.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from topology.numbers import is_positive
from topology.types import LinkLayer, PciPath

__all__ = ["FabricSpec", "NvlinkSpec", "NicSpec", "TcpSpec", "SpecError", "load_spec", "parse_spec",
           "preset_names", "PRESETS_DIR", "NVLINK_TOPOLOGIES", "BANDWIDTH_CLASSES", "MODEL_KEYS"]

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
NVLINK_TOPOLOGIES = ("all-to-all", "hybrid-cube-mesh")
BANDWIDTH_CLASSES = ("nvlink", "pcie", "roce", "infiniband", "tcp", "shm", "allreduce_bus")
_LINK_LAYERS = {"roce": LinkLayer.ETHERNET, "ethernet": LinkLayer.ETHERNET,
                "infiniband": LinkLayer.INFINIBAND, "ib": LinkLayer.INFINIBAND}
_MAX_NVLINK_LANES = 18   # H100/B200: the most NVLink links any GPU has
_MAX_RATE_GBPS = 1600.0  # 8X XDR (200 Gb/s per lane), the fastest IB/RoCE port defined


class SpecError(ValueError):
    """A fabric spec is invalid: ``path`` names the file, ``key`` the entry."""

    def __init__(self, path: str, key: str, problem: str):
        where = f"{path}: {key}" if key else path
        super().__init__(f"{where}: {problem}")
        self.path, self.key, self.problem = path, key, problem


@dataclass(frozen=True)
class NvlinkSpec:
    """Required NVLink fabric inside a node."""

    topology: str
    min_lanes: int
    min_bandwidth_gbs: float = 0.0


@dataclass(frozen=True)
class NicSpec:
    """Required compute NICs of a node."""

    count: int
    link_layer: LinkLayer
    min_rate_gbps: float
    gpu_affinity: str = "any"
    max_path: PciPath = PciPath.SYS
    numa_local: bool = False
    gpudirect: bool = False


@dataclass(frozen=True)
class TcpSpec:
    """The Ethernet ports of a node that carry TCP between nodes (no RDMA NIC)."""

    rate_gbps: float
    count: int = 1


@dataclass(frozen=True)
class FabricSpec:
    """A whole fabric spec; ``bandwidth`` maps link class -> minimum GB/s."""

    name: str
    nodes: int
    gpus: int
    description: str = ""
    gpu_model: str = ""
    min_gpu_memory_gib: float = 0.0
    min_cpus: int = 0
    nvlink: NvlinkSpec | None = None
    nic: NicSpec | None = None
    bandwidth: tuple[tuple[str, float], ...] = ()
    source: str = ""
    #: the ``[model]`` table's entries, as written (empty: the links' line rates)
    model: tuple[tuple[str, object], ...] = ()
    tcp: TcpSpec | None = None

    @property
    def min_bandwidth(self) -> dict[str, float]:
        return dict(self.bandwidth)


# key -> (python types, required, check(value) -> problem or None)
def _positive(v):
    return None if is_positive(v) else f"must be > 0, got {v}"


def _non_negative(v):
    return None if v >= 0 else f"must be >= 0, got {v}"


def _choice(options):
    return lambda v: None if v.lower() in options else f"expected one of {list(options)}, got {v!r}"


_NUM = (int, float)
_LINK_CLASSES = ("nvlink", "pcie", "shm", "roce", "infiniband", "tcp")
def _positive_map(table: dict, per: str) -> str | None:
    ok = all(is_positive(x) for x in table.values())
    return None if ok else f"expected positive numbers per {per}"


#: keys of the ``[model]`` table: the link classes the terms were measured on, the
#: buffers they price, where and how well they were fitted, and the terms (latencies
#: in us, rates in GB/s, the cache in MiB; ``factors``: op/algorithm efficiencies;
#: ``overhead_factors``: each operation's call overhead over ``call_overhead_us``)
MODEL_KEYS = {
    "buffers": (str, True, _choice(("host", "device"))),
    "intra_link": (str, False, _choice(_LINK_CLASSES)),
    "inter_link": (str, False, _choice(_LINK_CLASSES)),
    "measured_on": (str, False, None),
    "measured": (list, False, None),
    "fit_rows": (int, False, _non_negative),
    "fit_median_error": (_NUM, False, _non_negative),
    "fit_worst_error": (_NUM, False, _non_negative),
    "cache_mib": (_NUM, False, _non_negative),
    "cores_per_node": (int, False, _non_negative),
    "huge_page_mib": (_NUM, False, _non_negative),
    "factors": (dict, False, lambda v: _positive_map(v, "op/algorithm")),
    "overhead_factors": (dict, False, lambda v: _positive_map(v, "operation")),
    **{k: (_NUM, False, _non_negative) for k in (
        "intra_latency_us", "intra_bandwidth_gbs", "inter_latency_us", "inter_bandwidth_gbs",
        "node_bandwidth_gbs", "copy_bandwidth_gbs", "reduce_bandwidth_gbs", "step_overhead_us",
        "call_overhead_us", "cache_speedup", "switch_latency_us", "page_cost_us",
        "tcp_copy_bandwidth_gbs", "tcp_message_overhead_us", "tcp_call_overhead_us")},
    "tcp_fraction": (_NUM, False, lambda v: None if 0 < v <= 1 else
                     f"must be a fraction of the line rate in (0, 1], got {v}"),
}
_SCHEMA = {
    "fabric": {"name": (str, True, None), "description": (str, False, None)},
    "cluster": {"nodes": (int, True, lambda v: None if v >= 1 else f"must be >= 1, got {v}")},
    "node": {"gpus": (int, True, _non_negative), "gpu_model": (str, False, None),
             "min_gpu_memory_gib": (_NUM, False, _non_negative),
             "min_cpus": (int, False, _non_negative)},
    "nvlink": {"topology": (str, True, _choice(NVLINK_TOPOLOGIES)),
               "min_lanes": (int, True, lambda v: None if 1 <= v <= _MAX_NVLINK_LANES else
                             f"must be 1..{_MAX_NVLINK_LANES} (no GPU has more NVLink links), "
                             f"got {v}"),
               "min_bandwidth_gbs": (_NUM, False, _positive)},
    "nic": {"count": (int, True, lambda v: None if v >= 1 else f"must be >= 1, got {v}"),
            "link_layer": (str, True, _choice(tuple(_LINK_LAYERS))),
            "min_rate_gbps": (_NUM, True, lambda v: None if 0 < v <= _MAX_RATE_GBPS else
                              f"must be in (0, {_MAX_RATE_GBPS:g}] Gb/s, got {v}"),
            "gpu_affinity": (str, False, _choice(("one-per-gpu", "any"))),
            "max_path": (str, False, _choice(tuple(p.value.lower() for p in PciPath))),
            "numa_local": (bool, False, None), "gpudirect": (bool, False, None)},
    "tcp": {"rate_gbps": (_NUM, True, lambda v: None if 0 < v <= _MAX_RATE_GBPS else
                          f"must be in (0, {_MAX_RATE_GBPS:g}] Gb/s, got {v}"),
            "count": (int, False, lambda v: None if v >= 1 else f"must be >= 1, got {v}")},
    "bandwidth": {k: (_NUM, False, _positive) for k in BANDWIDTH_CLASSES},
    "model": MODEL_KEYS,
}
_REQUIRED_TABLES = ("fabric", "cluster", "node")


def _type_name(tp) -> str:
    if tp is _NUM:
        return "a number"
    return {str: "a string", int: "an integer", bool: "true or false", list: "a list",
            dict: "a table"}[tp]


def _check_table(path: str, table: str, data) -> dict:
    if not isinstance(data, dict):
        raise SpecError(path, f"[{table}]", f"expected a table, got {type(data).__name__}")
    schema = _SCHEMA[table]
    for key in data:
        if key not in schema:
            raise SpecError(path, f"[{table}] {key}",
                            f"unknown key (expected one of {sorted(schema)})")
    out = {}
    for key, (tp, required, check) in schema.items():
        if key not in data:
            if required:
                raise SpecError(path, f"[{table}] {key}", "missing required key")
            continue
        value = data[key]
        bad_bool = isinstance(value, bool) and tp is not bool
        if bad_bool or not isinstance(value, tp):
            raise SpecError(path, f"[{table}] {key}",
                            f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        if check is not None:
            problem = check(value)
            if problem:
                raise SpecError(path, f"[{table}] {key}", problem)
        out[key] = value
    return out


def parse_spec(text: str, path: str = "<spec>") -> FabricSpec:
    """Parse spec TOML text; :class:`SpecError` names ``path``, the key and the problem."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(path, "", f"not valid TOML: {exc}") from None
    for table in data:
        if table not in _SCHEMA:
            raise SpecError(path, f"[{table}]", f"unknown table (expected {list(_SCHEMA)})")
    for table in _REQUIRED_TABLES:
        if table not in data:
            raise SpecError(path, f"[{table}]", "missing required table")
    t = {name: _check_table(path, name, data[name]) for name in data}
    node = t["node"]
    gpus = node["gpus"]
    nvlink = None
    if "nvlink" in t:
        nv = t["nvlink"]
        if gpus < 2:
            raise SpecError(path, "[nvlink]",
                            f"needs at least 2 GPUs per node, [node] gpus = {gpus}")
        topo = nv["topology"].lower()
        if topo == "hybrid-cube-mesh" and gpus != 8:
            raise SpecError(path, "[nvlink] topology",
                            f"hybrid-cube-mesh joins exactly 8 GPUs, [node] gpus = {gpus}")
        nvlink = NvlinkSpec(topo, nv["min_lanes"], float(nv.get("min_bandwidth_gbs", 0.0)))
    nic = None
    if "nic" in t:
        n = t["nic"]
        affinity = n.get("gpu_affinity", "any").lower()
        if affinity == "one-per-gpu" and n["count"] < gpus:
            raise SpecError(path, "[nic] count", f"one-per-gpu affinity needs at least {gpus} "
                            f"NICs ([node] gpus = {gpus}), got {n['count']}")
        for key in ("numa_local", "gpudirect"):
            if n.get(key) and gpus == 0:
                raise SpecError(path, f"[nic] {key}", "requires GPUs, [node] gpus = 0")
        if affinity == "one-per-gpu" and gpus == 0:
            raise SpecError(path, "[nic] gpu_affinity",
                            "one-per-gpu requires GPUs, [node] gpus = 0")
        nic = NicSpec(n["count"], _LINK_LAYERS[n["link_layer"].lower()], float(n["min_rate_gbps"]),
                      affinity, PciPath[n.get("max_path", "SYS").upper()],
                      n.get("numa_local", False), n.get("gpudirect", False))
    if gpus == 0 and node.get("gpu_model"):
        raise SpecError(path, "[node] gpu_model", f"names a GPU model, {node['gpu_model']!r}, "
                        f"but [node] gpus = 0")
    bandwidth = tuple((k, float(v)) for k, v in t.get("bandwidth", {}).items())
    tcp = None
    if "tcp" in t:
        tcp = TcpSpec(float(t["tcp"]["rate_gbps"]), int(t["tcp"].get("count", 1)))
    return FabricSpec(t["fabric"]["name"], t["cluster"]["nodes"], gpus,
                      t["fabric"].get("description", ""), node.get("gpu_model", ""),
                      float(node.get("min_gpu_memory_gib", 0.0)), node.get("min_cpus", 0),
                      nvlink, nic, bandwidth, path, tuple(sorted(t.get("model", {}).items())),
                      tcp)


def preset_names() -> list[str]:
    """Names of the shipped presets."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def load_spec(spec: str | Path) -> FabricSpec:
    """Load a spec from a TOML file path or a preset name (``zionex``, ``dgx-a100``...)."""
    path = Path(spec)
    if not path.is_file():
        preset = PRESETS_DIR / f"{spec}.toml"
        if str(spec) in preset_names():
            path = preset
        else:
            raise SpecError(str(spec), "", f"no such file and not a preset "
                            f"(presets: {', '.join(preset_names())})")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(str(path), "", f"unreadable ({exc})") from None
    return parse_spec(text, str(path))
