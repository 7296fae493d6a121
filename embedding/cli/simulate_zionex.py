"""``neocomm simulate zionex``: Neo's DLRM workloads on ZionEX, predicted beside the paper.

For each workload of :mod:`embedding.neo` and each rank count, plans the
tables as ``neocomm plan`` does (device memory first; when they do not fit,
again with ``--host-memory`` bytes per node of host memory behind a device
cache) and prices one step as ``neocomm simulate step`` does, at the paper's
local batch per GPU. Prints the predicted samples/s, the step time, what
bounds it, the paper's reported throughput (at 128 GPUs) and predicted /
reported. ``--json FILE`` writes every row with its step parts.
Exit status: 0 done, 2 bad input.
"""
from __future__ import annotations

import argparse
import json

from topology.sizes import GIB, size_or_zero_arg

__all__ = ["HOST_MEMORY", "add_parser", "run"]

#: Host memory per ZionEX node that host-resident tables may take, bytes: assumed (the
#: paper gives 4 CPU sockets per node but no DRAM size here): 4 sockets x 512 GiB.
HOST_MEMORY = 2 << 40


def add_parser(sub) -> None:
    """Add the ``zionex`` subcommand to ``neocomm simulate``'s subparsers."""
    q = sub.add_parser("zionex", help="Neo's DLRM workloads on ZionEX: predicted samples/s "
                       "beside the paper's reported throughput")
    q.add_argument("--workload", default="model-a,model-f,model-i",
                   help="workloads, comma-separated (default: all: model-a,model-f,model-i)")
    q.add_argument("--ranks", default="128",
                   help="rank counts (GPUs), comma-separated (default 128, the paper's)")
    q.add_argument("--fabric", metavar="NAME|FILE", default="zionex",
                   help="the fabric spec (default zionex)")
    q.add_argument("--host-memory", type=size_or_zero_arg, default=HOST_MEMORY, metavar="SIZE",
                   help="host memory per node for tables that do not fit in device memory "
                   "(default 2T: assumed); 0: device memory only")
    q.add_argument("--json", metavar="FILE", default=None, help="write every row as JSON")


def _rows(args) -> list[dict]:
    from embedding import neo
    from embedding.planner import PlanDoesNotFitError
    from embedding.simulate import predict_workload

    names = [w.strip() for w in str(args.workload).split(",") if w.strip()]
    if not names:
        raise ValueError(f"--workload: expected names like model-a, got {args.workload!r}")
    try:
        models = [neo.model(w) for w in names]
    except ValueError as exc:
        raise ValueError(f"--workload: {str(exc).split(': ', 1)[1]}") from None
    try:
        ranks = [int(x) for x in str(args.ranks).split(",") if x.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise ValueError(f"--ranks: expected rank counts like 64,128, got {args.ranks!r}")
    rows = []
    for m in models:
        for n in ranks:
            row = {"workload": m.name, "ranks": n, "reported_samples_per_second":
                   m.reported_qps if n == 128 else None, "paper_verified": m.verified}
            try:
                try:
                    p = predict_workload(m, n, fabric=args.fabric)
                except PlanDoesNotFitError:
                    if not args.host_memory:
                        raise
                    p = predict_workload(m, n, fabric=args.fabric,
                                         host_memory=args.host_memory)
            except PlanDoesNotFitError as exc:
                row.update(predicted=None, reason=str(exc))
            else:
                row.update(predicted=p.to_dict())
                if row["reported_samples_per_second"]:
                    row["ratio"] = p.samples_per_second / m.reported_qps
            rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    rows = _rows(args)
    print(f"# neocomm simulate zionex: Neo's workloads (arXiv 2104.05158) on fabric "
          f"{args.fabric!r}, the paper's local batch per GPU; host tier "
          f"{args.host_memory / GIB:.0f} GiB per node when device memory is short")
    print(f"# {'workload':<8} {'ranks':>5} {'batch':>8} {'step ms':>8} {'samples/s':>11} "
          f"{'comm':>5} {'bound':<13} {'host tables':>11} {'paper':>10} {'ratio':>6}")
    for r in rows:
        p, paper = r["predicted"], r["reported_samples_per_second"]
        tail = f"{paper:>10,.0f}" if paper else f"{'-':>10}"
        if p is None:
            print(f"  {r['workload']:<8} {r['ranks']:>5} not placed: {r['reason']}")
            continue
        share = sum(p["parts"][k] for k in ("input_dist", "output_dist", "emb_backward",
                                             "sync", "grad_sync")) / p["step_seconds"]
        print(f"  {r['workload']:<8} {r['ranks']:>5} {p['global_batch']:>8} "
              f"{p['step_seconds'] * 1e3:>8.2f} {p['samples_per_second']:>11,.0f} "
              f"{share:>5.0%} {p['bound']:<13} {p['tiered_tables']:>11} {tail} "
              + (f"{r['ratio']:>6.2f}" if r.get("ratio") else f"{'-':>6}"))
    if not all(r["paper_verified"] for r in rows):
        print("# paper: the figures of the paper's model table; not checked against a stored "
              "copy of it here (see docs/simulate.md, ZionEX)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"kind": "neocomm-simulate-zionex", "fabric": args.fabric,
                       "host_memory_per_node": args.host_memory, "rows": rows}, fh, indent=1)
            fh.write("\n")
    return 0
