"""Parsers of captured ``nvidia-smi`` output, and its live capture.

``nvidia-smi topo -m`` prints a tab-separated matrix: a header row of device
labels (``GPU0``.., then NICs as ``NIC0``.. with a ``NIC Legend`` naming them,
or by device name on older drivers) followed by ``CPU Affinity``, ``NUMA
Affinity`` and ``GPU NUMA ID`` columns; one row per GPU and per NIC (NIC
rows carry no affinity columns); then the legend. Cells are ``X`` (self),
``NV#`` (# bonded NVLinks) or a PCIe path class (PIX, PXB, PHB, NODE, SYS).

``nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total --format=csv``
prints a CSV header (``memory.total [MiB]``) and one row per GPU.

Malformed input warns (:class:`~topology.types.ProbeWarning` naming the
source) and the parser keeps what it could read.
"""
from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from topology._common import normalize_bus_id, warn
from topology.sizes import UNITS
from topology.types import Gpu

__all__ = ["SmiMatrix", "parse_topo_matrix", "parse_query_gpu", "capture", "TOPO_ARGS",
           "QUERY_ARGS"]

TOPO_ARGS = ("topo", "-m")
QUERY_ARGS = ("--query-gpu=index,name,uuid,pci.bus_id,memory.total", "--format=csv")

_CELL = r"(?:X|NV\d+|PIX|PXB|PHB|NODE|SYS|N/A)"
_CELL_RE = re.compile(rf"^{_CELL}$")
_CELLS_RE = re.compile(rf"^(?:{_CELL})+$")
_AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")


@dataclass(frozen=True)
class SmiMatrix:
    """What ``nvidia-smi topo -m`` says.

    ``labels``: row/column labels in order (``GPU0``, ``NIC0``/``mlx5_0``);
    ``cells[(a, b)]``: the cell text; ``nic_names``: NIC label -> device name;
    ``cpu_affinity``/``numa``: per GPU label (None when ``N/A``).
    """

    labels: tuple[str, ...] = ()
    cells: dict = field(default_factory=dict)
    nic_names: dict = field(default_factory=dict)
    cpu_affinity: dict = field(default_factory=dict)
    numa: dict = field(default_factory=dict)

    @property
    def gpu_labels(self) -> list[str]:
        return [x for x in self.labels if re.fullmatch(r"GPU\d+", x)]

    @property
    def nic_labels(self) -> list[str]:
        return [x for x in self.labels if not re.fullmatch(r"GPU\d+", x)]

    def nic_name(self, label: str) -> str:
        return self.nic_names.get(label, label)


def _split_header(line: str) -> list[str]:
    parts = line.split("\t") if "\t" in line else re.split(r"\s{2,}", line)
    out: list[str] = []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        # some drivers drop a tab between labels ("NIC8NIC9"): split them again
        if re.fullmatch(r"(?:(?:GPU|NIC)\d+){2,}", part):
            out.extend(re.findall(r"(?:GPU|NIC)\d+", part))
        else:
            out.append(part)
    return out


def _split_cells(tokens: list[str]) -> list[str]:
    out: list[str] = []
    for tok in tokens:
        if not _CELL_RE.match(tok) and _CELLS_RE.match(tok):  # "NODENODE"
            out.extend(re.findall(_CELL, tok))
        else:
            out.append(tok)
    return out


def _is_header(line: str) -> bool:
    tokens = line.split()
    if "GPU0" not in tokens:
        return False
    # the header starts with a tab; the GPU0 row starts with its label then "X"
    return not (tokens[0] == "GPU0" and len(tokens) > 1 and tokens[1] == "X")


