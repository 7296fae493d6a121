"""The MPI stage's layouts: tests marked ``training`` are collected at the layouts of
``tests/conftest.py`` TRAINING_LAYOUTS and left out (deselected, and counted so) at the
others; every other MPI test is collected at every layout. Two ranks in one node (a
training layout) and in two nodes of one (not one) show both."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: a training file (every test marked) and a collectives file (none marked)
FILES = ["tests/mpi/test_train_reshard.py", "tests/mpi/test_world_groups.py"]


def _collected(nprocs: int, per_node: int | None) -> tuple[set[str], int]:
    """(files of the tests rank 0 collected, the number it deselected) on ``nprocs`` ranks
    in emulated nodes of ``per_node``."""
    from neocomm.launcher import build_command, find_launcher

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    env.pop("NEOCOMM_RANKS_PER_NODE", None)
    if per_node:
        env["NEOCOMM_RANKS_PER_NODE"] = str(per_node)
    argv = build_command(find_launcher(), nprocs,
                         [sys.executable, "-m", "pytest", "--with-mpi", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *FILES], ranks_per_node=per_node)
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    files = {m[1] for m in re.finditer(r"^(tests/mpi/\w+\.py)::", out, re.M)}
    deselected = re.search(r"(\d+) deselected", out)
    return files, int(deselected[1]) if deselected else 0


@pytest.mark.parametrize("nprocs, per_node, trained", [(2, None, True), (2, 1, False)],
                         ids=["1x2", "2x1"])
def test_training_tests_run_at_the_training_layouts_only(nprocs, per_node, trained):
    files, deselected = _collected(nprocs, per_node)
    assert "tests/mpi/test_world_groups.py" in files
    assert ("tests/mpi/test_train_reshard.py" in files) is trained, files
    assert (deselected > 0) is not trained, deselected
