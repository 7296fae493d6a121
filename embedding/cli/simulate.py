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

from topology.sizes import size_arg

from embedding.cli import positive_int

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
    from embedding.cli import simulate_zionex

    what = {"collective": _collective, "step": _step, "scale": _scale,
            "zionex": simulate_zionex.run, "calibrate": _calibrate,
            "validate": _validate}.get(args.what)
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


class _Job:
    """A training config's tables, dense model and optimizer, ready to plan at any size."""

    def __init__(self, args):
        import dataclasses

        from embedding.dense.types import DenseConfig
        from embedding.train import ConfigError, load_config
        from embedding.train.data import open_data
        from embedding.train.setup import tables_of

        try:
            cfg = load_config(args.config)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        plan = dataclasses.replace(cfg.plan, fabric=args.fabric or cfg.plan.fabric, file="")
        self.cfg = dataclasses.replace(cfg, plan=plan)
        self.data = open_data(self.cfg)
        self.tables = tables_of(self.cfg, self.data)
        m = self.cfg.model
        self.dense = DenseConfig(num_dense=self.data.num_dense,
                                 num_sparse=len(self.data.feature_names),
                                 bottom_mlp=m.bottom_mlp, top_mlp=m.top_mlp, dtype=m.dtype)
        from embedding.train.batching import DEFAULT_BATCH_SIZE

        #: the global batch; a default one (no --batch-size, train.batch_size 0) is
        #: rounded down to a multiple of the ranks at each size
        self.batch = args.batch_size or self.cfg.train.batch_size or DEFAULT_BATCH_SIZE
        self.batch_given = bool(args.batch_size or self.cfg.train.batch_size)
        self.args = args
        from embedding.planner.hardware import load_target

        try:
            self.target = load_target(self.cfg.plan.fabric)
        except ValueError as exc:  # worded as the planner words it
            raise ValueError(str(ConfigError(self.cfg.source, "plan.fabric", str(exc)))) \
                from None
        #: on a fabric without GPUs (and no --flops) the step's compute is measured here
        self.profiled = not args.flops and not self.target.flop_rate
        self.flops, self.flops_source = self._dense_rate()

    def step(self, ranks: int, batch: int, *, nodes: int | None = None,
             emulated: bool = False, profile: dict | None = None):
        """``(StepEstimate, PlanReport, Hardware)`` of ``ranks`` ranks at global ``batch``,
        on ``nodes`` nodes (default: ``--ranks-per-node``, else the fabric's GPUs per node);
        ``emulated``: the nodes share this host (its cores and its threads); ``profile``:
        the compute measured earlier (else measured now on fabrics without GPUs; kept in
        :attr:`last_profile`)."""
        import dataclasses

        from embedding.simulate import estimate_step
        from embedding.train import ConfigError
        from embedding.train.setup import plan_for

        if nodes:
            rpn = ranks // nodes
        else:
            rpn = self.args.ranks_per_node or max(1, min(self.target.devices_per_host, ranks))
        if ranks % rpn or not rpn:
            raise ValueError(f"--ranks-per-node: {rpn} does not divide {ranks} ranks")
        if batch % ranks and not self.batch_given:
            from embedding.train.batching import global_batch

            batch = global_batch(0, ranks)
        if batch % ranks:
            from embedding.train.batching import nearest_multiples

            near = " or ".join(map(str, nearest_multiples(batch, ranks)))
            raise ValueError(f"batch size: {batch} samples do not split evenly over {ranks} "
                             f"ranks; use a multiple of {ranks} ({near})")
        cfg = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train,
                                                                      batch_size=batch))
        given = getattr(self.args, "plan", None)
        try:
            if given:
                report, hardware = self._given_plan(cfg, given, ranks, rpn)
            else:
                report, hardware, _ = plan_for(cfg, self.tables, ranks, rpn,
                                               self.data.ids_per_sample,
                                               memory=self.args.memory)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if self.profiled:
            from embedding.profile import profile_step

            if emulated:
                hardware = dataclasses.replace(hardware, fabric=hardware.fabric.emulated())
            if profile is None:
                profile = profile_step(cfg, self.data, self.tables, report.plan, batch,
                                       ranks_on_host=ranks if emulated else rpn)
        self.last_profile = profile or {}
        est = estimate_step(report, hardware, self.dense, batch, flop_rate=self.flops,
                            optimizer=self.cfg.dense_optimizer.kind,
                            overlap=not self.args.no_overlap and self.cfg.train.overlap,
                            profile=profile)
        return est, report, hardware

    def _given_plan(self, cfg, path: str, ranks: int, rpn: int):
        from embedding.planner import PlanMismatchError, evaluate_plan
        from embedding.train.setup import planner_inputs, read_plan

        try:
            plan = read_plan(path)
        except ValueError as exc:
            raise ValueError(f"--plan: {exc}") from None
        hardware, workload, constraints = planner_inputs(
            cfg, self.tables, ranks, rpn, self.data.ids_per_sample, self.args.memory)
        try:
            return evaluate_plan(plan, self.tables, hardware, workload,
                                 constraints=constraints), hardware
        except PlanMismatchError as exc:
            raise ValueError(f"--plan: {path}: {exc}") from None

    def _dense_rate(self) -> tuple[float, str]:
        """``(dense FLOP/s per rank, where the figure comes from)``."""
        if self.args.flops:
            return float(self.args.flops), "given (--flops)"
        if self.target.flop_rate:
            return self.target.flop_rate, "the GPU's peak FP32"
        from embedding.simulate import measure_flop_rate

        return measure_flop_rate(), ("a float32 matrix product measured on this host; "
                                     "the compute parts are the trainer's own, measured here")


