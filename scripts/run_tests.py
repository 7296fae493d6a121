#!/usr/bin/env python3
"""Run neocomm's whole test suite: one-process tests, then MPI tests on several layouts.

    python scripts/run_tests.py            # everything (what CI runs)
    python scripts/run_tests.py --only mpi # just the MPI layouts
    python scripts/run_tests.py -k all_to_all

Layouts: 1, 2, 3 and 4 ranks on one node, and emulated multi-node layouts
(NEOCOMM_RANKS_PER_NODE): 2 nodes x 1 rank, 2 nodes x 2 ranks. Each file of
tests/mpi says at which of them it runs and why (a ``layouts`` marker, or
``training`` for the trainers: ``tests/conftest.py`` TRAINING_LAYOUTS); its tests
are counted as deselected at the others (``--suite-layouts``). The device
tests (``tests/gpu``) run in one process (two pytest-xdist workers, whole files
each, with ``tests/unit``) and, for the ones marked ``mpi``,
at 2 ranks and at 4 ranks over 2 emulated nodes, on a real GPU when CuPy
finds one and on the device stand-in (``tests/devsim``) otherwise. The fault
suite (``tests/faults``) starts real jobs with ``neocomm run`` and injects
faults (signals to the launcher, the timeout, ranks that ignore signals). The
cluster stage (``tests/cluster``, run as root on Linux) builds hosts of their own
(network, host-name, IPC, mount and PID namespaces joined by TCP over a bridge) and
runs jobs across them with ``neocomm run --hostfile``; under CI it fails where such
a cluster cannot be built, elsewhere it skips saying why. A run that
collects no test counts as a failure, and so does a run that hangs past its
timeout. The last line is the total: ``total: N passed, N failed, N skipped``.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: (ranks, emulated ranks per node or None, test directory)
LAYOUTS = [(1, None, "tests/mpi"), (2, None, "tests/mpi"), (3, None, "tests/mpi"),
           (4, None, "tests/mpi"), (2, 1, "tests/mpi"), (4, 2, "tests/mpi"),
           (2, None, "tests/gpu"), (4, 2, "tests/gpu")]
TIMEOUT = 1200  # seconds per pytest run; a hang fails the suite instead of blocking CI


def _counts(text: str) -> dict[str, int]:
    lines = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", l)]
    out = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    if lines:
        for num, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", lines[-1]):
            word = "error" if word.startswith("error") else word
            if word in out:
                out[word] += int(num)
    return out


def _run(label: str, argv: list[str], env: dict, outdir: str | None = None) -> tuple[int, dict]:
    print(f"\n=== {label}: {' '.join(argv)}", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
        rc, text = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        rc, text = 124, (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
        text += f"\n{label}: timed out after {TIMEOUT} s\n"
    print(text, end="" if text.endswith("\n") else "\n")
    if outdir:  # show the report of any other rank that failed
        for name in sorted(os.listdir(outdir)):
            if name.endswith(".rc") and name != "rank0.rc":
                with open(os.path.join(outdir, name)) as f:
                    if f.read().strip() not in ("0",):
                        with open(os.path.join(outdir, name[:-3] + ".log")) as log:
                            print(f"--- {name[:-3]} report ---\n{log.read()}")
    counts = _counts(text)
    if rc == 5:
        print(f"{label}: no tests were collected; that is a failure")
    print(f"--- {label}: exit {rc} in {time.monotonic() - start:.0f} s", flush=True)
    return rc, counts


#: pytest-xdist workers of the one-process stage (the CI machines have 2 cores)
UNIT_WORKERS = 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["unit", "faults", "cluster", "mpi"], help="run one part")
    p.add_argument("-k", default=None, help="pytest -k expression")
    args, extra = p.parse_known_args()
    if args.k:
        extra += ["-k", args.k]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("NEOCOMM_TIMEOUT", "120")
    # Every job here runs on this one host, where Open MPI's shared-memory and TCP
    # transports carry all traffic; its libfabric transport (ofi) would spend about a
    # second probing for network providers at each of the suite's hundreds of job starts.
    env.setdefault("OMPI_MCA_btl", "^ofi")
    results = []
    if args.only in (None, "unit"):
        # two workers, whole files each (pytest-xdist): the one-process tests share no state
        results.append(_run("unit", [sys.executable, "-m", "pytest", "-q", "--color=no",
                                     "-p", "no:cacheprovider", "-m", "not mpi",
                                     "-n", str(UNIT_WORKERS), "--dist", "loadfile",
                                     "tests/unit", "tests/gpu", *extra],
                            env))
    if args.only in (None, "faults"):
        results.append(_run("faults", [sys.executable, "-m", "pytest", "-q", "--color=no",
                                       "-p", "no:cacheprovider", "tests/faults", *extra], env))
    if args.only in (None, "cluster"):
        results.append(_run("cluster", [sys.executable, "-m", "pytest", "-q", "--color=no",
                                        "-p", "no:cacheprovider", "tests/cluster", *extra], env))
    if args.only in (None, "mpi"):
        from neocomm.launcher import build_command, find_launcher

        launcher = find_launcher()
        for nprocs, rpn, where in LAYOUTS:
            label = ("gpu " if where == "tests/gpu" else "") + f"mpi n={nprocs}" \
                + (f" nodes of {rpn}" if rpn else "")
            select = ["-m", "mpi"] if where == "tests/gpu" else []
            lenv = dict(env)
            if rpn:
                lenv["NEOCOMM_RANKS_PER_NODE"] = str(rpn)
            else:
                lenv.pop("NEOCOMM_RANKS_PER_NODE", None)
            with tempfile.TemporaryDirectory() as outdir:
                lenv["MPI_PYTEST_OUTDIR"] = outdir
                argv = build_command(launcher, nprocs, [sys.executable, "scripts/mpi_pytest.py",
                                                        "--suite-layouts", where, *select,
                                                        *extra], ranks_per_node=rpn)
                results.append(_run(label, argv, lenv, outdir))
    total = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for _, counts in results:
        for k in total:
            total[k] += counts[k]
    bad = [rc for rc, _ in results if rc != 0]
    failed = total["failed"] + total["error"] + (len(bad) if not total["failed"] + total["error"] else 0)
    print(f"\ntotal: {total['passed']} passed, {failed} failed, {total['skipped']} skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
