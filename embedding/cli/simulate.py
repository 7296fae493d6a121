"""``neocomm simulate``: what a job would do on a cluster you do not have.

``neocomm simulate collective OP --fabric zionex -n 128 -b 1K -e 64M`` prices
every algorithm of a collective at every size of a sweep on the fabric a
spec declares (a preset such as ``zionex`` or ``dgx-h100``, or a spec TOML;
see ``neocomm fabric --help``), with the cost model the runtime's algorithm
selection uses, and prints the table ``neocomm bench`` prints (time, algbw
and busbw per algorithm, in nccl-tests' terms) plus the algorithm the
selection would pick, so that a prediction and a measurement read side by
side. Runs in one process: no ``neocomm run`` needed. ``--json FILE``
writes every row, ``--plot FILE.png`` draws busbw against size.
Exit status: 0 done, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import sys

from embedding.cli import positive_int

__all__ = ["HELP", "add_arguments", "run"]

HELP = "predict collectives on a cluster described by a fabric spec"


def _size(text: str) -> int:
    from neocomm.config import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", metavar="{collective}")
    p = sub.add_parser("collective", help="predicted time, algbw and busbw of every algorithm "
                       "of one collective, per size")
    p.add_argument("op", help="the collective: all_reduce, all_to_all, all_to_all_v, "
                   "reduce_scatter, all_gather, broadcast, one_to_many, many_to_many")
    p.add_argument("--fabric", required=True, metavar="NAME|FILE",
                   help="a fabric spec preset (zionex, dgx-a100, dgx-h100, dgx1-v100, "
                   "cpu-host) or a spec TOML file")
    p.add_argument("-n", "--ranks", type=positive_int, required=True, help="ranks of the job")
    p.add_argument("--ranks-per-node", type=positive_int, default=None,
                   help="default: one rank per GPU of a node")
    p.add_argument("-b", "--minbytes", type=_size, default=_size("64K"),
                   help="smallest size, default 64K")
    p.add_argument("-e", "--maxbytes", type=_size, default=_size("64M"),
                   help="largest size, default 64M")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size factor, default 2")
    p.add_argument("--dtype", default="float32", help="element type, default float32")
    p.add_argument("--host", action="store_true",
                   help="host buffers (MPI within and between nodes); default: device buffers "
                   "when the fabric has GPUs")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="a calibration file (neocomm bench --calibrate) applied on top")
    p.add_argument("--json", metavar="FILE", default=None, help="write every row as JSON")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="draw busbw against size, one line per algorithm (PNG; matplotlib)")


def run(args) -> int:
    if args.what != "collective":
        print("neocomm simulate: expected a subcommand: collective", file=sys.stderr)
        return 2
    try:
        return _collective(args)
    except ValueError as exc:
        print(f"neocomm simulate: {exc}", file=sys.stderr)
        return 2


def _collective(args) -> int:
    import numpy as np

    from collectives.fabric import apply_calibration, load_calibration
    from collectives.simulate import predict, sweep
    from collectives.topofabric import fabric_from_spec
    from collectives.types import CollectiveOp
    from topology.spec import load_spec

    op = CollectiveOp.parse(args.op)
    try:
        itemsize = np.dtype(args.dtype).itemsize
    except TypeError:
        raise ValueError(f"--dtype: unknown element type {args.dtype!r}") from None
    sizes = sweep(args.minbytes, args.maxbytes, args.stepfactor)
    spec = load_spec(args.fabric)
    fabric = fabric_from_spec(spec, args.ranks, args.ranks_per_node,
                              device=False if args.host else None)
    if args.calibration:
        fabric = apply_calibration(fabric, load_calibration(args.calibration))
    device = not args.host and spec.gpus > 0
    table = predict(op, fabric, sizes, itemsize=itemsize, device=device)
    _print(op, fabric, spec.name, args.dtype, device, table)
    if args.json:
        data = {"kind": "neocomm-simulate-collective", "op": op.value, "fabric": spec.name,
                "fabric_source": fabric.source, "ranks": fabric.size, "nodes": fabric.nodes,
                "ranks_per_node": fabric.ranks_per_node, "dtype": args.dtype,
                "device": device, "rows": [r.to_dict() for rows in table for r in rows]}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)
            fh.write("\n")
    if args.plot:
        _plot(args.plot, op, fabric, spec.name, table)
    return 0


def _print(op, fabric, name: str, dtype: str, device: bool, table) -> None:
    print(f"# neocomm simulate {op.value}: {fabric.size} ranks ({fabric.nodes} node(s) x "
          f"{fabric.ranks_per_node}) on fabric {name!r}, {dtype}, "
          f"{'device' if device else 'host'} buffers")
    print(f"# model: {fabric.source}; times are predictions, not measurements")
    algos = [r.algo for r in table[0]]
    print(f"# {'':>11} {'':>11} " + " ".join(f"{a:^32}" for a in algos))
    print(f"# {'size':>11} {'count':>11} " + " ".join(
        f"{'time(us)':>10} {'algbw':>10} {'busbw':>10}" for _ in algos) + "  selected")
    for rows in table:
        cells = [f"{r.time * 1e6:10.1f} {r.algbw:10.3f} {r.busbw:10.3f}" if r.time is not None
                 else f"{'n/a':>10} {'':>10} {'':>10}" for r in rows]
        chosen = next((r.algo for r in rows if r.selected), "none")
        print(f"  {rows[0].size:>11d} {rows[0].count:>11d} " + " ".join(cells) + f"  {chosen}")
    for algo in algos:
        why = next((r.reason for rows in table for r in rows if r.algo == algo and r.reason),
                   None)
        if why:
            print(f"# {algo}: n/a: {why}")
    picked = [r for rows in table for r in rows if r.selected]
    if picked:
        print(f"# selection: avg busbw {sum(r.busbw for r in picked) / len(picked):.3f} GB/s")


def _plot(path: str, op, fabric, name: str, table) -> None:
    from embedding.train.plot import pyplot

    plt = pyplot("the numbers are in the table (and --json)")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algo in [r.algo for r in table[0]]:
        pts = [(r.size, r.busbw) for rows in table for r in rows
               if r.algo == algo and r.time is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=algo)
    chosen = [(r.size, r.busbw) for rows in table for r in rows if r.selected]
    if chosen:
        ax.plot(*zip(*chosen), color="black", linewidth=2.5, alpha=0.35, label="selection")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s, predicted)")
    ax.set_title(f"{op.value}, {fabric.size} ranks on {name} ({fabric.nodes} x "
                 f"{fabric.ranks_per_node})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
