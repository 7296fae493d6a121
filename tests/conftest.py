"""Test-wide settings: a stall must fail a test run fast instead of hanging CI."""
import os

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


# -- MPI layouts: where the tests marked ``training`` run -----------------------------------
#: Layouts, as ``NODESxRANKS_PER_NODE``, at which the tests marked ``training`` run under
#: MPI. The collectives, their backends and the sharded data path run at every layout of
#: scripts/run_tests.py; the trainers built on them (training loops, memory tiers,
#: checkpoints, the PyTorch module) at one, two and three ranks and at two nodes of two,
#: which hold every case their code tells apart: one rank, a power of two, uneven shards
#: and the hierarchical paths between nodes.
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


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--with-mpi", default=False):
        return
    layout = mpi_layout()
    if layout in TRAINING_LAYOUTS:
        return
    away = [item for item in items if item.get_closest_marker("training") is not None]
    if away:
        config.hook.pytest_deselected(items=away)
        items[:] = [item for item in items if item.get_closest_marker("training") is None]
