"""Fit the fabric model to measurements, and compare the two.

``neocomm bench --json`` writes what one sweep measured; :func:`read_bench`
turns it into :class:`Measurement` rows (the call the bench timed: its
operation, group shape, size and the algorithm that ran). :func:`fit` adjusts
the terms of a :class:`~collectives.types.FabricModel` until the model's time
for every row (:func:`collectives.cost.call_seconds`, the selection's own
code) is as close as it gets to the measured time, in the least-squares sense
on ``log(predicted / measured)``: a row 20 % off counts the same at 4 KiB and
at 64 MiB. :func:`compare` prints the two side by side.

The fitted terms (:data:`TERMS`): the latency and bandwidth of the intra-node
link and (with measurements on more than one node) of the inter-node link (over
TCP its latency, and in place of its declared line rate the fraction of it the
transport reaches, the hosts' per-byte work and per-message cost), the
node's shared memory bandwidth, local copy and reduction rates, the software
overheads of a call and of a step issued from Python, the in-cache speedup of
local rates (the cache size is the host's, read, not fitted) and, when ranks
outnumber cores, the wait for a peer to be scheduled. A term no measurement
depends on keeps its starting value (the fabric spec's) and is reported so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from collectives.topofabric import TCP_TERMS, TERMS, Term, model_key
from collectives.types import CollectiveOp, FabricModel

__all__ = ["Measurement", "read_bench", "predicted", "fit", "Fit", "TERMS", "Comparison",
           "compare", "link_kinds", "model_table", "fabric_file", "huge_page_bytes",
           "measured_rows", "check_kinds", "fit_spec", "call_key"]


@dataclass(frozen=True)
class Measurement:
    """One timed call of a bench run: ``time`` seconds (the median of its rounds) for
    ``op`` of bench size ``size`` on ``ranks`` ranks in nodes of ``ranks_per_node``, run
    by ``algorithm``; ``api``: through neocomm's API (False: the MPI peer's bare call)."""

    op: CollectiveOp
    ranks: int
    ranks_per_node: int
    size: int
    itemsize: int
    algorithm: str
    time: float
    api: bool = True
    root: int = 0
    device: bool = False
    emulated: bool = False  # nodes emulated on one host (they share its cores)
    launch_times: tuple[float, ...] = ()  # each launch's time, when launches were merged
    #: bytes/s of the link between nodes the run was measured over, when the run says so
    #: (``link_rate_gbps``: a TCP link shaped to a rate); 0: the fabric's line rate
    line_rate: float = 0.0

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node

    def repeated(self, tolerance: float) -> bool | None:
        """Whether every launch measured this call alike (:func:`launches_agree`); None
        when one launch measured it."""
        if len(self.launch_times) < 2:
            return None
        return launches_agree(self.launch_times, self.time, tolerance)


def launches_agree(times, median: float, tolerance: float) -> bool:
    """Whether every launch's ``times`` came within ``tolerance`` of their ``median``: the
    host repeating itself, the closest any model of it can be held to it."""
    return all(abs(t / median - 1.0) <= tolerance for t in times)


def link_kinds(source: str) -> tuple[str, str] | None:
    """``(intra, inter)`` link classes named by a fabric's ``source`` text ("... X within
    nodes, Y xN between nodes"), or None."""
    import re

    m = re.search(r"(\w+) within nodes, (\w+) x\d+ between nodes", source or "")
    return (m.group(1), m.group(2)) if m else None


def _run_kinds(run: dict) -> tuple[str, str] | None:
    """``(intra, inter)`` link classes of the fabric one bench run was measured on: its
    ``fabric_links``, or what its ``fabric_source`` names (results of older versions)."""
    links = run.get("fabric_links")
    if isinstance(links, dict):
        return links.get("intra", ""), links.get("inter", "")
    return link_kinds(run.get("fabric_source", ""))


