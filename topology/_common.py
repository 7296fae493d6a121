"""Small helpers shared by the probes: warnings that name their source, CPU lists."""
from __future__ import annotations

import re
import warnings

from topology.types import ProbeWarning

__all__ = ["warn", "parse_cpulist", "format_cpulist", "normalize_bus_id", "natural_key"]


def warn(source: str, message: str) -> None:
    """Emit a :class:`ProbeWarning` reading ``"<source>: <message>"``."""
    warnings.warn(f"{source}: {message}", ProbeWarning, stacklevel=3)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``"0-15,128-143"`` -> (0, ..., 15, 128, ..., 143). ValueError when malformed."""
    cpus: list[int] = []
    text = text.strip()
    if not text:
        return ()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if sep:
            a, b = int(lo), int(hi)
            if b < a:
                raise ValueError(f"bad CPU range {part!r}")
            cpus.extend(range(a, b + 1))
        else:
            cpus.append(int(lo))
    return tuple(sorted(set(cpus)))


def format_cpulist(cpus) -> str:
    """Inverse of :func:`parse_cpulist`: (0, 1, 2, 5) -> ``"0-2,5"``."""
    cpus = sorted(set(cpus))
    parts = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


_BUS = re.compile(r"^(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def normalize_bus_id(bus_id) -> str:
    """PCI address in ``DDDD:BB:DD.F`` lower case (NVML and nvidia-smi print an
    8-digit domain: ``00000000:07:00.0``). Returns ``""`` when not an address."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    m = _BUS.match(str(bus_id).strip())
    if not m:
        return ""
    domain = (m.group(1) or "0000")[-4:]
    return f"{domain}:{m.group(2)}:{m.group(3)}.{m.group(4)}".lower()


def natural_key(name: str) -> list:
    """Sort key that orders ``mlx5_10`` after ``mlx5_9``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
