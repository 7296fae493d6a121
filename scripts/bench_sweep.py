#!/usr/bin/env python3
"""Run ``neocomm bench`` sweeps over ops and rank counts; write JSON, plots and tables.

    python scripts/bench_sweep.py                      # AlltoAll(v), AllReduce, ReduceScatter
    python scripts/bench_sweep.py --ops all_reduce --ranks 2 4 -b 1M -e 64M \\
        --algo ring,rabenseifner,auto --out bench-out

For each op and rank count it runs ``neocomm run -n N -- neocomm bench OP ...
--json OUT/OP-nN.json`` (``--ranks-per-node`` emulates nodes), then plots
every JSON of an op into ``OUT/OP.png`` (matplotlib when installed) and
writes the markdown tables to ``OUT/tables.md``. ``--calibrate FILE``
also records a calibration file for ``NEOCOMM_CALIBRATION``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import plot_bench  # noqa: E402

DEFAULT_OPS = ["all_to_all", "all_to_all_v", "all_reduce", "reduce_scatter"]
DEFAULT_ALGOS = {"all_to_all": "native,pairwise,auto", "all_to_all_v": "native,pairwise,auto",
                 "all_reduce": "native,ring,rabenseifner,auto",
                 "reduce_scatter": "native,ring,rabenseifner,auto"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", default=DEFAULT_OPS)
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("-b", default="64K")
    p.add_argument("-e", default="64M")
    p.add_argument("-f", default="2")
    p.add_argument("-n", default="10")
    p.add_argument("-w", default="3")
    p.add_argument("-r", default="5", help="timed rounds (median)")
    p.add_argument("--algo", default=None, help="algorithms (default: per op)")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--hostfile", default=None)
    p.add_argument("--calibrate", default=None, metavar="FILE")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    failed = 0
    tables = []
    for op in args.ops:
        files = []
        for n in args.ranks:
            path = os.path.join(args.out, f"{op}-n{n}.json")
            cmd = ["neocomm", "run", "-n", str(n), "--timeout", str(args.timeout)]
            if args.ranks_per_node:
                cmd += ["--ranks-per-node", str(args.ranks_per_node)]
            if args.hostfile:
                cmd += ["--hostfile", args.hostfile]
            cmd += ["--", "neocomm", "bench", op, "-b", args.b, "-e", args.e, "-f", args.f,
                    "-n", args.n, "-w", args.w, "-r", args.r,
                    "--algo", args.algo or DEFAULT_ALGOS.get(op, "auto"), "--json", path]
            if args.calibrate:
                cmd += ["--calibrate", args.calibrate]
            print("$ " + " ".join(cmd), flush=True)
            rc = subprocess.call(cmd)
            if rc != 0:
                print(f"bench_sweep: {op} on {n} ranks exited with {rc}", file=sys.stderr)
                failed += 1
            if os.path.exists(path):
                files.append(path)
        if files:
            runs = [plot_bench.load(f) for f in files]
            plot_bench.plot(runs, os.path.join(args.out, f"{op}.png"))
            for run in runs:
                tables.append(f"### {op}, {run['ranks']} ranks\n\n{plot_bench.markdown(run)}\n")
    with open(os.path.join(args.out, "tables.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(tables))
    print(f"bench_sweep: results in {args.out}/ ({failed} failed runs)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
