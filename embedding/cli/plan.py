"""``neocomm plan``: plan the sharding of embedding tables onto ranks.

Reads a table set (a built-in one such as ``criteo-1tb``, or a TOML/JSON
table file), plans it for ``-n`` ranks and prints per table its sharding,
ranks, memory tier and memory, per rank its device and host memory and
estimated time by step part, and the imbalance; ``--json FILE`` writes the
plan (with the estimates under ``"estimate"``). With ``--host-memory`` the
planner may keep tables in host memory behind a device cache. Exit status:
0 planned, 1 the tables do not fit (or ``--check`` found a mismatch), 2 bad
input.
"""
from __future__ import annotations

import argparse
import sys

from topology.numbers import positive_float_arg
from topology.sizes import GIB, size_arg

from embedding.cli import positive_int as _positive_int

__all__ = ["HELP", "add_arguments", "run"]

HELP = "plan the sharding of embedding tables"


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tables", nargs="?", default=None,
                        help="a table set (criteo-1tb, criteo-1tb-uncapped, "
                        "criteo-1tb-100x, criteo-1tb-1000x, tiny: the trainer's [tables] "
                        "presets, tables C1..C26; synthetic-N) or a .toml/.json table file "
                        "(see docs/planner.md)")
    parser.add_argument("--config", metavar="TRAIN.toml", default=None,
                        help="plan the tables a training config implies (names and sizes from "
                        "its data, pooling factors from a Parquet source's columns, its "
                        "dim, optimizer, batch and [plan] target): the plan neocomm train "
                        "makes; write it with --json and train with neocomm train --plan")
    parser.add_argument("--dim", type=_positive_int, default=None,
                        help="embedding dimension of every table of a table set (default: "
                        "the set's, 128 for the Criteo sets); give the trainer's "
                        "model.embedding_dim to plan for neocomm train")
    parser.add_argument("-n", "--world-size", type=_positive_int, required=True,
                        help="number of ranks (one device each)")
    parser.add_argument("--ranks-per-node", type=_positive_int, default=None,
                        help="ranks per node (default: the GPUs per host of --fabric, at "
                        "most -n)")
    parser.add_argument("--memory", type=size_arg, default=None,
                        help="device memory per rank, e.g. 80GiB or 80GB (default: the GPU "
                        "memory of --fabric)")
    parser.add_argument("--host-memory", type=size_arg, default=None, metavar="SIZE",
                        help="host memory per node for tables kept in host memory behind a "
                        "device cache, e.g. 512GiB (default: none, every table in device "
                        "memory; with --config: its [plan] host_memory)")
    parser.add_argument("--host-bandwidth", type=positive_float_arg, default=None,
                        metavar="GB/S", help="host-to-device copy throughput per rank in "
                        "GB/s, each way, that cache misses move at (default: 0.8 of the "
                        "PCIe x16 line rate of the GPUs of --fabric, 25.2 for A100; the copy "
                        "throughput on hosts without GPUs)")
    parser.add_argument("--zipf-exponent", type=positive_float_arg, default=None, metavar="S",
                        help="the ids of a table without access statistics follow Zipf(S) "
                        "over its rows, for the hit rate of a device cache (default 1.05)")
    parser.add_argument("--reserve", type=_fraction, default=0.1,
                        help="fraction of device memory kept for the dense model, "
                        "activations and the runtime (default 0.1)")
    parser.add_argument("--batch-size", type=_positive_int, default=None,
                        help="global batch, samples per step over all ranks (default 65536; "
                        "with --config its train.batch_size)")
    parser.add_argument("--ids-per-sample", type=positive_float_arg, default=None,
                        help="mean ids per sample per table; tables may override it "
                        "(default 1: one-hot)")
    parser.add_argument("--fabric", default=None, metavar="NAME|FILE",
                        help="the machines planned for: a captured host (dgx-a100, dgx1-v100, "
                        "cpu-host), a fabric spec (zionex, dgx-h100, or a .toml file) or a "
                        "topology JSON file (default dgx-a100)")
    parser.add_argument("--device-bandwidth", type=positive_float_arg, default=None,
                        metavar="GB/S", help="device memory throughput in GB/s (a datasheet "
                        "figure such as 2039 for an A100-SXM4-80GB): lookups, local copies "
                        "and reductions run at it (default: the link model's figure for the "
                        "GPUs of --fabric, else the fabric's copy throughput)")
    parser.add_argument("--min-column-dim", type=_positive_int, default=32,
                        help="narrowest column slice proposed, elements (default 32)")
    parser.add_argument("--method", choices=("best", "greedy", "kk"), default="best",
                        help="partitioner of the final placement (default: best of both)")
    parser.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                        help="pack tables of at most --pack-rows rows that share dim, dtype, "
                        "optimizer and pooling into one table each, planned as one (default: "
                        "no; with --config its [plan] pack)")
    parser.add_argument("--pack-rows", type=_positive_int, default=None, metavar="ROWS",
                        help="largest table packed, rows (default 131072; with --config its "
                        "[plan] pack_rows)")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="write the plan (ShardingPlan JSON) to FILE ('-': stdout)")
    parser.add_argument("--baseline", action="store_true",
                        help="also plan every table whole on one rank by plain greedy and "
                        "show its imbalance")
    parser.add_argument("--summary", action="store_true",
                        help="print the per-rank table and totals only")
    parser.add_argument("--check", metavar="PLAN", default=None,
                        help="check a plan file against -n, --ranks-per-node and the tables "
                        "instead of planning")