def read_bench(data: dict, where: str = "bench JSON") -> list[Measurement]:
    """The rows of one ``neocomm bench --json`` result. ValueError naming ``where`` for a
    file that is not one, or a run whose calls the model does not price (``--bare``,
    ``--prepared``, ``-R``)."""
    if not isinstance(data, dict) or data.get("kind") != "neocomm-bench":
        raise ValueError(f"{where}: not a `neocomm bench --json` result")
    for flag, what in (("bare", "--bare"), ("prepared", "--prepared"), ("symmetric", "-R")):
        if data.get(flag):
            raise ValueError(f"{where}: measured with {what}; calibrate from the calls a user "
                             f"makes (run neocomm bench without {what})")
    op = CollectiveOp.parse(data["op"])
    itemsize = 2 if data.get("dtype") in ("float16", "bfloat16") else \
        int(np.dtype(data.get("dtype", "float32")).itemsize)
    kinds = _run_kinds(data)
    emulated = int(data.get("nodes", 1)) > 1 and bool(kinds) and kinds[1] == "shm"
    line_rate = float(data.get("link_rate_gbps") or 0.0) * 1e9 / 8
    out = []
    for row in data.get("rows", []):
        algo = row.get("chosen") or row["algo"]
        api = algo != "mpi"
        out.append(Measurement(op, int(data["ranks"]), int(data["ranks_per_node"]),
                               int(row["size"]), itemsize, "native" if not api else algo,
                               float(row["time"]), api, int(data.get("root", 0)),
                               bool(data.get("device")), emulated,
                               tuple(float(t) for t in row.get("launch_times", ())),
                               line_rate))
    return out


def predicted(m: Measurement, fabric: FabricModel) -> float:
    """The model's seconds for the call of ``m`` on ``fabric``'s links in ``m``'s shape."""
    from collectives.cost import call_seconds
    from collectives.simulate import bench_request

    fab = fabric.with_shape(m.ranks_per_node, m.nodes)
    if m.line_rate > 0 and fab.inter.kind == "tcp":  # measured over a link of this rate
        fab = replace(fab, inter=replace(fab.inter, bandwidth=m.line_rate))
    if m.emulated:
        fab = fab.emulated()
    request = bench_request(m.op, m.size, m.itemsize, m.ranks, device=m.device, root=m.root)
    return call_seconds(m.op, m.algorithm, request, fab, api=m.api)


#: weight of each term's log distance from its starting value in :func:`fit`, chosen on
#: the recorded runs of this project's 2-core host: fitted to the 2-rank calls, the
#: 4-rank ones within 25 % rise from 6 of 128 (no weight) to 77, while the fitted calls
#: keep their error (median 0.122 to 0.116, with the per-operation overheads); fitted to
#: the oversubscribed 4-rank calls, the 2-rank ones within 25 % go from 65 to 55
PRIOR = 0.3

#: starting values for the host terms a spec does not state (SI units)
_START = {"node_bandwidth": 8e9, "call_overhead": 5e-6, "cache_speedup": 2.0,
          "switch_latency": 10e-6, "page_cost": 0.1e-6}

#: starting values of a TCP link's host terms (SI units): TCP copies every byte twice
#: (into the sender's socket buffer, out of the receiver's), so the hosts' work per byte
#: starts at half the local copy rate (:data:`~collectives.types.DEFAULT_COPY_BANDWIDTH`,
#: 13 GB/s); a message starts at 5 us of system calls and wake-ups on the two hosts (a
#: send and a receive call, each a few microseconds); the transport starts at the full
#: line rate; a call's fixed cost over the link starts at 1 ms, about one scheduling slice
#: of a busy host (Linux's CFS gives a runnable task 0.75 to 3 ms when others wait for
#: the core): what a call loses when its first message finds its peer descheduled. (The
#: fit does not find it from much below: started at 0.1 ms, the recorded runs of the
#: test cluster leave it there, and the 5 Gbit/s run fits with a median error of 0.31
#: where 1 ms lets it reach 6.8 ms and 0.10.)
_TCP_START = {"tcp_copy_bandwidth": 6.5e9, "tcp_message_overhead": 5e-6,
              "tcp_call_overhead": 1e-3}


@dataclass(frozen=True)
class Fit:
    """The result of :func:`fit`: the fitted ``fabric`` (of one rank: give it a shape),
    the names of the ``measured`` terms and of those ``kept`` at their starting values,
    and the fit's error over the rows (``log`` ratios: median and worst absolute)."""

    fabric: FabricModel
    measured: tuple[str, ...]
    kept: tuple[str, ...]
    rows: int
    median_error: float
    worst_error: float


