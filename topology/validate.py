"""Validation of a discovered topology against a fabric spec.

:func:`validate` runs every rule the spec asks for and returns a
:class:`ValidationReport`: one :class:`Check` per rule and subject (a host,
a GPU, a NIC), each with what was expected, what was found, pass/fail/skip,
and which host, GPU and NIC it is about. Measured bandwidths come in as data
(``{link class: GB/s}``) because measuring needs the runtime above this layer.

Rules, in report order: nodes, cpus, gpu-count, gpu-model, gpu-memory,
nvlink-topology, nvlink-lanes, nvlink-bandwidth, nic-count, nic-state, nic-rate,
gpu-nic-affinity, nic-numa, gpudirect, bandwidth.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

from topology import linkmodel
from topology._common import natural_key
from topology.host import GPUDIRECT_MAX_PATH, assign_nics
from topology.sizes import GIB
from topology.spec import BANDWIDTH_CLASSES, FabricSpec
from topology.types import ClusterTopology, GpuNicPair, HostTopology, LinkKind

__all__ = ["CheckStatus", "Check", "ValidationReport", "validate", "RULES"]

RULES = ("nodes", "cpus", "gpu-count", "gpu-model", "gpu-memory", "nvlink-topology",
         "nvlink-lanes", "nvlink-bandwidth", "nic-count", "nic-state", "nic-rate",
         "gpu-nic-affinity", "nic-numa", "gpudirect", "bandwidth")


class CheckStatus(enum.Enum):
    PASS = "pass"
    FAIL = "FAIL"
    SKIP = "skip"


@dataclass(frozen=True)
class Check:
    """One rule applied to one subject. ``host``/``gpu``/``nic`` say what is at fault."""

    rule: str
    subject: str
    expected: str
    found: str
    status: CheckStatus
    host: str = ""
    gpu: int | None = None
    nic: str | None = None

    @property
    def passed(self) -> bool:
        return self.status is not CheckStatus.FAIL

    def to_dict(self) -> dict:
        return {"rule": self.rule, "subject": self.subject, "expected": self.expected,
                "found": self.found, "status": self.status.value.lower(), "host": self.host,
                "gpu": self.gpu, "nic": self.nic}


@dataclass(frozen=True)
class ValidationReport:
    """Every check of one validation; ``passed`` when none failed."""

    spec: str
    spec_path: str
    description: str
    checks: tuple[Check, ...]
    hosts: tuple[str, ...] = ()
    num_nodes: int = 0
    num_ranks: int = 0

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.status is CheckStatus.FAIL)

    def counts(self) -> dict[str, int]:
        out = {s.value.lower(): 0 for s in CheckStatus}
        for c in self.checks:
            out[c.status.value.lower()] += 1
        return out

    def to_dict(self) -> dict:
        return {"spec": self.spec, "spec_path": self.spec_path, "passed": self.passed,
                "hosts": list(self.hosts), "nodes": self.num_nodes, "ranks": self.num_ranks,
                "counts": self.counts(), "checks": [c.to_dict() for c in self.checks]}

    def format_text(self, verbose: bool = False) -> str:
        """A table with one line per rule, then the failing and skipped checks
        under it (every check with ``verbose``)."""
        lines = [f"fabric spec {self.spec} ({self.spec_path})"]
        if self.description:
            lines.append(f"  {self.description}")
        hosts = ", ".join(self.hosts[:4]) + (" ..." if len(self.hosts) > 4 else "")
        lines.append(f"topology: {len(self.hosts)} host{'s' * (len(self.hosts) != 1)} "
                     f"({hosts}), {self.num_nodes} node{'s' * (self.num_nodes != 1)}, "
                     f"{self.num_ranks} rank{'s' * (self.num_ranks != 1)}")
        lines.append("")
        lines.append(f"{'RESULT':<7} {'RULE':<22} {'PASSED':>7}  EXPECTED")
        groups: dict[str, list[Check]] = {}
        for c in self.checks:
            key = c.rule if c.rule != "bandwidth" else f"bandwidth {c.subject.split()[0]}"
            groups.setdefault(key, []).append(c)
        for rule, checks in groups.items():
            statuses = {c.status for c in checks}
            status = (CheckStatus.FAIL if CheckStatus.FAIL in statuses else
                      CheckStatus.PASS if CheckStatus.PASS in statuses else CheckStatus.SKIP)
            npass = sum(c.status is CheckStatus.PASS for c in checks)
            lines.append(f"{status.value:<7} {rule:<22} {npass:>3}/{len(checks):<3}  "
                         f"{checks[0].expected}")
            for c in checks:
                if verbose or c.status is not CheckStatus.PASS or c.rule == "bandwidth":
                    lines.append(f"          {c.status.value:<4} {c.subject}: {c.found}")
        n = self.counts()
        verdict = "PASS" if self.passed else "FAIL"
        lines.append("")
        lines.append(f"{verdict}: {len(self.checks)} checks, {n['pass']} passed, "
                     f"{n['fail']} failed, {n['skip']} skipped")
        return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def validate(topology: ClusterTopology | HostTopology, spec: FabricSpec,
             measured: Mapping | None = None, *,
             measured_notes: Mapping[str, str] | None = None) -> ValidationReport:
    """Check ``topology`` against ``spec``.

    ``measured`` maps a link class (``"shm"``, ``"roce"``, a :class:`LinkKind`,
    or ``"allreduce_bus"``) to measured GB/s; ``measured_notes`` says how each
    was measured (shown next to the figure). Without ``measured`` the
    bandwidth rules are skipped.
    """
    if isinstance(topology, HostTopology):
        topology = ClusterTopology.single(topology)
    if not isinstance(topology, ClusterTopology):
        raise TypeError(f"topology: expected ClusterTopology or HostTopology, "
                        f"got {type(topology).__name__}")
    if not isinstance(spec, FabricSpec):
        raise TypeError(f"spec: expected FabricSpec, got {type(spec).__name__}")
    gbs = _normalize_measured(measured)
    checks: list[Check] = []
    hosts = topology.hosts
    names = [h.hostname for h in hosts]
    checks.append(_check("nodes", "cluster", _plural(spec.nodes, "host"),
                         f"{_plural(len(hosts), 'host')} ({', '.join(names[:4])}"
                         f"{' ...' if len(names) > 4 else ''})", len(hosts) == spec.nodes))
    for h in hosts:
        checks.extend(_host_checks(h, spec))
    checks.extend(_bandwidth_checks(spec, gbs, measured is not None, measured_notes or {}))
    return ValidationReport(spec.name, spec.source, spec.description, tuple(checks),
                            tuple(names), topology.num_nodes, topology.size)


def _normalize_measured(measured) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in (measured or {}).items():
        name = key.value if isinstance(key, LinkKind) else str(key)
        if name not in BANDWIDTH_CLASSES:
            raise ValueError(f"measured: expected link classes from {list(BANDWIDTH_CLASSES)}, "
                             f"got {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"measured[{name!r}]: expected GB/s >= 0, got {value!r}")
        out[name] = float(value)
    return out


def _check(rule, subject, expected, found, ok, host="", gpu=None, nic=None) -> Check:
    return Check(rule, subject, expected, found, CheckStatus.PASS if ok else CheckStatus.FAIL,
                 host, gpu, nic)


def _skip(rule, subject, expected, why, host="", gpu=None, nic=None) -> Check:
    return Check(rule, subject, expected, why, CheckStatus.SKIP, host, gpu, nic)


def _host_checks(h: HostTopology, spec: FabricSpec) -> list[Check]:
    name = h.hostname
    out = []
    if spec.min_cpus:
        out.append(_check("cpus", name, f">= {spec.min_cpus} CPUs", f"{h.cpus} CPUs",
                          h.cpus >= spec.min_cpus, name))
    found = _plural(len(h.gpus), "GPU")
    if not h.gpus:
        found += " (CPU-only host)"
    out.append(_check("gpu-count", name, _plural(spec.gpus, "GPU"), found,
                      len(h.gpus) == spec.gpus, name))
    for g in h.gpus:
        subject = f"{name} GPU{g.index}"
        if spec.gpu_model:
            ok = spec.gpu_model.lower() in g.name.lower()
            out.append(_check("gpu-model", subject, f"name contains {spec.gpu_model!r}",
                              g.name or "unknown model", ok, name, g.index))
        if spec.min_gpu_memory_gib:
            expected = f">= {spec.min_gpu_memory_gib:g} GiB"
            if g.memory_bytes is None:
                out.append(_skip("gpu-memory", subject, expected, "memory unknown (no NVML or "
                                 "--query-gpu output)", name, g.index))
            else:
                gib = g.memory_bytes / GIB
                out.append(_check("gpu-memory", subject, expected, f"{gib:g} GiB",
                                  gib >= spec.min_gpu_memory_gib, name, g.index))
    if spec.nvlink is not None and h.gpus:
        out.extend(_nvlink_checks(h, spec))
    if spec.nic is not None:
        out.extend(_nic_checks(h, spec))
    return out


def _cube_mesh_edges(n: int = 8) -> set[tuple[int, int]]:
    """DGX-1 hybrid cube-mesh: two fully connected quads, GPU i joined to GPU i+4."""
    quads = [(a, b) for q in (0, 4) for a in range(q, q + 4) for b in range(a + 1, q + 4)]
    return set(quads) | {(i, i + 4) for i in range(4)}


def _nvlink_checks(h: HostTopology, spec: FabricSpec) -> list[Check]:
    nv = spec.nvlink
    name = h.hostname
    out = []
    idx = [g.index for g in h.gpus]
    edges = {(min(int(link.a[3:]), int(link.b[3:])), max(int(link.a[3:]), int(link.b[3:])))
             for link in h.links if link.kind is LinkKind.NVLINK
             and link.a.startswith("GPU") and link.b.startswith("GPU")}
    if nv.topology == "all-to-all":
        want = {(a, b) for i, a in enumerate(idx) for b in idx[i + 1:]}
        expected = f"every pair of {len(idx)} GPUs on NVLink"
    else:
        want = _cube_mesh_edges()
        expected = "hybrid cube-mesh (quads 0-3, 4-7 + GPU i <-> i+4)"
    missing, extra = sorted(want - edges), sorted(edges - want)
    problems = []
    if missing:
        problems.append("no NVLink " + ", ".join(f"GPU{a}-GPU{b}" for a, b in missing))
    if extra and nv.topology != "all-to-all":
        problems.append("unexpected NVLink " + ", ".join(f"GPU{a}-GPU{b}" for a, b in extra))
    found = "; ".join(problems) if problems else f"{len(edges)} NVLink pairs as expected" + (
        " (NVSwitch)" if h.nvswitch else "")
    out.append(_check("nvlink-topology", name, expected, found, not problems, name))
    for g in h.gpus:
        subject = f"{name} GPU{g.index}"
        out.append(_check("nvlink-lanes", subject, f">= {nv.min_lanes} NVLink links per GPU",
                          f"{g.nvlink_lanes} links", g.nvlink_lanes >= nv.min_lanes, name, g.index))
        if nv.min_bandwidth_gbs:
            bw = g.nvlink_lanes * linkmodel.nvlink_lane_bandwidth(g.name) / 1e9
            out.append(_check("nvlink-bandwidth", subject,
                              f">= {nv.min_bandwidth_gbs:g} GB/s per GPU (links x per-link rate)",
                              f"{bw:g} GB/s ({g.nvlink_lanes} x "
                              f"{linkmodel.nvlink_lane_bandwidth(g.name) / 1e9:g} GB/s)",
                              bw >= nv.min_bandwidth_gbs, name, g.index))
    return out


def _nic_checks(h: HostTopology, spec: FabricSpec) -> list[Check]:
    ns = spec.nic
    name = h.hostname
    layer = ns.link_layer
    label = "RoCE" if layer.value == "Ethernet" else "InfiniBand"
    compute = sorted((n for n in h.nics if n.link_layer is layer), key=lambda n: natural_key(n.name))
    others = [f"{n.name} ({n.link_layer.value})" for n in h.nics if n.link_layer is not layer]
    found = _plural(len(compute), f"{label} port") + (
        f": {', '.join(n.name for n in compute)}" if compute else "")
    if others:
        found += f"; other: {', '.join(others)}"
    if not h.nics:
        found += " (no RDMA NIC on this host)"
    out = [_check("nic-count", name, f">= {ns.count} {label} NIC ports", found,
                  len(compute) >= ns.count, name)]
    for n in compute:
        subject = f"{name} {n.name}"
        out.append(_check("nic-state", subject, "port ACTIVE", f"port {n.port} {n.state.value}",
                          n.active, name, nic=n.name))
        out.append(_check("nic-rate", subject, f">= {ns.min_rate_gbps:g} Gb/s",
                          f"{n.rate_gbps:g} Gb/s", n.rate_gbps >= ns.min_rate_gbps, name,
                          nic=n.name))
    if not h.gpus or not compute:
        return out
    if ns.gpu_affinity == "one-per-gpu":
        chosen = assign_nics(h, compute)
        expected = f"a NIC of its own within {ns.max_path.value}"
    else:
        chosen = {}
        for g in h.gpus:
            pairs = sorted((p for p in h.gpu_nic if p.gpu == g.index and
                            p.nic in {n.name for n in compute}),
                           key=lambda p: (p.path.distance, p.gpu, natural_key(p.nic)))
            if pairs:
                chosen[g.index] = pairs[0]
        expected = f"a NIC within {ns.max_path.value}"
    nic_numa = {n.name: n.numa for n in h.nics}
    for g in h.gpus:
        subject = f"{name} GPU{g.index}"
        pair: GpuNicPair | None = chosen.get(g.index)
        if pair is None:
            why = ("no free " if ns.gpu_affinity == "one-per-gpu" else "no ") + f"{label} NIC left"
            out.append(_check("gpu-nic-affinity", subject, expected, why, False, name, g.index))
            if ns.numa_local:
                out.append(_skip("nic-numa", subject, "NIC on the GPU's NUMA node",
                                 "no NIC paired (see gpu-nic-affinity)", name, g.index))
            if ns.gpudirect:
                out.append(_skip("gpudirect", subject, "GPUDirect RDMA to its NIC",
                                 "no NIC paired (see gpu-nic-affinity)", name, g.index))
            continue
        ok = pair.path.within(ns.max_path)
        out.append(_check("gpu-nic-affinity", subject, expected, f"{pair.nic} at {pair.path.value}",
                          ok, name, g.index, pair.nic))
        if ns.numa_local:
            nn = nic_numa.get(pair.nic)
            ok = g.numa is not None and nn == g.numa
            found = f"{pair.nic} on NUMA {_numa(nn)}, GPU{g.index} on NUMA {_numa(g.numa)}"
            out.append(_check("nic-numa", subject, "NIC on the GPU's NUMA node", found, ok,
                              name, g.index, pair.nic))
        if ns.gpudirect:
            if not h.gpudirect_module:
                found = (f"off with {pair.nic}: no peer-memory module (nvidia_peermem / "
                         "nv_peer_mem) loaded")
            elif not pair.gpudirect:
                found = (f"off with {pair.nic}: path {pair.path.value} is beyond "
                         f"{GPUDIRECT_MAX_PATH.value}")
            else:
                found = f"on with {pair.nic} ({h.gpudirect_module}, {pair.path.value})"
            out.append(_check("gpudirect", subject, "GPUDirect RDMA to its NIC", found,
                              pair.gpudirect and bool(h.gpudirect_module), name, g.index, pair.nic))
    return out


def _numa(n) -> str:
    return "?" if n is None else str(n)


def _bandwidth_checks(spec: FabricSpec, gbs: dict[str, float], was_measured: bool,
                      notes: Mapping[str, str]) -> list[Check]:
    out = []
    for cls, minimum in spec.bandwidth:
        subject = "allreduce bus bandwidth" if cls == "allreduce_bus" else f"{cls} point-to-point"
        expected = f"{cls} >= {minimum:g} GB/s"
        if cls in gbs:
            note = f" ({notes[cls]})" if cls in notes else ""
            out.append(_check("bandwidth", subject, expected, f"{gbs[cls]:.3g} GB/s{note}",
                              gbs[cls] >= minimum))
        elif not was_measured:
            out.append(_skip("bandwidth", subject, expected, "not measured (run with --measure)"))
        else:
            why = notes.get(cls) or "not measured: no such path in this job"
            out.append(_skip("bandwidth", subject, expected, why))
    return out