def _err(message: str) -> int:
    print(f"neocomm plan: error: {message}", file=sys.stderr)
    return 2


def _load(spec: str, dim: int | None = None):
    from embedding.planner.tables import load_tables, preset_tables
    from embedding.presets import preset_names

    if spec.endswith((".toml", ".json")):
        if dim is not None:
            raise ValueError(f"--dim: sets the dimension of a table set's tables; the table "
                             f"file {spec} gives each table's dim")
        return load_tables(spec)
    try:
        return preset_tables(spec, dim=dim)
    except ValueError:
        raise ValueError(f"tables: unknown table set {spec!r}; expected one of "
                         f"{preset_names()} or a .toml/.json file") from None


def run(args: argparse.Namespace) -> int:
    from embedding.packing import DEFAULT_PACK_ROWS, packed_tables
    from embedding.planner import (PartitionMethod, PlanDoesNotFitError, Workload,
                                   baseline_plan, plan_sharding)
    from embedding.planner.hardware import hardware_for, load_target

    if args.config is not None:
        return _plan_config(args)
    if args.tables is None:
        return _err("tables: give a table set or file, or --config TRAIN.toml")
    args.fabric = args.fabric or "dgx-a100"
    args.batch_size = args.batch_size or 65536
    args.ids_per_sample = args.ids_per_sample or 1.0
    try:
        tables, constraints = _load(args.tables, args.dim)
        target = load_target(args.fabric)
        bandwidth = args.device_bandwidth * 1e9 if args.device_bandwidth else None
        copies = args.host_bandwidth * 1e9 if args.host_bandwidth else None
        hardware = hardware_for(target, args.world_size, ranks_per_node=args.ranks_per_node,
                                device_memory=args.memory, reserve=args.reserve,
                                min_column_dim=args.min_column_dim, memory_bandwidth=bandwidth,
                                host_memory=args.host_memory or 0, host_bandwidth=copies)
        workload = Workload(batch_size=args.batch_size, ids_per_sample=args.ids_per_sample,
                            zipf_exponent=args.zipf_exponent or 1.05)
    except PlanDoesNotFitError as exc:
        print(f"neocomm plan: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        return _err(str(exc))
    if args.check:
        return _check(args.check, hardware, tables)
    methods = {"best": (PartitionMethod.GREEDY, PartitionMethod.KARMARKAR_KARP),
               "greedy": (PartitionMethod.GREEDY,),
               "kk": (PartitionMethod.KARMARKAR_KARP,)}[args.method]
    pack_rows = (args.pack_rows or DEFAULT_PACK_ROWS) if args.pack else None
    try:
        report = plan_sharding(tables, hardware, workload, constraints=constraints,
                               methods=methods, pack_rows=pack_rows)
    except PlanDoesNotFitError as exc:
        return _no_fit(exc, args)
    except ValueError as exc:
        return _err(str(exc))
    out = _write_json(report, hardware, args.json)
    if isinstance(out, int):
        return out
    _print_packs(report, out)
    _print(report, packed_tables(tables, report.plan), hardware, workload, out,
           summary=args.summary)
    if args.baseline:
        try:
            base = baseline_plan(tables, hardware, workload, constraints=constraints)
            print(f"baseline (every table whole, plain greedy): step "
                  f"{base.step_seconds * 1e3:.3f} ms, imbalance {base.imbalance:.3f}, "
                  f"memory imbalance {base.memory_imbalance:.3f}; plan: step "
                  f"{report.step_seconds * 1e3:.3f} ms, imbalance {report.imbalance:.3f} "
                  f"({base.step_seconds / report.step_seconds:.2f}x faster)", file=out)
        except PlanDoesNotFitError as exc:
            print(f"baseline (every table whole, plain greedy): {exc}", file=out)
    if args.json and args.json != "-":
        print(f"plan written to {args.json}", file=out)
    return 0


def _print_packs(report, out) -> None:
    """One line naming the packed tables of ``report``'s plan, if any."""
    packs = report.plan.packs
    if packs:
        print(f"packed {sum(len(p.members) for p in packs)} tables into {len(packs)}: "
              + ", ".join(f"{p.name} ({len(p.members)} tables, {p.num_rows} rows)"
                          for p in packs), file=out)


def _no_fit(exc, args) -> int:
    """Exit status and message of a plan that does not fit: 2 when ``--host-memory`` is
    smaller than a table's smallest host-resident shard, else 1."""
    if exc.tier == "host" and exc.table and exc.device_short == 0 and exc.host_short == 0:
        flag = "--host-memory" if args.host_memory else "[plan] host_memory"
        return _err(f"{flag} {_gib(exc.available)} GiB: {exc}")
    print(f"neocomm plan: {exc}", file=sys.stderr)
    return 1


def plan_json(report, hardware) -> str:
    """The plan of ``report`` as JSON (:meth:`ShardingPlan.to_json`) with the planner's
    estimates under ``"estimate"``: per rank its device and host bytes, seconds and
    seconds by step part; per table its tier, cache rows, hit rate and its source.
    :func:`~embedding.train.setup.read_plan` reads the plan and ignores the estimates."""
    import json

    data = json.loads(report.plan.to_json())
    data["estimate"] = {
        "step_seconds": report.step_seconds,
        "device_memory_usable": report.usable_memory,
        "host_memory_per_node": report.host_memory,
        "host_bandwidth": hardware.host_rate if report.host_memory else 0.0,
        "hit_rates": report.hit_model,
        "ranks": [{"rank": r.rank, "node": hardware.node_of(r.rank),
                   "device_bytes": r.memory.total, "host_bytes": r.memory.host,
                   "seconds": r.seconds, "host_copy_seconds": r.host_seconds,
                   "parts": dict(r.parts)} for r in report.ranks],
        "tables": [{"table": t.table, "sharding": t.label, "tier": t.tier.tier.value,
                    "cache_rows": t.tier.cache_rows, "device_bytes": t.memory,
                    "host_bytes": t.host_memory, "hit_rate": t.hit_rate,
                    "hit_rate_source": t.hit_source or None} for t in report.tables],
    }
    return json.dumps(data, indent=1)


def _write_json(report, hardware, target):
    """Write the plan to ``--json`` (``-``: stdout); the stream the printout goes to, or the
    exit status of a file that cannot be written."""
    if target == "-":
        sys.stdout.write(plan_json(report, hardware) + "\n")
        return sys.stderr
    if target:
        try:
            with open(target, "w", encoding="utf-8") as fh:
                fh.write(plan_json(report, hardware) + "\n")
        except OSError as exc:
            return _err(f"--json {target}: cannot write: {exc.strerror}")
    return sys.stdout


def _plan_config(args) -> int:
    """``--config``: the plan ``neocomm train`` makes for that config on ``-n`` ranks."""
    import dataclasses

    from embedding.packing import packed_tables

    from embedding.data.types import DataFormatError
    from embedding.planner import PlanDoesNotFitError
    from embedding.train import ConfigError, load_config
    from embedding.train.data import open_data
    from embedding.train.setup import plan_for, tables_of

    given = [flag for flag, v in (("TABLES", args.tables), ("--dim", args.dim),
                                  ("--ids-per-sample", args.ids_per_sample),
                                  ("--device-bandwidth", args.device_bandwidth),
                                  ("--host-bandwidth", args.host_bandwidth),
                                  ("--zipf-exponent", args.zipf_exponent),
                                  ("--check", args.check)) if v is not None]
    if given:
        return _err(f"{', '.join(given)}: not with --config (the config and its data give "
                    f"the tables and their pooling)")
    rpn = args.ranks_per_node or args.world_size
    if args.world_size % rpn:
        return _err(f"--ranks-per-node: {rpn} does not divide -n {args.world_size}")
    try:
        cfg = load_config(args.config)
        plan_cfg = dataclasses.replace(
            cfg.plan, fabric=args.fabric or cfg.plan.fabric, file="",
            pack=cfg.plan.pack if args.pack is None else args.pack,
            pack_rows=args.pack_rows or cfg.plan.pack_rows)
        train = dataclasses.replace(cfg.train, batch_size=args.batch_size or
                                    cfg.train.batch_size)
        from embedding.train.batching import resolve_batches

        cfg = resolve_batches(dataclasses.replace(cfg, plan=plan_cfg, train=train),
                              args.world_size)
        data = open_data(cfg)
        tables = tables_of(cfg, data)
        report, hardware, workload = plan_for(cfg, tables, args.world_size, rpn,
                                              data.ids_per_sample, memory=args.memory,
                                              host_memory=args.host_memory)
    except PlanDoesNotFitError as exc:
        return _no_fit(exc, args)
    except DataFormatError as exc:
        print(f"neocomm plan: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError) as exc:
        return _err(str(exc))
    out = _write_json(report, hardware, args.json)
    if isinstance(out, int):
        return out
    pooling = data.ids_per_sample or {}
    if pooling:
        print("pooling factors from the data (ids per sample): " + ", ".join(
            f"{t} {v:.2f}" for t, v in pooling.items()), file=out)
    _print_packs(report, out)
    _print(report, packed_tables(tables, report.plan), hardware, workload, out,
           summary=args.summary)
    if args.json and args.json != "-":
        print(f"plan written to {args.json}; train with: neocomm run -n {args.world_size} -- "
              f"neocomm train --config {args.config} --plan {args.json}", file=out)
    return 0


def _check(path: str, hardware, tables) -> int:
    from embedding.planner import PlanMismatchError, validate_plan
    from embedding.types import ShardingPlan

    try:
        with open(path, encoding="utf-8") as fh:
            plan = ShardingPlan.from_json(fh.read())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _err(f"{path}: not a sharding plan: {exc}")
    try:
        validate_plan(plan, hardware.world_size, ranks_per_node=hardware.ranks_per_node,
                      tables=tables)
    except PlanMismatchError as exc:
        print(f"neocomm plan: {path}: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: a plan of {len(plan.tables)} tables for {plan.world_size} ranks in nodes "
          f"of {plan.ranks_per_node}: matches")
    return 0


def _ranks(ranks) -> str:
    """``0-3,6`` for (0, 1, 2, 3, 6)."""
    out, run_start, prev = [], None, None
    for r in list(ranks) + [None]:
        if run_start is not None and (r is None or r != prev + 1):
            out.append(str(run_start) if prev == run_start else f"{run_start}-{prev}")
            run_start = None
        if r is not None and run_start is None:
            run_start = r
        prev = r
    return ",".join(out)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


_PARTS = (("input_dist", "in_dist"), ("lookup", "lookup"), ("output_dist", "out_dist"),
          ("emb_backward", "emb_bwd"), ("grad_sync", "grad_sync"))


def _tier(t) -> str:
    """``device``, ``host`` or ``cached 1234567``."""
    m = t.tier
    return f"cached {m.cache_rows}" if m.cache_rows else m.tier.value


def _print(report, tables, hardware, workload, out, summary: bool = False) -> None:
    rows = {t.name: t for t in tables}
    w = lambda *a: print(*a, file=out)  # noqa: E731
    tiers = bool(report.host_memory)
    w(f"plan of {len(tables)} tables for {hardware.world_size} ranks ({hardware.num_nodes} "
      f"node(s) x {hardware.ranks_per_node}), {_gib(hardware.device_memory)} GiB per device, "
      f"{_gib(hardware.usable_memory)} GiB usable; global batch {workload.batch_size}, "
      f"{workload.ids_per_sample:g} id(s) per sample")
    w(f"fabric: {hardware.fabric.source}; device memory traffic at "
      f"{hardware.lookup_rate / 1e9:.0f} GB/s")
    if tiers:
        w(f"host tier: {_gib(report.host_memory)} GiB per node, host<->device copies at "
          f"{hardware.host_rate / 1e9:.1f} GB/s per rank each way")
        if report.hit_model:
            w(report.hit_model)
    if not summary:
        name_w = max(5, max(len(t.table) for t in report.tables))
        w("")
        w("per table (GiB and ms: all its shards added up; cache: rows per shard)")
        head = (f"{'table':<{name_w}}  {'rows':>11}  {'dim':>4}  {'sharding':<22}  "
                f"{'ranks':<12}  {'GiB':>8}  {'ms':>8}")
        w(head + (f"  {'tier':<17}  {'host GiB':>8}  {'hit':>5}" if tiers else ""))
        for t in report.tables:
            cfg = rows[t.table]
            line = (f"{t.table:<{name_w}}  {cfg.num_rows:>11}  {cfg.dim:>4}  {t.label:<22}  "
                    f"{_ranks(t.ranks):<12}  {_gib(t.memory):>8}  {t.seconds * 1e3:>8.3f}")
            if tiers:
                hit = f"{t.hit_rate:.3f}" if t.tier.tiered else ""
                line += f"  {_tier(t):<17}  {_gib(t.host_memory):>8}  {hit:>5}"
            w(line)
    w("")
    w("per rank (GiB: device memory; ms: estimated step time of the rank)")
    w(f"{'rank':>4}  {'node':>4}  {'GiB':>8}  {'weights':>8}  {'optim':>8}  {'buffers':>8}  "
      f"{'ms':>8}  {'shards':>6}" + (f"  {'host GiB':>8}" if tiers else ""))
    for r in report.ranks:
        m = r.memory
        w(f"{r.rank:>4}  {hardware.node_of(r.rank):>4}  {_gib(m.total):>8}  "
          f"{_gib(m.weights):>8}  {_gib(m.optimizer):>8}  {_gib(m.buffers):>8}  "
          f"{r.seconds * 1e3:>8.3f}  {r.shards:>6}" + (f"  {_gib(m.host):>8}" if tiers else ""))
    w("")
    w("per rank step parts (ms; latency: each collective's fixed time"
      + ("; host copy: rows of host-resident shards in and back, within lookup and emb_bwd)"
         if tiers else ")"))
    w(f"{'rank':>4}  " + "  ".join(f"{label:>9}" for _, label in _PARTS)
      + f"  {'latency':>9}" + (f"  {'host copy':>9}" if tiers else ""))
    for r in report.ranks:
        parts = dict(r.parts)
        latency = r.seconds - sum(parts.values())
        w(f"{r.rank:>4}  " + "  ".join(f"{parts.get(p, 0.0) * 1e3:>9.3f}" for p, _ in _PARTS)
          + f"  {latency * 1e3:>9.3f}" + (f"  {r.host_seconds * 1e3:>9.3f}" if tiers else ""))
    w("")
    method = report.method.value if report.method else "-"
    tried = ", ".join(f"{label} {'does not fit' if s is None else f'{s * 1e3:.3f} ms'}"
                      for label, s in report.alternatives)
    w(f"estimated step (slowest rank): {report.step_seconds * 1e3:.3f} ms; imbalance "
      f"(max/mean time): {report.imbalance:.3f}; memory imbalance: "
      f"{report.memory_imbalance:.3f}; largest rank {_gib(report.max_memory)} GiB of "
      f"{_gib(report.usable_memory)} GiB usable")
    if tiers:
        per_node = report.node_host_bytes(hardware.ranks_per_node)
        kinds = {}
        for t in report.tables:
            kinds[t.tier.tier.value] = kinds.get(t.tier.tier.value, 0) + 1
        w("tiers: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
          + f"; host memory: largest node {_gib(max(per_node))} GiB of "
          f"{_gib(report.host_memory)} GiB")
    w(f"placement: {method} (tried: {tried})")
