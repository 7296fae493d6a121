"""Test-wide settings: a stall must fail a test run fast instead of hanging CI."""
import os

import pytest

os.environ.setdefault("NEOCOMM_TIMEOUT", "120")


# -- torch: its tests are collected where torch is installed, and say so where it is not ------
def _has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


_TORCH_TESTS = ["unit/test_torch_module.py", "mpi/test_torch_module.py",
                "mpi/test_torch_collectives.py", "faults/test_torch_jobs.py"]
collect_ignore = [] if _has_torch() else _TORCH_TESTS


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_terminal_summary(terminalreporter):
    # what tests/unit/test_cupy_conformance.py compared with the real CuPy (record_property)
    for status in ("passed", "failed"):
        for report in terminalreporter.stats.get(status, []):
            for key, value in getattr(report, "user_properties", ()):
                if key == "conformance" and getattr(report, "when", "") == "call":
                    name = report.nodeid.rsplit("::", 1)[-1]
                    terminalreporter.write_line(f"CuPy conformance, {name} ({status}): {value}")
    if not _has_torch():
        terminalreporter.write_line(
            "not collected: the torch tests (" + ", ".join(_TORCH_TESTS) + "): torch is not "
            "installed (pip install -e '.[test]' brings it)" + ("; CI must run them" if _in_ci()
                                                               else ""))


# -- nothing left in /dev/shm: a run that leaves a file there fails, naming it ---------------
_SHM_BEFORE: set = set()


def _watches_shm(config) -> bool:
    """The run as a whole (not an xdist worker, not a rank of an MPI job) on Linux."""
    return (os.path.isdir("/dev/shm") and not hasattr(config, "workerinput")
            and not config.getoption("--with-mpi", default=False))


def pytest_sessionstart(session):
    if _watches_shm(session.config):
        _SHM_BEFORE.update(os.listdir("/dev/shm"))


def _shm_left() -> list[str]:
    """Files this run (its tests and every process they started) left in /dev/shm: new since
    the start, held by no live process, and still there a moment later (a job's launcher
    removes its files just after its ranks exit)."""
    import time

    from _shm import left_since

    left = left_since(_SHM_BEFORE)
    if left:
        time.sleep(2)
        left = sorted(set(left) & set(left_since(_SHM_BEFORE)))
    return left


def pytest_sessionfinish(session, exitstatus):
    if not _has_torch() and _in_ci() and exitstatus == 0:
        session.exitstatus = 1  # CI installs torch: its tests must have run
    if _watches_shm(session.config) and exitstatus == 0:
        left = _shm_left()
        if left:
            print(f"\nthe tests left {len(left)} file(s) in /dev/shm: {', '.join(left)} "
                  f"(a process that started MPI without neocomm.mpistart?)")
            session.exitstatus = 1


# -- MPI layouts: where each file of tests/mpi runs ----------------------------------------
#: The layouts of scripts/run_tests.py's MPI stage, as ``NODESxRANKS_PER_NODE``.
LAYOUTS = ("1x1", "1x2", "1x3", "1x4", "2x1", "2x2")

#: Layouts at which the tests marked ``training`` run under MPI: the trainers built on the
#: collectives (training loops, memory tiers, checkpoints, the PyTorch module) at one, two
#: and three ranks and at two nodes of two, which hold every case their code tells apart:
#: one rank, a power of two, uneven shards and the hierarchical paths between nodes.
TRAINING_LAYOUTS = ("1x1", "1x2", "1x3", "2x2")


def mpi_layout() -> str:
    """This job's layout, ``NODESxRANKS_PER_NODE`` (emulated nodes when
    ``NEOCOMM_RANKS_PER_NODE`` is set, else the hosts MPI's shared-memory split finds);
    nodes of different sizes are named by their sizes (``2+1``)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    per_node = int(os.environ.get("NEOCOMM_RANKS_PER_NODE") or 0)
    if not per_node:
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        per_node = world.allreduce(local.Get_size(), op=MPI.MAX)
        local.Free()
    size = world.Get_size()
    if size % per_node:
        return "+".join([str(per_node)] * (size // per_node) + [str(size % per_node)])
    return f"{size // per_node}x{per_node}"


class LayoutsUnsaid(ValueError):
    """A file of tests/mpi that does not say rightly at which layouts it runs."""


def layouts_of(item) -> tuple[str, ...] | None:
    """The layouts ``item`` runs at: those of its ``layouts`` marker (``"all"``: every one),
    else TRAINING_LAYOUTS where it is marked ``training``; None where it says neither (a
    test outside tests/mpi). A file of tests/mpi that says neither, or a ``layouts`` marker
    that names no known layout or says no why (``why=``), raises :class:`LayoutsUnsaid`."""
    mark = item.get_closest_marker("layouts")
    if mark is None:
        if item.get_closest_marker("training") is not None:
            return TRAINING_LAYOUTS
        if item.path.parent.name == "mpi":
            raise LayoutsUnsaid(f"{item.path.name}: a file of tests/mpi says at which layouts "
                                f"it runs and why: pytestmark = pytest.mark.layouts(..., "
                                f"why=...) (one of {', '.join(LAYOUTS)}, or 'all'), or "
                                f"pytest.mark.training")
        return None
    where = f"{item.path.name}: pytest.mark.layouts{mark.args}"
    if not str(mark.kwargs.get("why", "")).strip():
        raise LayoutsUnsaid(f"{where} says no why= (what these layouts show that the "
                            f"others do not)")
    if mark.args == ("all",):
        return LAYOUTS
    unknown = [a for a in mark.args if a not in LAYOUTS]
    if unknown or not mark.args:
        raise LayoutsUnsaid(f"{where}: {unknown or 'no layout'}; the layouts are "
                            f"{', '.join(LAYOUTS)} or 'all'")
    return tuple(mark.args)


def pytest_addoption(parser):
    parser.addoption("--suite-layouts", action="store_true",
                     help="under MPI, run a file of tests/mpi only at the layouts it names "
                          "(what scripts/run_tests.py's MPI stage does); without it, every "
                          "file runs at whatever layout the job has")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--with-mpi", default=False):
        return
    layout = mpi_layout() if config.getoption("--suite-layouts") else None
    keep, away, wrong = [], [], {}
    for item in items:
        try:
            where = layouts_of(item)
        except LayoutsUnsaid as exc:
            wrong.setdefault(item.path.name, str(exc))
            continue
        (keep if where is None or layout is None or layout in where else away).append(item)
    if wrong:  # every file at once, so that one run shows them all
        raise pytest.UsageError("\n".join(wrong[name] for name in sorted(wrong)))
    if away:
        config.hook.pytest_deselected(items=away)
        items[:] = keep