def huge_page_bytes(thp_mode: str) -> int:
    """The smallest host buffer backed by huge pages under the kernel's transparent huge
    page mode ``thp_mode`` (:func:`topology.sysfs.probe_thp_mode`): 2 MiB (one huge page)
    with ``always``; with ``madvise``, NumPy's threshold for asking for them (it advises
    huge pages for arrays of 4 MiB and more, numpy/_core/src/multiarray/alloc.c) when its
    advice is on; 0 (no buffer is) otherwise."""
    if thp_mode == "always":
        return 2 << 20
    if thp_mode != "madvise":
        return 0
    try:
        from numpy._core.multiarray import _get_madvise_hugepage
    except ImportError:  # pragma: no cover - NumPy 1.x
        from numpy.core.multiarray import _get_madvise_hugepage
    return 4 << 20 if _get_madvise_hugepage() else 0


def _residuals(fabric: FabricModel, rows) -> np.ndarray:
    return np.array([math.log(max(predicted(m, fabric), 1e-12) / m.time) for m in rows])


def fit(rows: list[Measurement], start: FabricModel, *, cache_bytes: int = 0,
        cores_per_node: int = 0, huge_page_bytes: int = 0, iterations: int = 60,
        prior: float = PRIOR) -> Fit:
    """Fit the terms of ``start`` (links at the spec's line rates) to ``rows``.

    ``cache_bytes`` (the host's last-level cache), ``cores_per_node`` and
    ``huge_page_bytes`` (the smallest buffer backed by huge pages, 0: none) are facts
    of the host, not fitted; with them the in-cache speedup, the scheduling wait of
    oversubscribed nodes and the per-page cost of buffers in base pages are fitted
    too. Levenberg-Marquardt on ``log(predicted / measured)`` in log space of each term;
    deterministic for the same rows.

    Each term also pays ``prior`` times its log distance from its starting value (the
    spec's rate, or 1 for a factor), as if one more row were that far off: a term
    leaves the spec only as far as the measurements ask. Without it the efficiency
    factors and the link rates trade off freely (the recorded 2-rank runs of this host
    fit a little closer with 72 GB/s shared memory and factors from 1e-15 to 24 than
    with 8.6 GB/s and factors of 0.7 to 2.3), and a fit that far from the hardware
    prices nothing it was not fitted to: the first prices those runs' 4-rank calls up
    to 21 times off, the second from 0.36 to 2.2 times (see docs/simulate.md).
    """
    rows = [m for m in rows if m.time > 0]
    if not rows:
        raise ValueError("calibration: no measurements to fit")
    fabric = replace(start, algorithm_factors=(), overhead_factors=(),
                     cache_bytes=int(cache_bytes), cores_per_node=int(cores_per_node),
                     huge_page_bytes=int(huge_page_bytes))
    tcp = fabric.inter.kind == "tcp"
    for name, value in {**_START, **(_TCP_START if tcp else {})}.items():
        term = next(t for t in TERMS if t.name == name)
        if term.value(fabric) <= term.floor:
            fabric = term.set(fabric, value)
    # over TCP the line rate is the spec's (a port's rate is known); what the transport
    # reaches of it is the fraction, fitted in its place
    fixed = ("inter_bandwidth",) if tcp else TCP_TERMS
    free = [t for t in TERMS + _factor_terms(rows)
            if t.name not in fixed and _informed(t, rows, fabric)]
    kept = tuple(t.name for t in TERMS if t not in free)

    def build(theta):
        f = fabric
        for t, x in zip(free, theta):
            f = t.set(f, t.floor + math.exp(x))
        return f

    theta = np.array([math.log(t.value(fabric) - t.floor) for t in free])
    theta0 = theta.copy()

    def residuals(th):
        return np.concatenate([_residuals(build(th), rows), prior * (th - theta0)])

    r = residuals(theta)
    cost, lam = float(r @ r), 1e-2
    for _ in range(iterations):
        jac = np.empty((len(r), len(free)))
        for j in range(len(free)):
            # a term at its ceiling moves only down: its slope is taken below it
            h_j = 1e-4 if free[j].ceiling == math.inf else -1e-4
            step = np.zeros_like(theta)
            step[j] = h_j
            jac[:, j] = (residuals(theta + step) - r) / h_j
        g, h = jac.T @ r, jac.T @ jac
        improved = False
        for _ in range(8):
            delta = np.linalg.solve(h + lam * np.diag(np.diag(h) + 1e-9), -g)
            trial = theta + np.clip(delta, -3.0, 3.0)
            rt = residuals(trial)
            if float(rt @ rt) < cost:
                theta, r, cost, lam, improved = trial, rt, float(rt @ rt), lam / 3, True
                break
            lam *= 4
        if not improved or float(np.abs(delta).max()) < 1e-5:
            break
    err = np.abs(r[:len(rows)])
    return Fit(build(theta), tuple(t.name for t in free), kept, len(rows),
               float(np.median(err)), float(err.max()))


