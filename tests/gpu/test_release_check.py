"""The GPU release check (scripts/gpu_release_check.sh) end to end, tiny.

One process (not under mpirun): the script starts its own 2-rank runs. On
the device stand-in its numbers mean nothing; the test checks that every
step runs, that every collective with a native peer gives one row with a
positive busbw and no wrong element, and that the kernel rows have a
positive throughput.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import cupy
import pytest

STANDIN = getattr(cupy, "STANDIN", False)  # tests/gpu/conftest.py put the stand-in in place

# one process: the script launches its own ranks (never run it under mpirun)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))) > 1,
    reason="starts its own 2-rank runs; run it in one process, not under mpirun")]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEVSIM = os.path.join(ROOT, "tests", "devsim")


def _native_ops() -> set[str]:
    from collectives.algorithms import names
    from collectives.types import CollectiveOp

    return {op.value for op in CollectiveOp if "native" in names(op)}


def test_release_check_quick(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    if STANDIN:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (DEVSIM, env.get("PYTHONPATH", "")) if p)
    out = tmp_path / "rc"
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_release_check.sh"), "--quick",
         "--skip-tests", "--out", str(out), "--ranks", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((out / "release_check.json").read_text())
    assert data["failed"] == []
    rows = {c["op"]: c for c in data["collectives"]}
    assert len(rows) == len(data["collectives"])  # one row per collective
    assert set(rows) == _native_ops()
    for op, row in rows.items():
        assert row["busbw"] > 0, op
        assert row["peer_busbw"] > 0, op
        assert row["wrong"] == 0, op
    kernels = {k["name"]: k for k in data["kernels"]}
    assert set(kernels) == {"pooled_lookup", "backward_update"}
    for name, k in kernels.items():
        assert k["gbps"] > 0 and k["memcpy_gbps"] > 0, name


def test_first_checks_name_existing_device_tests():
    """Step 2's selection (``--list-first``) names device tests that exist: pytest collects
    at least one test for every node id, and nothing else, so a renamed or removed test
    fails here instead of passing the release check unseen."""
    script = os.path.join(ROOT, "scripts", "gpu_release_check.sh")
    listed = subprocess.run(["bash", script, "--list-first"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    ids = listed.stdout.split()
    assert len(ids) >= 3 and all(i.startswith("tests/gpu/") and "::" in i for i in ids), ids
    env = dict(os.environ)
    if STANDIN:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (DEVSIM, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *ids],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    for node in ids:
        assert any(line == node or line.startswith(node + "[") for line in collected), \
            (node, collected)
    assert all(any(line == n or line.startswith(n + "[") for n in ids) for line in collected)
