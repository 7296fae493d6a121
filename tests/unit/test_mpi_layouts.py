"""The MPI stage's layouts: every file of tests/mpi says where it runs (a ``layouts``
marker with its why, or ``training``: ``tests/conftest.py`` TRAINING_LAYOUTS) and is left
out (deselected, and counted so) at the stage's other layouts (``--suite-layouts``; a job
run otherwise runs every file it is given); a file that says nothing, or a marker without
a why or with an unknown layout, fails the collection naming the file. Two ranks in one
node (a training layout) and in two nodes of one (not one) show both."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: a training file, a collectives file of every layout and one of one node of two ranks
FILES = ["tests/mpi/test_train_reshard.py", "tests/mpi/test_world_groups.py",
         "tests/mpi/test_large_counts.py"]


def _collected(nprocs: int, per_node: int | None, files=FILES, cwd: str = ROOT,
               suite: bool = True) -> tuple[set[str], int]:
    """(files of the tests rank 0 collected, the number it deselected) on ``nprocs`` ranks
    in emulated nodes of ``per_node``."""
    from neocomm.launcher import build_command, find_launcher

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
    env.pop("NEOCOMM_RANKS_PER_NODE", None)
    if per_node:
        env["NEOCOMM_RANKS_PER_NODE"] = str(per_node)
    argv = build_command(find_launcher(), nprocs,
                         [sys.executable, "-m", "pytest", "--with-mpi",
                          *(["--suite-layouts"] if suite else []), "--collect-only", "-q",
                          "-p", "no:cacheprovider", *files], ranks_per_node=per_node)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
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
    assert ("tests/mpi/test_large_counts.py" in files) is trained, files  # 1x2 only
    assert (deselected > 0) is not trained, deselected


def test_without_the_suites_option_every_file_runs_at_the_jobs_layout():
    """A job run by hand, or across the test cluster's hosts (2+1), runs what it is given."""
    files, deselected = _collected(2, 1, suite=False)
    assert files == set(FILES) and deselected == 0, (files, deselected)


def test_files_that_do_not_say_their_layouts_are_refused_all_at_once(tmp_path):
    """A tree of its own: the suite's conftest and four files of tests/mpi, three of which
    say their layouts wrongly; one collection names those three, each with its fault."""
    (tmp_path / "tests" / "mpi").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "tests")
    markers = {"unsaid": "",
               "nowhy": "pytestmark = pytest.mark.layouts('1x2')",
               "unknown": "pytestmark = pytest.mark.layouts('1x2', '3x3', why='a reason')",
               "said": "pytestmark = pytest.mark.layouts('1x2', why='a reason')"}
    for name, marker in markers.items():
        (tmp_path / "tests" / "mpi" / f"test_{name}.py").write_text(
            f"import pytest\n{marker}\n\ndef test_one():\n    pass\n")
    files = [f"tests/mpi/test_{name}.py" for name in markers]
    with pytest.raises(AssertionError) as failed:
        _collected(1, None, files, str(tmp_path))
    said = str(failed.value).split("ERROR: ", 1)[-1]  # the collection's error, as shown
    assert "test_unsaid.py: a file of tests/mpi says at which layouts it runs and why" in said
    assert "test_nowhy.py: pytest.mark.layouts('1x2',) says no why=" in said
    assert "test_unknown.py: pytest.mark.layouts('1x2', '3x3'): ['3x3']; the layouts are" \
        in said
    assert "test_said.py" not in said
    files, _ = _collected(2, None, ["tests/mpi/test_said.py"], str(tmp_path))  # at 1x2
    assert files == {"tests/mpi/test_said.py"}