def _factor_terms(rows) -> tuple[Term, ...]:
    """One efficiency factor per operation and algorithm that ran (``"<op>/<algorithm>"``
    of :attr:`FabricModel.algorithm_factors`): how much slower (or faster) its
    implementation runs than the schedule its formula describes, at every size; and one
    per operation called through the API (``"<op>"`` of
    :attr:`FabricModel.overhead_factors`): its call overhead over the shared one."""
    def term(field: str, label: str, key: str) -> Term:
        def get(f: FabricModel) -> float:
            return dict(getattr(f, field)).get(key, 1.0)

        def put(f: FabricModel, v: float) -> FabricModel:
            factors = dict(getattr(f, field))
            factors[key] = v
            return replace(f, **{field: tuple(sorted(factors.items()))})

        return Term(f"{label} {key}", "x", 1.0, get, put)

    algos = sorted({f"{m.op.value}/{m.algorithm}" for m in rows})
    ops = sorted({m.op.value for m in rows if m.api})
    return tuple(term("algorithm_factors", "factor", k) for k in algos) + \
        tuple(term("overhead_factors", "overhead", k) for k in ops)


def _informed(term: Term, rows, fabric: FabricModel) -> bool:
    """Whether some row's predicted time moves when ``term`` does."""
    value = term.value(fabric)
    grow = 1.5 if term.ceiling == math.inf else 1 / 1.5  # a capped term is moved down
    bumped = term.set(fabric, term.floor + (value - term.floor) * grow)
    for m in rows:
        before = predicted(m, fabric)
        if abs(predicted(m, bumped) - before) > 1e-6 * before:
            return True
    return False


@dataclass(frozen=True)
class Comparison:
    """One measurement beside the model's prediction for it."""

    measurement: Measurement
    predicted: float

    @property
    def ratio(self) -> float:
        """predicted / measured."""
        return self.predicted / self.measurement.time

    def within(self, tolerance: float) -> bool:
        return abs(self.ratio - 1.0) <= tolerance

    def to_dict(self) -> dict:
        m = self.measurement
        out = {"op": m.op.value, "ranks": m.ranks, "nodes": m.nodes, "size": m.size,
               "algorithm": m.algorithm, "api": m.api, "measured_s": m.time,
               "predicted_s": self.predicted, "ratio": self.ratio}
        if m.launch_times:
            out["launch_times_s"] = list(m.launch_times)
        if m.line_rate:
            out["link_rate_gbps"] = m.line_rate * 8 / 1e9
        return out


def compare(rows: list[Measurement], fabric: FabricModel) -> list[Comparison]:
    """Every row beside its prediction on ``fabric``."""
    return [Comparison(m, predicted(m, fabric)) for m in rows]


def model_table(result: Fit, *, buffers: str, kinds: tuple[str, str], measured_on: str) -> dict:
    """The ``[model]`` table of a fabric file for a :class:`Fit` (see
    :data:`topology.spec.MODEL_KEYS`)."""
    f = result.fabric
    table: dict = {"buffers": buffers, "intra_link": kinds[0], "inter_link": kinds[1],
                   "measured_on": measured_on}
    for term in TERMS:
        if term.name in TCP_TERMS and kinds[1] != "tcp":
            continue
        table[model_key(term)] = float(f"{term.value(f) / term.scale:.6g}")
    table["cache_mib"] = float(f"{f.cache_bytes / (1 << 20):.6g}")
    table["cores_per_node"] = int(f.cores_per_node)
    table["huge_page_mib"] = float(f"{f.huge_page_bytes / (1 << 20):.6g}")
    table["factors"] = {k: float(f"{v:.6g}") for k, v in f.algorithm_factors}
    table["overhead_factors"] = {k: float(f"{v:.6g}") for k, v in f.overhead_factors}
    table["measured"] = sorted(result.measured)
    table["fit_rows"] = result.rows
    table["fit_median_error"] = float(f"{result.median_error:.4g}")
    table["fit_worst_error"] = float(f"{result.worst_error:.4g}")
    return table


