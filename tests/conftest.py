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
    if not _has_torch():
        terminalreporter.write_line(
            "not collected: the torch tests (" + ", ".join(_TORCH_TESTS) + "): torch is not "
            "installed (pip install -e '.[test]' brings it)" + ("; CI must run them" if _in_ci()
                                                               else ""))


def pytest_sessionfinish(session, exitstatus):
    if not _has_torch() and _in_ci() and exitstatus == 0:
        session.exitstatus = 1  # CI installs torch: its tests must have run