def _ms(x: float) -> str:
    return f"{x * 1e3:9.3f}"


def _step(args) -> int:
    job = _Job(args)
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
        _dump(args.json, {"kind": "neocomm-simulate-step", "config": args.config,
                          "fabric": job.cfg.plan.fabric, "ranks": hw.world_size,
                          "ranks_per_node": hw.ranks_per_node, "flop_rate": job.flops,
                          "flop_rate_source": job.flops_source, **est.to_dict()})
    return 0


def _scale(args) -> int:
    counts = _counts(args.ranks, "--ranks", "rank counts like 8,16,32")
    job = _Job(args)
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
        _dump(args.json, {"kind": "neocomm-simulate-scale", "config": args.config,
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


def _dump(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")


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


def _counts(text: str, what: str, expected: str) -> list[int]:
    """Positive counts written comma-separated; ValueError naming ``what`` otherwise."""
    try:
        counts = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"{what}: expected {expected}, got {text!r}")
    return counts


def _measurements(args) -> list[dict]:
    """The bench runs of ``--bench`` files, or of benches run here now (``--ranks`` x
    ``--nodes``), saved to ``--record`` when asked."""
    import tempfile

    from collectives.calibrate import median_of_launches, read_measurements, run_benches

    if args.bench:  # several files of one layout (launches) are merged as launches are
        runs = median_of_launches([run for path in args.bench
                                   for run in read_measurements(path)])
    else:
        layouts = _layouts(args)
        with tempfile.TemporaryDirectory(prefix="neocomm-calibrate-") as where:
            try:
                runs = run_benches(layouts, minbytes=args.minbytes, maxbytes=args.maxbytes,
                                   factor=args.stepfactor, out_dir=where, device=args.device,
                                   hostfile=args.hostfile, launches=args.launches,
                                   echo=lambda cmd: print(f"# {cmd}", flush=True))
            except RuntimeError as exc:
                raise ValueError(str(exc)) from None
    if args.record:
        _dump(args.record, {"kind": "neocomm-measurements", "runs": runs})
    return runs


def _rows(runs, device: bool):
    from collectives.calibrate import read_bench

    rows = [m for i, run in enumerate(runs)
            for m in read_bench(run, f"measurement {i + 1} ({run.get('op', '?')})") if m.api]
    wrong = [m for m in rows if m.device != device]
    if wrong:
        have = "device" if wrong[0].device else "host"
        raise ValueError(f"--device: the measurements are of {have} buffers; "
                         + ("drop --device" if device else "pass --device") + " to match them")
    return rows


def _check_kinds(fabric, kinds, spec_name: str) -> None:
    """Refuse measurements taken on links of another class than the fabric's."""
    for which, measured in zip(("intra", "inter"), kinds):
        have = getattr(fabric, which).kind
        if measured and have and measured != have:
            where = "within" if which == "intra" else "between"
            raise ValueError(f"the measurements were taken with {measured} {where} nodes, but "
                             f"fabric {spec_name!r} has {have} {where} nodes: measure on the "
                             f"fabric itself (or pick the fabric the runs were made on)")


def _calibrate(args) -> int:
    import dataclasses
    import os
    import socket
    import time

    from collectives.calibrate import (OPS, fabric_file, fit, huge_page_bytes, measured_kinds,
                                       model_table)
    from collectives.topofabric import TERMS, model_key, spec_links
    from topology.spec import PRESETS_DIR, load_spec, preset_names
    from topology.sysfs import probe_cache_bytes, probe_thp_mode

    spec = load_spec(args.fabric)
    runs = _measurements(args)
    rows = _rows(runs, args.device)
    kinds = measured_kinds(runs)
    start = spec_links(dataclasses.replace(spec, model=()), device=args.device)
    if kinds[1] == "shm" and start.inter.kind != "shm" and spec.nic is None:
        # nodes emulated on one host talk over its shared memory
        start = dataclasses.replace(start, inter=dataclasses.replace(start.intra))
    _check_kinds(start, kinds, spec.name)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 0)
    result = fit(rows, start, cache_bytes=0 if args.device else probe_cache_bytes(),
                 cores_per_node=0 if args.device else cores,
                 huge_page_bytes=0 if args.device else huge_page_bytes(probe_thp_mode()))
    layouts = sorted({(m.ranks, m.nodes) for m in rows})
    where = (f"{socket.gethostname()}, {time.strftime('%Y-%m-%d')}, neocomm bench at "
             + ", ".join(f"{r} ranks on {n} node(s)" for r, n in layouts))
    table = model_table(result, buffers="device" if args.device else "host",
                        kinds=(start.intra.kind, start.inter.kind), measured_on=where)
    path = PRESETS_DIR / f"{spec.name}.toml" if args.fabric in preset_names() else \
        args.fabric
    with open(path, encoding="utf-8") as fh:
        text = fabric_file(fh.read(), table)
    out = args.output or f"{spec.name}-calibrated.toml"
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(text)
    ops = sorted({m.op.value for m in rows})
    print(f"# neocomm simulate calibrate: {len(rows)} measured calls ({len(ops)} of "
          f"{len(OPS)} collectives; {', '.join(f'{r}x{n}' for r, n in layouts)} ranks x "
          f"nodes) fitted to fabric {spec.name!r}")
    print(f"# {'term':<34} {'value':>12}  from")
    kept = {model_key(t) for t in TERMS if t.name in result.kept}
    for key, value in table.items():
        if key in ("buffers", "measured_on", "measured", "factors", "overhead_factors") or \
                key.startswith("fit_"):
            continue
        origin = "host (read)" if key in ("cache_mib", "cores_per_node", "huge_page_mib") else \
            "link class" if key.endswith("_link") else \
            "fabric spec (no measurement depends on it)" if key in kept else "measured"
        print(f"  {key:<34} {value!s:>12}  {origin}")
    for label, field in (("factor", "factors"), ("overhead", "overhead_factors")):
        for key, value in table[field].items():
            print(f"  {label + ' ' + key:<34} {value:>12}  measured")
    print(f"# fit: median |log(predicted / measured)| {result.median_error:.3f}, worst "
          f"{result.worst_error:.3f}")
    print(f"# wrote {out}: pass it as --fabric {out} (simulate, plan), or check it with "
          f"neocomm simulate validate --fabric {out}")
    return 0


def _validate(args) -> int:
    if not 0 < args.tolerance < 10:
        raise ValueError(f"--tolerance: expected a fraction like 0.25, got {args.tolerance}")
    if not 0 < args.repeat_tolerance < 10:
        raise ValueError(f"--repeat-tolerance: expected a fraction like 0.1, got "
                         f"{args.repeat_tolerance}")
    if args.step:
        return _validate_step(args)
    from collectives.calibrate import compare, measured_kinds
    from collectives.topofabric import spec_links
    from topology.spec import load_spec

    spec = load_spec(args.fabric)
    runs = _measurements(args)
    rows = _rows(runs, args.device)
    fabric = spec_links(spec, device=args.device)
    _check_kinds(fabric, measured_kinds(runs), spec.name)
    table = compare(rows, fabric)
    print(f"# neocomm simulate validate: fabric {spec.name!r} ({fabric.source}); "
          f"{len(table)} measured calls; pass: |predicted / measured - 1| <= "
          f"{args.tolerance:.0%}")
    print(f"# {'ranks':>5} {'nodes':>5} {'op':<15} {'size':>10} {'algorithm':<13} "
          f"{'measured us':>12} {'predicted us':>12} {'ratio':>6}")
    for c in table:
        m = c.measurement
        print(f"  {m.ranks:>5} {m.nodes:>5} {m.op.value:<15} {m.size:>10} {m.algorithm:<13} "
              f"{m.time * 1e6:>12.1f} {c.predicted * 1e6:>12.1f} {c.ratio:>6.2f}"
              + ("" if c.within(args.tolerance) else "  off"))
    groups: dict = {}
    for c in table:
        m = c.measurement
        groups.setdefault((m.ranks, m.nodes), []).append(c)
    inside = sum(c.within(args.tolerance) for c in table)
    print(f"# within {args.tolerance:.0%}: {inside} of {len(table)} calls; " + "; ".join(
        f"{r} ranks on {n} node(s): {sum(c.within(args.tolerance) for c in cs)}/{len(cs)}"
        for (r, n), cs in sorted(groups.items())))
    repeated = {key: [ok for c in cs if (ok := c.measurement.repeated(args.tolerance))
                      is not None] for key, cs in sorted(groups.items())}
    counted = [ok for oks in repeated.values() for ok in oks]
    alike = sum(counted)
    if counted:
        launches = sorted({len(c.measurement.launch_times) for c in table} - {0})
        print(f"# the host itself: {alike} of {len(counted)} calls measured alike by every "
              f"launch ({'/'.join(map(str, launches))} launches each, within "
              f"{args.tolerance:.0%} of their median); " + "; ".join(
                  f"{r} ranks on {n} node(s): {sum(oks)}/{len(oks)}"
                  for (r, n), oks in repeated.items() if oks))
    held = [c for c in table if c.measurement.repeated(args.repeat_tolerance)]
    where = ""
    if args.baseline:
        earlier = _baseline(args, rows)
        agree = [c for c in table if _agrees(c.measurement, earlier, args.repeat_tolerance)]
        print(f"# the earlier measurement (--baseline): {len(agree)} of {len(table)} calls "
              f"within {args.repeat_tolerance:.0%} of this one")
        agreed = {id(c) for c in agree}
        held = [c for c in held if id(c) in agreed]
        where = " and the earlier measurement"
    held_in = sum(c.within(args.tolerance) for c in held)
    if counted:
        print(f"# held to the calls the host repeats (every launch{where} within "
              f"{args.repeat_tolerance:.0%} of their median): {held_in} of {len(held)} "
              f"within {args.tolerance:.0%}" + "".join(
                  f"; off: {c.measurement.op.value} {c.measurement.size} bytes at "
                  f"{c.measurement.ranks} ranks on {c.measurement.nodes} node(s) "
                  f"({c.ratio:.2f})"
                  for c in held if not c.within(args.tolerance)))
    elif args.repeatable_only:
        raise ValueError("--repeatable-only: the calls were measured by one launch each; "
                         "measure them with --launches 2 or more (or pass several --bench "
                         "files of one layout)")
    worst = max(table, key=lambda c: abs(c.ratio - 1.0))
    print(f"# worst: {worst.measurement.op.value} {worst.measurement.size} bytes at "
          f"{worst.measurement.ranks} ranks on {worst.measurement.nodes} node(s), "
          f"predicted / measured {worst.ratio:.2f}")
    if args.json:
        _dump(args.json, {"kind": "neocomm-simulate-validate", "fabric": spec.name,
                          "tolerance": args.tolerance, "within": inside,
                          "measured_alike": alike if counted else None,
                          "repeat_tolerance": args.repeat_tolerance,
                          "repeatable": len(held) if counted else None,
                          "repeatable_within": held_in if counted else None,
                          "rows": [c.to_dict() for c in table]})
    if args.repeatable_only:
        return 0 if held and held_in == len(held) else 1
    return 0 if inside == len(table) else 1


def _key(m) -> tuple:
    return (m.op, m.ranks, m.ranks_per_node, m.size, m.algorithm, m.root, m.line_rate)


def _baseline(args, rows) -> dict:
    """``{call: median seconds}`` of the ``--baseline`` measurements."""
    from collectives.calibrate import median_of_launches, read_measurements

    runs = median_of_launches([run for path in args.baseline for run in read_measurements(path)])
    return {_key(m): m.time for m in _rows(runs, args.device)}


def _agrees(m, earlier: dict, tolerance: float) -> bool:
    """Whether the earlier measurement of ``m``'s call came within ``tolerance`` of it."""
    then = earlier.get(_key(m))
    return then is not None and abs(then / m.time - 1.0) <= tolerance


def _layouts(args) -> list[tuple[int, int]]:
    """``(ranks, ranks per node)`` of every ``--ranks`` x ``--nodes`` that splits evenly."""
    layouts = [(r, r // n) for r in _counts(args.ranks, "--ranks", "rank counts like 2,4")
               for n in _counts(args.nodes, "--nodes", "node counts like 1,2")
               if r % n == 0 and n <= r]
    if not layouts:
        raise ValueError(f"--ranks {args.ranks} --nodes {args.nodes}: no rank count splits "
                         f"evenly over those nodes")
    return layouts


def _training_runs(args) -> list[dict]:
    """The training runs of ``--bench`` files (``--record`` of an earlier ``validate
    --step``), or runs made here now, each with the profile of its compute taken beside it;
    saved to ``--record`` when asked."""
    import tempfile

    from collectives.fabric import read_json
    from embedding.profile import STEP_KIND, median_of_training_launches, run_training

    if args.bench:
        runs = []
        for path in args.bench:
            data = read_json(path)
            if not isinstance(data, dict) or data.get("kind") != STEP_KIND:
                raise ValueError(f"--bench {path}: expected the training runs that "
                                 f"`neocomm simulate validate --step --record` writes")
            runs += data["runs"]
        return median_of_training_launches(runs)  # several files of one layout: launches
    with tempfile.TemporaryDirectory(prefix="neocomm-validate-") as tmp:
        try:
            return run_training(_layouts(args), config=args.config, steps=args.steps,
                                out_dir=tmp, hostfile=args.hostfile, launches=args.launches,
                                echo=lambda c: print(f"# running: {c}", flush=True))
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None


def _validate_step(args) -> int:
    import platform

    from collectives.calibrate import launches_agree
    from embedding.profile import STEP_KIND

    args.flops = None
    args.ranks_per_node = args.memory = args.plan = args.batch_size = None
    args.no_overlap = False
    job = _Job(args)
    if not job.profiled:
        raise ValueError(f"--fabric {args.fabric}: the step is validated on the machine at "
                         f"hand, a fabric without GPUs (cpu-host or its calibration)")
    runs = _training_runs(args)
    print(f"# neocomm simulate validate --step: {args.config or 'the default config'} on "
          f"fabric {args.fabric!r}; pass: |predicted / measured - 1| <= {args.tolerance:.0%}")
    print(f"# {'ranks':>5} {'nodes':>5} {'measured ms':>12} {'predicted ms':>12} {'ratio':>6}"
          f"   parts (measured / predicted ms)")
    rows, inside = [], 0
    for run in runs:
        profile = run.get("profile")
        if profile is not None:
            profile = {int(r): p for r, p in profile.items()}
        est, _, _ = job.step(run["ranks"], job.batch, nodes=run["nodes"],
                             emulated=run.get("emulated", True), profile=profile)
        measured = run["median_step_ms"] / 1e3
        ratio = est.step_seconds / measured
        ok = abs(ratio - 1.0) <= args.tolerance
        inside += ok
        phases = run["median_phases_ms"]
        detail = " ".join(f"{p} {phases.get(p, 0.0):.1f}/{t * 1e3:.1f}" for p, t in est.parts
                          if phases.get(p, 0.0) >= 0.05 or t >= 5e-5)
        print(f"  {run['ranks']:>5} {run['nodes']:>5} {measured * 1e3:>12.2f} "
              f"{est.step_seconds * 1e3:>12.2f} {ratio:>6.2f}   {detail}"
              + ("" if ok else "  off"))
        run = dict(run, profile={str(r): p for r, p in job.last_profile.items()})
        rows.append({"run": run, "predicted": est.to_dict(), "ratio": ratio})
    print(f"# within {args.tolerance:.0%}: {inside} of {len(runs)} layouts")
    repeats = [run for run in runs if len(run.get("launch_step_ms") or ()) > 1]
    if repeats:
        alike = [run for run in repeats if launches_agree(
            run["launch_step_ms"], run["median_step_ms"], args.tolerance)]
        print(f"# the host itself: {len(alike)} of {len(repeats)} layouts measured alike by "
              f"every launch (within {args.tolerance:.0%} of their median step; launches "
              + ", ".join(f"{r['ranks']}x{r['nodes']}: " + "/".join(
                  f"{t:.1f}" for t in r["launch_step_ms"]) + " ms" for r in repeats) + ")")
    if args.record:
        _dump(args.record, {"kind": STEP_KIND, "host": platform.node(),
                            "runs": [r["run"] for r in rows]})
    if args.json:
        _dump(args.json, {"kind": "neocomm-simulate-validate-step", "fabric": args.fabric,
                          "tolerance": args.tolerance, "within": inside, "rows": rows})
    return 0 if inside == len(runs) else 1