def fabric_file(base_text: str, table: dict) -> str:
    """A fabric spec's text with ``table`` as its ``[model]`` (an old one dropped)."""
    lines, skip = [], False
    for line in base_text.splitlines():
        head = line.strip()
        if head.startswith("[") and head.endswith("]"):
            skip = head == "[model]"
        if not skip:
            lines.append(line)
    while lines and not lines[-1].strip():
        lines.pop()
    out = lines + ["", "# the cost model's terms, fitted by neocomm simulate calibrate", "[model]"]
    for key, value in table.items():
        out.append(f"{key} = {_toml(value)}")
    return "\n".join(out) + "\n"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    return repr(value)


#: every operation :func:`run_benches` measures by default
OPS = tuple(op.value for op in CollectiveOp)


def run_benches(layouts, *, ops=OPS, minbytes: int = 4 << 10, maxbytes: int = 64 << 20,
                factor: float = 4.0, out_dir: str, device: bool = False, hostfile=None,
                timeout: float = 600.0, echo=None, launches: int = 1) -> list[dict]:
    """Run ``neocomm bench OP OP ... --json`` (every op of ``ops``, one after the other in
    one job) on every ``(ranks, ranks_per_node)`` of ``layouts`` (nodes emulated on this host
    unless a ``hostfile`` spreads them: each layout on the first of its hosts,
    ``ranks_per_node`` to a host), ``launches`` times over (every layout once, then again),
    and return the results, each launch's runs merged by :func:`median_of_launches`.
    ``echo(text)`` hears each command. RuntimeError naming the command, what its ranks said
    of why and the file with its whole output when one fails (the output of every launch
    is kept beside its results, ``bench-...-N.log``)."""
    import os
    import shutil
    import json

    from neocomm.hostfile import layout_hostfile
    from neocomm.launcher import run_job

    if isinstance(launches, bool) or not isinstance(launches, int) or launches < 1:
        raise ValueError(f"launches: expected a count >= 1, got {launches!r}")
    exe = shutil.which("neocomm")
    if exe is None:
        raise RuntimeError("calibration: the neocomm command is not on PATH (pip install it)")
    out = []
    for launch, (ranks, per_node) in ((k, lay) for k in range(launches) for lay in layouts):
        pattern = os.path.join(out_dir, f"bench-{ranks}r-{ranks // per_node}n-{{op}}-"
                                        f"{launch}.json")
        cmd = [exe, "run", "-n", str(ranks), "--ranks-per-node", str(per_node),
               "--timeout", str(int(timeout))]
        if hostfile:  # the layout's hosts, per_node ranks on each
            cmd += ["--hostfile", layout_hostfile(
                hostfile, ranks // per_node, per_node,
                os.path.join(out_dir, f"hosts-{ranks}r-{ranks // per_node}n"))]
        cmd += ["--", exe, "bench", *ops, "-b", str(minbytes), "-e", str(maxbytes),
                "-f", str(factor), "--json", pattern] + (["--device"] if device else [])
        if echo:
            echo(" ".join(cmd[1:]).replace(exe, "neocomm"))
        paths = [pattern.replace("{op}", op) for op in ops]
        run_job(cmd, what="calibration", expect=tuple(paths), shown=" ".join(cmd[1:]),
                log=os.path.join(out_dir, f"bench-{ranks}r-{ranks // per_node}n-{launch}.log"))
        for path in paths:
            with open(path, encoding="utf-8") as fh:
                out.append(json.load(fh))
    return median_of_launches(out)


#: what makes two bench runs the same measurement, launched twice
_SAME_RUN = ("op", "ranks", "ranks_per_node", "nodes", "dtype", "reduce_op", "root", "device",
             "peer", "bare", "prepared", "symmetric", "host", "link_rate_gbps")


def median_of_launches(runs: list[dict]) -> list[dict]:
    """``runs`` with the runs of one measurement (same op, layout, dtype, root, buffers and
    host: several launches of one bench) merged into one, in first-seen order: each row's
    time the median over the launches that measured its size and algorithm (each launch's
    in ``launch_times``; a run merged before brings its own), and ``launches`` the number
    of runs merged. Ranks placed anew by each launch share cores, caches and memory
    differently; on an oversubscribed host one launch can measure a call twice as slow as
    the next, and the median of three takes that spread out."""
    import statistics

    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        key = tuple(str(run.get(k)) for k in _SAME_RUN)
        groups.setdefault(key, []).append(run)
    out = []
    for same in groups.values():
        times: dict[tuple, list[float]] = {}
        for run in same:
            for row in run.get("rows", []):
                times.setdefault((row.get("size"), row.get("algo")), []).extend(
                    row.get("launch_times") or [row["time"]])
        first = dict(same[0])
        first["launches"] = sum(int(r.get("launches", 1)) for r in same)
        first["rows"] = []
        for row in same[0].get("rows", []):
            each = times[(row.get("size"), row.get("algo"))]
            merged = dict(row, time=statistics.median(each))
            if len(each) > 1:
                merged["launch_times"] = each
            first["rows"].append(merged)
        out.append(first)
    return out


