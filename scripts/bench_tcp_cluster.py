"""Measure collectives between hosts joined by TCP: the test cluster's hosts (network
namespaces on this machine, ``tests/cluster/testcluster.py``), their links shaped to a rate.

Builds the cluster (root, Linux), runs ``neocomm bench OP --json`` under ``neocomm run
--hostfile`` for each operation, ``--launches`` times over (every operation once, then
again), and writes the runs as one measurements file (each call's median over the
launches and every launch's time), the file ``neocomm simulate calibrate --bench`` and
``neocomm simulate validate --bench`` read::

    python scripts/bench_tcp_cluster.py --rate 1gbit --layout 2x1 -o cal.json
    neocomm simulate calibrate --fabric tcp.toml --bench cal.json -o fitted.toml
    python scripts/bench_tcp_cluster.py --rate 1gbit --layout 2x1 -o val.json   # later
    neocomm simulate validate --fabric fitted.toml --bench val.json

``tc`` shapes the links' rate (a token bucket at both ends of each host's link); it
cannot add delay here (the kernel has no netem), so the links' latency is the kernel's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))
sys.path.insert(0, ROOT)

from testcluster import TestCluster, why_unavailable  # noqa: E402

NAMES = ("node-a", "node-b", "node-c", "node-d")


def measure(rate: str, hosts: int, per_host: int, ops: list[str], *, minbytes: str,
            maxbytes: str, factor: str, launches: int, iters: int, rounds: int,
            echo=print) -> list[dict]:
    """The bench runs of ``ops`` on ``hosts`` hosts x ``per_host`` ranks over links of
    ``rate`` (``None``: unshaped), ``launches`` times, merged per measurement."""
    from collectives.calibrate import median_of_launches

    why = why_unavailable()
    if why:
        raise SystemExit(f"bench_tcp_cluster: cannot build the cluster: {why}")
    runs = []
    with TestCluster(list(NAMES[:hosts]), rate=rate) as cluster:
        hostfile = cluster.hostfile({n: per_host for n in NAMES[:hosts]})
        for launch in range(launches):
            for op in ops:
                path = os.path.join(cluster.workdir, f"{op}-{launch}.json")
                argv = ["neocomm", "run", "-n", str(hosts * per_host), "--hostfile", hostfile,
                        "--", "neocomm", "bench", op, "-b", minbytes, "-e", maxbytes, "-f",
                        factor, "-n", str(iters), "-w", "1", "-r", str(rounds), "--json",
                        path]
                echo("# " + " ".join(argv))
                began = time.monotonic()
                done = cluster.run(NAMES[0], argv, cwd=ROOT, timeout=600)
                if done.returncode != 0:
                    raise SystemExit(f"bench_tcp_cluster: {' '.join(argv)} exited "
                                     f"{done.returncode}\n{done.stdout[-3000:]}\n"
                                     f"{done.stderr[-3000:]}")
                echo(f"#   {time.monotonic() - began:.1f} s")
                with open(path) as fh:
                    runs.append(json.load(fh))
    return median_of_launches(runs)


def _gbps(rate: str) -> float:
    """Gb/s of a tc rate (``500mbit``, ``1gbit``, ``5gbit``)."""
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        if rate.lower().endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise SystemExit(f"bench_tcp_cluster: --rate {rate!r}: expected a tc rate like 1gbit")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit",
                   help="tc rate of every host's link (e.g. 500mbit, 1gbit, 5gbit), or "
                   "'none' for unshaped links; default 1gbit")
    p.add_argument("--layout", default="2x1", help="HOSTSxRANKS, default 2x1")
    p.add_argument("--ops", default="all_reduce,all_to_all", help="collectives, comma-separated")
    p.add_argument("-b", "--minbytes", default="1M")
    p.add_argument("-e", "--maxbytes", default="16M")
    p.add_argument("-f", "--stepfactor", default="4")
    p.add_argument("--launches", type=int, default=2)
    p.add_argument("--iters", type=int, default=1, help="timed iterations per round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (their median)")
    p.add_argument("-o", "--output", required=True, help="the measurements file to write")
    args = p.parse_args(argv)
    hosts, _, per_host = args.layout.partition("x")
    runs = measure(None if args.rate == "none" else args.rate, int(hosts), int(per_host),
                   [o for o in args.ops.split(",") if o], minbytes=args.minbytes,
                   maxbytes=args.maxbytes, factor=args.stepfactor, launches=args.launches,
                   iters=args.iters, rounds=args.rounds)
    if args.rate != "none":  # the rate each run was measured at, for calibrate and validate
        for run in runs:
            run["link_rate_gbps"] = _gbps(args.rate)
    with open(args.output, "w") as fh:
        json.dump({"kind": "neocomm-measurements", "runs": runs}, fh, indent=1)
        fh.write("\n")
    print(f"# wrote {args.output}: {len(runs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
