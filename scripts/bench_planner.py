#!/usr/bin/env python
"""Benchmark the sharding planner: planning time, fit, and imbalance against a
plain greedy table-wise baseline planned in the same run.

Cases (hosts like the captured ``dgx-a100``: 8 A100-80GB per node, NVLink,
InfiniBand): Criteo 1TB on 8 ranks, the uncapped Criteo set on 8 ranks,
500 synthetic tables on 64 ranks. For each it prints the planner's wall time
(in-process, and the whole ``neocomm plan`` command in a subprocess), whether
the plan fits, the estimated step time and imbalance (max/mean per-rank time)
of the plan and of the baseline, and their ratio, plus the step time each
partitioner reached on the planner's chosen shardings.

    python scripts/bench_planner.py [--repeat 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from topology.sizes import GIB, size_arg

CASES = [("criteo-1tb", 8), ("criteo-1tb-uncapped", 8), ("synthetic-500", 64)]


def _best_of(repeat, fn):
    best, result = None, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best, result


def run_case(name: str, world: int, args) -> dict:
    from embedding.planner import PlanDoesNotFitError, Workload, baseline_plan, plan_sharding
    from embedding.planner.hardware import hardware_for, load_target
    from embedding.planner.tables import preset_tables

    tables, pooling = preset_tables(name)
    bandwidth = args.device_bandwidth * 1e9 if args.device_bandwidth else None
    hardware = hardware_for(load_target(args.fabric), world, device_memory=args.memory,
                                 reserve=args.reserve, memory_bandwidth=bandwidth)
    workload = Workload(batch_size=args.batch_size)
    plan_s, report = _best_of(args.repeat, lambda: plan_sharding(tables, hardware, workload,
                                                                 constraints=pooling))
    row = {"case": name, "world_size": world, "ranks_per_node": hardware.ranks_per_node,
           "tables": len(tables), "weights_gib": sum(t.weight_bytes for t in tables) / GIB,
           "plan_seconds": plan_s, "fits": True, "step_ms": report.step_seconds * 1e3,
           "imbalance": report.imbalance, "memory_imbalance": report.memory_imbalance,
           "max_rank_gib": report.max_memory / GIB,
           "partitioners_ms": {label: (None if s is None else s * 1e3)
                               for label, s in report.alternatives},
           "method": report.method.value if report.method else None,
           "shardings": {}}
    for t in report.tables:
        row["shardings"][t.label] = row["shardings"].get(t.label, 0) + 1
    try:
        base_s, base = _best_of(args.repeat, lambda: baseline_plan(tables, hardware, workload,
                                                                   constraints=pooling))
        row.update(baseline_seconds=base_s, baseline_step_ms=base.step_seconds * 1e3,
                   baseline_imbalance=base.imbalance,
                   speedup_vs_baseline=base.step_seconds / report.step_seconds)
    except PlanDoesNotFitError as exc:
        row.update(baseline_error=str(exc))
    cmd = [sys.executable, "-m", "neocomm.cli", "plan", name, "-n", str(world), "--memory",
           f"{args.memory}", "--summary", "--fabric", args.fabric,
           "--batch-size", str(args.batch_size)]
    if args.device_bandwidth:
        cmd += ["--device-bandwidth", str(args.device_bandwidth)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row["command_seconds"] = time.perf_counter() - t0
    row["command_rc"] = proc.returncode
    return row


def run_partitioners(name: str, world: int, args) -> dict:
    """Greedy against Karmarkar–Karp on the same table-wise shards (no search)."""
    from embedding.planner.estimate import CostModel
    from embedding.planner.hardware import hardware_for, load_target
    from embedding.planner.placement import place, score
    from embedding.planner.search import candidates_of
    from embedding.planner.types import PartitionMethod, TableConstraints, Workload
    from embedding.planner.tables import preset_tables
    from embedding.types import ShardingType

    tables, pooling = preset_tables(name)
    bandwidth = args.device_bandwidth * 1e9 if args.device_bandwidth else None
    hardware = hardware_for(load_target(args.fabric), world, device_memory=args.memory,
                                 reserve=args.reserve, memory_bandwidth=bandwidth)
    workload = Workload(batch_size=args.batch_size)
    cost = CostModel(hardware)
    only = {t.name: TableConstraints(ids_per_sample=pooling[t.name].ids_per_sample
                                     if t.name in pooling else None,
                                     shardings=(ShardingType.TABLE_WISE,)) for t in tables}
    chosen = [cs[0] for cs in candidates_of(tables, hardware, workload, only, cost)]
    row = {"case": f"partitioners {name}", "world_size": world}
    for method in PartitionMethod:
        secs, ranks = _best_of(args.repeat, lambda: place(chosen, hardware, method))
        rep = score(chosen, ranks, hardware, cost, method)
        row[method.value] = {"seconds": secs, "step_ms": rep.step_seconds * 1e3,
                             "imbalance": rep.imbalance}
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    p.add_argument("--fabric", default="dgx-a100")
    p.add_argument("--memory", type=size_arg, default=80 * GIB,
                   help="device memory, a size such as 80G (default 80G)")
    p.add_argument("--reserve", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=65536)
    p.add_argument("--device-bandwidth", type=float, default=None, metavar="GB/S",
                   help="device memory throughput (datasheet figure), GB/s")
    p.add_argument("--json", default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)
    rows = [run_case(name, world, args) for name, world in CASES]
    for r in rows:
        print(f"{r['case']} on {r['world_size']} ranks ({r['tables']} tables, "
              f"{r['weights_gib']:.1f} GiB of weights)")
        print(f"  planner {r['plan_seconds'] * 1e3:.1f} ms in-process, `neocomm plan` "
              f"{r['command_seconds']:.2f} s (exit {r['command_rc']}); fits, largest rank "
              f"{r['max_rank_gib']:.1f} GiB; shardings {r['shardings']}")
        print(f"  plan: step {r['step_ms']:.3f} ms, imbalance {r['imbalance']:.3f}, memory "
              f"imbalance {r['memory_imbalance']:.3f}; placements (step ms): "
              + ", ".join(f"{k} {'-' if v is None else f'{v:.3f}'}"
                          for k, v in r["partitioners_ms"].items()))
        if "baseline_error" in r:
            print(f"  baseline (greedy table-wise): {r['baseline_error']}")
        else:
            print(f"  baseline (greedy table-wise): step {r['baseline_step_ms']:.3f} ms, "
                  f"imbalance {r['baseline_imbalance']:.3f}; plan/baseline step ratio "
                  f"{1 / r['speedup_vs_baseline']:.3f} ({r['speedup_vs_baseline']:.2f}x "
                  f"faster); planning time ratio plan/baseline "
                  f"{r['plan_seconds'] / r['baseline_seconds']:.1f}")
    for name, world in (("synthetic-64", 8), ("synthetic-100", 16), ("synthetic-500", 64)):
        r = run_partitioners(name, world, args)
        g, k = r["greedy"], r["karmarkar_karp"]
        print(f"{r['case']} table-wise on {world} ranks: greedy step {g['step_ms']:.3f} ms "
              f"(imbalance {g['imbalance']:.3f}, {g['seconds'] * 1e3:.1f} ms to place), "
              f"karmarkar_karp step {k['step_ms']:.3f} ms (imbalance {k['imbalance']:.3f}, "
              f"{k['seconds'] * 1e3:.1f} ms to place); kk/greedy step ratio "
              f"{k['step_ms'] / g['step_ms']:.4f}")
        rows.append(r)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if all(r.get("command_rc", 0) == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