def read_measurements(path: str) -> list[dict]:
    """The bench results in ``path``: one ``neocomm bench --json`` result, or a file of
    several (``{"kind": "neocomm-measurements", "runs": [...]}``, as ``neocomm simulate
    validate --record`` writes). ValueError naming the file otherwise."""
    from collectives.fabric import read_json

    data = read_json(path)
    if isinstance(data, dict) and data.get("kind") == "neocomm-measurements":
        runs = data.get("runs")
        if not isinstance(runs, list) or not runs:
            raise ValueError(f"{path}: a measurements file without runs")
        return runs
    if isinstance(data, dict) and data.get("kind") == "neocomm-bench":
        return [data]
    raise ValueError(f"{path}: not a `neocomm bench --json` result nor a measurements file")


def measured_kinds(runs: list[dict]) -> tuple[str, str]:
    """``(intra, inter)`` link classes the runs were measured on (the runtime's own fabric:
    emulated nodes talk over shared memory). ValueError when runs disagree."""
    found = set()
    for run in runs:
        kinds = _run_kinds(run)
        if kinds is None:
            continue
        if int(run.get("nodes", 1)) == 1:
            kinds = (kinds[0], "")
        found.add(kinds)
    intra = {k[0] for k in found if k[0]}
    inter = {k[1] for k in found if k[1]}
    if len(intra) > 1 or len(inter) > 1:
        raise ValueError(f"measurements: runs on different fabrics (within nodes: "
                         f"{sorted(intra)}, between nodes: {sorted(inter)}); calibrate each "
                         f"fabric on its own")
    return (intra.pop() if intra else "", inter.pop() if inter else "")


def measured_rows(runs: list[dict], device: bool) -> list[Measurement]:
    """The rows of bench ``runs`` timed through the API, all of ``device`` (or host)
    buffers; ValueError saying which to pass otherwise."""
    rows = [m for i, run in enumerate(runs)
            for m in read_bench(run, f"measurement {i + 1} ({run.get('op', '?')})") if m.api]
    wrong = [m for m in rows if m.device != device]
    if wrong:
        have = "device" if wrong[0].device else "host"
        raise ValueError(f"--device: the measurements are of {have} buffers; "
                         + ("drop --device" if device else "pass --device") + " to match them")
    return rows


def check_kinds(fabric: FabricModel, kinds, spec_name: str) -> None:
    """Refuse measurements taken on links of another class than the fabric's."""
    for which, measured in zip(("intra", "inter"), kinds):
        have = getattr(fabric, which).kind
        if measured and have and measured != have:
            where = "within" if which == "intra" else "between"
            raise ValueError(f"the measurements were taken with {measured} {where} nodes, but "
                             f"fabric {spec_name!r} has {have} {where} nodes: measure on the "
                             f"fabric itself (or pick the fabric the runs were made on)")


def fit_spec(spec, runs: list[dict], rows: list[Measurement], *,
             device: bool) -> tuple[Fit, FabricModel]:
    """:func:`fit` of a fabric spec's links (its ``[model]`` aside) to ``rows`` of ``runs``,
    with this host's cache, cores and huge pages for host buffers; also the starting links."""
    import os

    from collectives.topofabric import spec_links
    from topology.sysfs import probe_cache_bytes, probe_thp_mode

    kinds = measured_kinds(runs)
    start = spec_links(replace(spec, model=()), device=device)
    if kinds[1] == "shm" and start.inter.kind != "shm" and spec.nic is None:
        # nodes emulated on one host talk over its shared memory
        start = replace(start, inter=replace(start.intra))
    check_kinds(start, kinds, spec.name)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 0)
    result = fit(rows, start, cache_bytes=0 if device else probe_cache_bytes(),
                 cores_per_node=0 if device else cores,
                 huge_page_bytes=0 if device else huge_page_bytes(probe_thp_mode()))
    return result, start


def call_key(m: Measurement) -> tuple:
    """What identifies a measured call across measurements of it."""
    return (m.op, m.ranks, m.ranks_per_node, m.size, m.algorithm, m.root, m.line_rate)
