"""The fused kernels' CUDA sources compile with nvcc for sm_80 and sm_90 without register spills.

ptxas (``-Xptxas -v``) prints, per function, ``N bytes stack frame, S bytes
spill stores, L bytes spill loads``; any S or L above zero fails and names the
function, the architecture and the numbers. Without nvcc the tests fail when
``CI`` is set and skip with the reason elsewhere (``NVCC`` may name the
compiler).
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from embedding.kernels.cuda_src import KERNEL_NAMES, source_for

ARCHS = ("sm_80", "sm_90")
#: ``(weight dtype, optimizer-state dtype or None)`` of every source the device path builds:
#: each weight dtype with its compute-dtype state, and half or wider state apart from it.
DTYPES = (("float32", None), ("float64", None), ("float16", None), ("bfloat16", None),
          ("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"),
          ("float16", "float64"))
_PROPERTIES = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, "
                         r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _nvcc() -> str:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    reason = "nvcc is not on PATH, not at /usr/local/cuda/bin/nvcc and NVCC is not set"
    if _in_ci():
        pytest.fail(f"nvcc must run in CI: {reason}")
    pytest.skip(reason)


def _compile(tmp_path: Path, dtype: str, arch: str, *extra: str, state_dtype=None,
             wire=None) -> str:
    """ptxas's report of compiling ``source_for(dtype, state_dtype, wire)`` for ``arch``
    (one nvcc run serves every architecture of :data:`ARCHS`: see :func:`_reports`)."""
    return _reports(dtype, state_dtype, wire, tuple(extra))[arch]


@functools.lru_cache(maxsize=None)
def _reports(dtype: str, state_dtype, wire, extra: tuple) -> dict[str, str]:
    """``{arch: ptxas report}`` of one nvcc run building a fat binary of
    ``source_for(dtype, state_dtype, wire)`` for every architecture of :data:`ARCHS`;
    each arch's part is the report from its first ``Compiling entry function ... for
    'arch'`` line up to the next architecture's."""
    where = Path(tempfile.mkdtemp(prefix="neocomm-nvcc-"))
    try:
        src = where / "kernels.cu"
        src.write_text(source_for(dtype, state_dtype, wire))
        gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHS]
        cmd = [_nvcc(), "-fatbin", *gencode, "-Xptxas", "-v", *extra,
               "-o", str(where / "kernels.fatbin"), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{report}"
    parts: dict[str, list[str]] = {a: [] for a in ARCHS}
    current = None
    for line in report.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = m.group(2)
        if current in parts:
            parts[current].append(line)
    return {a: "\n".join(lines) + "\n" for a, lines in parts.items()}


def _spill_table(report: str) -> dict[str, tuple[int, int, int]]:
    """``{function: (stack frame, spill stores, spill loads)}`` (bytes) from ptxas -v output."""
    return {m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(4)))
            for m in _PROPERTIES.finditer(report)}


def _spills(report: str, arch: str) -> list[str]:
    """One line per function that spills registers, naming it, ``arch`` and the bytes."""
    return [f"{name} on {arch}: {stores} bytes spill stores, {loads} bytes spill loads"
            for name, (_, stores, loads) in sorted(_spill_table(report).items())
            if stores or loads]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype, state_dtype", DTYPES, ids=lambda x: str(x))
def test_kernels_compile_without_register_spills(tmp_path, dtype, state_dtype, arch):
    report = _compile(tmp_path, dtype, arch, state_dtype=state_dtype)
    entries = {name for name, target in _ENTRY.findall(report) if target == arch}
    assert entries == set(KERNEL_NAMES), report
    table = _spill_table(report)
    missing = [name for name in KERNEL_NAMES if name not in table]
    assert not missing, f"ptxas reported no properties for {missing}:\n{report}"
    spills = _spills(report, arch)
    assert not spills, (f"register spills in the {dtype} kernels (state {state_dtype}):\n"
                        + "\n".join(spills))


#: ``(weight dtype, wire format)`` of the modules that write pooled rows in a communication
#: format and read gradients in it (embedding.sharding.qcomm)
WIRES = (("float32", "float16"), ("float32", "bfloat16"), ("float32", "int8"),
         ("float64", "float16"), ("float64", "int8"), ("bfloat16", "int8"),
         ("float16", "bfloat16"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype, wire", WIRES, ids=lambda x: str(x))
def test_wire_kernels_compile_without_register_spills(tmp_path, dtype, wire, arch):
    report = _compile(tmp_path, dtype, arch, wire=wire)
    table = _spill_table(report)
    assert set(KERNEL_NAMES) <= set(table), report
    spills = _spills(report, arch)
    assert not spills, (f"register spills in the {dtype} kernels (wire {wire}):\n"
                        + "\n".join(spills))


def test_spill_check_sees_forced_spills(tmp_path):
    """Capping registers at 16 makes ptxas spill: the parser must report it."""
    report = _compile(tmp_path, "float64", "sm_80", "-maxrregcount=16")
    spills = _spills(report, "sm_80")
    assert any(line.startswith("segment_update on sm_80: ") for line in spills), report
    assert all(re.search(r": \d+ bytes spill stores, \d+ bytes spill loads$", s) for s in spills)


def test_spill_table_parses_ptxas_lines():
    report = ("ptxas info    : Function properties for segment_update\n"
              "    128 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
              "ptxas info    : Function properties for pooled_lookup\n"
              "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    assert _spill_table(report) == {"segment_update": (128, 8, 12), "pooled_lookup": (0, 0, 0)}
    assert _spills(report, "sm_90") == [
        "segment_update on sm_90: 8 bytes spill stores, 12 bytes spill loads"]
