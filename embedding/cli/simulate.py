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
import sys

from topology.sizes import size_arg

from embedding.cli import positive_int
from embedding.cli.simulate_job import Job, dump_json, positive_counts

__all__ = ["HELP", "add_arguments", "run"]

HELP = "predict collectives on a cluster described by a fabric spec"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from embedding.cli.simulate_zionex import add_parser

    sub = parser.add_subparsers(dest="what",
                                metavar="{collective,step,scale,zionex,calibrate,validate}")
    add_parser(sub)
    for name, text in (("step", "one training step of a config, part by part, and samples/s"),
                       ("scale", "the step from 8 to 128 ranks (re-planned at each size): "
                                 "strong and weak scaling")):
        q = sub.add_parser(name, help=text)
        q.add_argument("--config", metavar="TRAIN.toml", default=None,
                       help="the training config (tables, batch, dense model, optimizers); "
                       "default: neocomm train's built-in defaults")
        q.add_argument("--fabric", metavar="NAME|FILE", default=None,
                       help="the cluster (a fabric spec preset, a captured host or a file, as "
                       "neocomm plan --fabric); default: the config's [plan] fabric")
        if name == "step":
            q.add_argument("-n", "--ranks", type=positive_int, required=True,
                           help="ranks of the job")
            q.add_argument("--plan", metavar="PLAN.json", default=None,
                           help="price this sharding plan (neocomm plan --json) instead of "
                           "the planner's")
        else:
            q.add_argument("--ranks", default="8,16,32,64,128",
                           help="rank counts, comma-separated (default 8,16,32,64,128)")
        q.add_argument("--ranks-per-node", type=positive_int, default=None,
                       help="default: the fabric's GPUs per node (at most the ranks)")
        q.add_argument("--batch-size", type=positive_int, default=None,
                       help="global batch (default: the config's train.batch_size)")
        q.add_argument("--memory", type=size_arg, default=None,
                       help="device memory per rank (default: the fabric's)")
        q.add_argument("--flops", type=float, default=None,
                       help="dense FLOP/s per rank (default: the GPU's peak FP32; on hosts "
                       "without GPUs, a matrix product measured here)")
        q.add_argument("--no-overlap", action="store_true",
                       help="price the step without the trainer's overlap")
        q.add_argument("--json", metavar="FILE", default=None, help="write the result as JSON")
        if name == "scale":
            q.add_argument("--plot", metavar="FILE", default=None,
                           help="samples/s against ranks, strong and weak (PNG; matplotlib)")
    for name, text in (("calibrate", "fit the model's link and host terms to neocomm bench "
                                     "runs on this machine; write a fabric file"),
                       ("validate", "the model's prediction beside neocomm bench's measurement "
                                    "of every collective")):
        q = sub.add_parser(name, help=text)
        q.add_argument("--fabric", metavar="NAME|FILE", default=None if name == "validate"
                       else "cpu-host", required=name == "validate",
                       help="the fabric spec (a preset or file)" + (
                           "; its [model] table (neocomm simulate calibrate) is what is "
                           "checked" if name == "validate" else
                           " the calibration starts from, default cpu-host"))
        q.add_argument("--bench", metavar="FILE.json", action="append", default=[],
                       help="use these measurements (neocomm bench --json results, or a "
                       "file written by --record) instead of running the benches; repeatable")
        q.add_argument("--ranks", default="2" if name == "calibrate" else "2,4",
                       help="rank counts to bench, comma-separated (default %(default)s)")
        q.add_argument("--nodes", default="1,2",
                       help="node counts to bench at each rank count, comma-separated; nodes "
                       "are emulated on this host unless --hostfile (default %(default)s)")
        q.add_argument("--hostfile", default=None, help="MPI hostfile for runs across nodes")
        q.add_argument("-b", "--minbytes", type=size_arg, default=4 << 10,
                       help="smallest size, default 4K")
        q.add_argument("-e", "--maxbytes", type=size_arg, default=64 << 20,
                       help="largest size, default 64M")
        q.add_argument("-f", "--stepfactor", type=float, default=4.0,
                       help="size factor, default 4")
        q.add_argument("--device", action="store_true",
                       help="bench and model device buffers (NCCL); needs GPUs")
        q.add_argument("--record", metavar="FILE.json", default=None,
                       help="save the measurements in one file (for --bench later)")
        q.add_argument("--launches", type=positive_int, default=3,
                       help="launch every bench this many times and take each call's median "
                       "time (launches place ranks anew; default %(default)s)")
        if name == "calibrate":
            q.add_argument("-o", "--output", metavar="FILE.toml", default=None,
                           help="the fabric file to write (default: <fabric>-calibrated.toml)")
        else:
            q.add_argument("--tolerance", type=float, default=0.25,
                           help="largest |predicted / measured - 1| that passes, default 0.25")
            q.add_argument("--repeat-tolerance", type=float, default=0.10,
                           help="a call whose every launch came within this fraction of "
                           "their median is one the host repeats: the model is held to "
                           "those (see --repeatable-only), default 0.10")
            q.add_argument("--repeatable-only", action="store_true",
                           help="pass when every call the host repeats is within "
                           "--tolerance (the others are printed, not held); default: every "
                           "call must be")
            q.add_argument("--baseline", metavar="FILE.json", action="append", default=[],
                           help="an earlier measurement of the same calls (the runs the "
                           "model was calibrated on): a call repeats only where that "
                           "measurement also came within --repeat-tolerance of this one's; "
                           "repeatable")
            q.add_argument("--step", action="store_true",
                           help="validate the training step instead: neocomm train's measured "
                           "step time beside simulate step's prediction, per layout")
            q.add_argument("--config", metavar="TRAIN.toml", default=None,
                           help="with --step: the training config (default: the built-in one)")
            q.add_argument("--steps", type=positive_int, default=300,
                           help="with --step: steps each training run makes (default 300)")
            q.add_argument("--json", metavar="FILE", default=None,
                           help="write every comparison as JSON")
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
    p.add_argument("-b", "--minbytes", type=size_arg, default=64 << 10,
                   help="smallest size, default 64K")
    p.add_argument("-e", "--maxbytes", type=size_arg, default=64 << 20,
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
    from embedding.cli import simulate_measured, simulate_zionex

    what = {"collective": _collective, "step": _step, "scale": _scale,
            "zionex": simulate_zionex.run, "calibrate": simulate_measured.calibrate,
            "validate": simulate_measured.validate}.get(args.what)
    if what is None:
        print("neocomm simulate: expected a subcommand: collective, step, scale, zionex, "
              "calibrate or validate", file=sys.stderr)
        return 2
    from embedding.planner import PlanDoesNotFitError

    try:
        return what(args)
    except PlanDoesNotFitError as exc:
        print(f"neocomm simulate: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"neocomm simulate: {exc}", file=sys.stderr)
        return 2


def _ms(x: float) -> str:
    return f"{x * 1e3:9.3f}"


def _step(args) -> int:
    job = Job(args)
    est, report, hw = job.step(args.ranks, job.batch)
    overlap = not args.no_overlap and job.cfg.train.overlap
    print(f"# neocomm simulate step: {args.config or 'the default config'}, {hw.world_size} "
          f"ranks ({hw.num_nodes} node(s) x {hw.ranks_per_node}) on {job.cfg.plan.fabric!r}, "
          f"global batch {est.global_batch}, {'overlap on' if overlap else 'no overlap'}")
    print(f"# model: {hw.fabric.source}; dense FLOP/s {job.flops:.3g} "
          f"({job.flops_source}); predictions, not measurements")
    print(f"# {'part':<14} {'ms':>9} {'hidden ms':>9} {'share':>6}")
    hidden = dict(est.hidden)
    for part, secs in est.parts:
        share = secs / est.step_seconds if est.step_seconds else 0.0
        print(f"  {part:<14} {_ms(secs)} {_ms(hidden[part])} {share:6.1%}")
    print(f"  {'step':<14} {_ms(est.step_seconds)}")
    print(f"# {est.samples_per_second:,.0f} samples/s; {est.bound}-bound (collectives "
          f"{est.communication_seconds / est.step_seconds:.0%} of the step); slowest rank "
          f"{est.slowest_rank}; plan imbalance {report.imbalance:.3f}")
    if args.json:
        dump_json(args.json, {"kind": "neocomm-simulate-step", "config": args.config,
                          "fabric": job.cfg.plan.fabric, "ranks": hw.world_size,
                          "ranks_per_node": hw.ranks_per_node, "flop_rate": job.flops,
                          "flop_rate_source": job.flops_source, **est.to_dict()})
    return 0


def _scale(args) -> int:
    counts = positive_counts(args.ranks, "--ranks", "rank counts like 8,16,32")
    job = Job(args)
    first = counts[0]
    rows = []
    for n in counts:
        strong, _, hw = job.step(n, job.batch)
        weak, _, _ = job.step(n, job.batch // first * n)
        rows.append((n, hw, strong, weak))
    print(f"# neocomm simulate scale: {args.config or 'the default config'} on "
          f"{job.cfg.plan.fabric!r}, re-planned at each size; strong: global batch {job.batch}; "
          f"weak: {job.batch // first} samples per rank (global batch {job.batch} at {first} "
          f"ranks)")
    print(f"# {'ranks':>6} {'nodes':>5} | {'strong ms':>9} {'samples/s':>12} {'speedup':>7} "
          f"{'comm':>5} | {'weak ms':>9} {'samples/s':>12} {'effic.':>6} {'comm':>5} | bound")
    base_s, base_w = rows[0][2], rows[0][3]
    for n, hw, s, w in rows:
        print(f"  {n:>6} {hw.num_nodes:>5} | {_ms(s.step_seconds)} {s.samples_per_second:>12,.0f} "
              f"{s.samples_per_second / base_s.samples_per_second:>7.2f} "
              f"{s.communication_seconds / s.step_seconds:>5.0%} | {_ms(w.step_seconds)} "
              f"{w.samples_per_second:>12,.0f} "
              f"{base_w.step_seconds / w.step_seconds:>6.0%} "
              f"{w.communication_seconds / w.step_seconds:>5.0%} | {s.bound}")
    turn = next((n for n, _, s, _ in rows if s.bound == "communication"), None)
    print(f"# strong scaling turns communication-bound at {turn} ranks" if turn else
          "# strong scaling stays compute-bound over these sizes")
    if args.json:
        dump_json(args.json, {"kind": "neocomm-simulate-scale", "config": args.config,
                          "fabric": job.cfg.plan.fabric,
                          "rows": [{"ranks": n, "nodes": hw.num_nodes, "strong": s.to_dict(),
                                    "weak": w.to_dict()} for n, hw, s, w in rows]})
    if args.plot:
        from embedding.train.plot import pyplot

        plt = pyplot("the numbers are in the table (and --json)")
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ranks = [n for n, *_ in rows]
        ax.plot(ranks, [s.samples_per_second for _, _, s, _ in rows], "o-",
                label=f"strong (batch {job.batch})")
        ax.plot(ranks, [w.samples_per_second for *_, w in rows], "s-", label="weak")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel("samples/s (predicted)")
        ax.set_title(f"{args.config or 'default config'} on {job.cfg.plan.fabric}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        plt.close(fig)
    return 0


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
        fabric = apply_calibration(fabric, load_calibration(args.calibration),
                                   f"--calibration {args.calibration}")
    device = not args.host and spec.gpus > 0
    table = predict(op, fabric, sizes, itemsize=itemsize, device=device)
    _print(op, fabric, spec.name, args.dtype, device, table)
    if args.json:
        data = {"kind": "neocomm-simulate-collective", "op": op.value, "fabric": spec.name,
                "fabric_source": fabric.source, "ranks": fabric.size, "nodes": fabric.nodes,
                "ranks_per_node": fabric.ranks_per_node, "dtype": args.dtype,
                "device": device, "rows": [r.to_dict() for rows in table for r in rows]}
        dump_json(args.json, data)
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