def parse_topo_matrix(text: str, source: str = "nvidia-smi topo -m") -> SmiMatrix:
    """Parse ``nvidia-smi topo -m`` output (see the module docstring)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if _is_header(ln)), None)
    if start is None:
        reason = ("no GPU found" if "No devices were found" in text
                  else "no header row with GPU0 (not `nvidia-smi topo -m` output?)")
        warn(source, f"{reason}; matrix ignored")
        return SmiMatrix()
    header = _split_header(lines[start])
    labels = []
    for col in header:
        if col in _AFFINITY_COLUMNS:
            break
        labels.append(col)
    extra = header[len(labels):]
    n = len(labels)
    cells: dict = {}
    cpu_affinity: dict = {}
    numa: dict = {}
    seen: set[str] = set()
    i = start + 1
    while i < len(lines) and lines[i].strip() and not lines[i].startswith("Legend"):
        tokens = lines[i].split()
        i += 1
        label, rest = tokens[0], _split_cells(tokens[1:])
        if label not in labels:
            warn(source, f"row {label!r} is not in the header; row skipped")
            continue
        row, tail = rest[:n], rest[n:]
        bad = [c for c in row if not _CELL_RE.match(c)]
        if len(row) < n or bad:
            warn(source, f"row {label}: expected {n} cells of X/NV#/PIX/PXB/PHB/NODE/SYS, "
                         f"got {rest[:n]!r}; row skipped")
            continue
        seen.add(label)
        for col, cell in zip(labels, row):
            if col != label:
                cells[(label, col)] = cell
        if label.startswith("GPU") and tail:
            values = dict(zip(extra, tail))
            aff = values.get("CPU Affinity", "N/A")
            cpu_affinity[label] = None if aff == "N/A" else aff
            node = values.get("NUMA Affinity", "N/A")
            numa[label] = int(node) if node.isdigit() else None
    missing = [x for x in labels if x not in seen]
    if missing:
        warn(source, f"no valid row for {missing}")
    nic_names = {}
    for line in lines[i:]:
        m = re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line)
        if m:
            nic_names[m.group(1)] = m.group(2)
    for label in labels:
        if re.fullmatch(r"NIC\d+", label) and label not in nic_names:
            warn(source, f"{label} has no entry in the NIC Legend; device name unknown")
    return SmiMatrix(tuple(labels), cells, nic_names, cpu_affinity, numa)


def _memory_bytes(text: str) -> int | None:
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB)\s*$", text)
    return int(float(m.group(1)) * UNITS[m.group(2).lower()]) if m else None


def parse_query_gpu(text: str, source: str = "nvidia-smi --query-gpu") -> tuple[Gpu, ...]:
    """GPUs from ``nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total
    --format=csv`` output (columns found by their header names)."""
    rows = list(csv.reader(io.StringIO(text), skipinitialspace=True))
    rows = [r for r in rows if any(c.strip() for c in r)]
    if not rows:
        warn(source, "empty output; no GPUs")
        return ()
    header = [re.sub(r"\s*\[.*\]$", "", h.strip()) for h in rows[0]]
    if "index" not in header:
        warn(source, f"header {rows[0]!r} has no 'index' column (not --format=csv output?)")
        return ()
    col = {name: k for k, name in enumerate(header)}
    gpus = []
    for lineno, row in enumerate(rows[1:], 2):
        if len(row) != len(header) or not row[col["index"]].strip().isdigit():
            warn(source, f"line {lineno}: malformed row {row!r}; skipped")
            continue

        def get(name: str) -> str:
            value = row[col[name]].strip() if name in col else ""
            return "" if value in ("[N/A]", "N/A", "[Not Supported]") else value

        memory = _memory_bytes(get("memory.total")) if get("memory.total") else None
        if get("memory.total") and memory is None:
            warn(source, f"line {lineno}: malformed memory.total {get('memory.total')!r}")
        gpus.append(Gpu(int(get("index")), get("name"), get("uuid"),
                        normalize_bus_id(get("pci.bus_id")), memory))
    return tuple(gpus)


def capture(args, timeout: float = 30.0) -> str | None:
    """Output of ``nvidia-smi *args`` on this host, or None with a warning."""
    exe = shutil.which("nvidia-smi")
    source = "nvidia-smi " + " ".join(args)
    if exe is None:
        warn(source, "nvidia-smi is not on PATH (no NVIDIA driver on this host?)")
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        warn(source, f"could not run ({exc})")
        return None
    if done.returncode != 0:
        first = (done.stderr or done.stdout).strip().splitlines()[:1]
        warn(source, f"exit status {done.returncode}: {first[0] if first else 'no message'}")
        return None
    return done.stdout
