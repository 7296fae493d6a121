"""The multi-host stage: real hosts (network namespaces) built and torn down by the suite.

Each module's cluster is built once for the module and torn down after it, also when a
test fails. Where a cluster cannot be built (not Linux, not root, no util-linux) the tests
skip saying why, except under CI, where they fail: CI must run them.
"""
from __future__ import annotations

import os
import sys

import pytest

from testcluster import ROOT, TestCluster, why_unavailable


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def need_cluster() -> None:
    why = why_unavailable()
    if why is None:
        return
    if _in_ci():
        pytest.fail(f"the multi-host test cluster cannot be built here: {why}", pytrace=False)
    pytest.skip(f"the multi-host test cluster cannot be built here: {why}")


def build(names, **kw) -> TestCluster:
    need_cluster()
    return TestCluster(names, **kw).__enter__()


@pytest.fixture(scope="module")
def two_hosts():
    """node-a and node-b, two slots each."""
    cluster = build(["node-a", "node-b"])
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def three_hosts():
    """node-a, node-b and node-c."""
    cluster = build(["node-a", "node-b", "node-c"])
    yield cluster
    cluster.close()


def neocomm_run(cluster: TestCluster, nprocs: int, command: list[str], *, hostfile: str,
                extra: list[str] = (), timeout: float = 300, env: dict | None = None):
    """``neocomm run -n N --hostfile F [extra] -- command`` typed on the first host, from
    the checkout; the finished process."""
    argv = ["neocomm", "run", "-n", str(nprocs), "--hostfile", hostfile, *extra, "--", *command]
    return cluster.run(cluster.hosts[0].name, argv, cwd=ROOT, timeout=timeout, env=env)


def explain(done, kept: str | None = None) -> str:
    """The finished process's exit status and output; with ``kept``, also the end of every
    job log that ``neocomm simulate`` kept under it for a failed job (the cluster's folder
    goes with the cluster, so what the failed job printed is shown here)."""
    from pathlib import Path

    logs = sorted(Path(kept).glob("neocomm-*/*.log")) if kept else []
    text = "".join(f"\n--- {path}\n{path.read_text(errors='replace')[-6000:]}"
                   for path in logs)
    return f"exit {done.returncode}\n--- stdout\n{done.stdout[-6000:]}\n--- stderr\n" \
           f"{done.stderr[-6000:]}{text}"


__all__ = ["build", "neocomm_run", "explain", "need_cluster", "sys"]
