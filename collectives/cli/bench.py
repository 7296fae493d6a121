"""``neocomm bench OP [OP ...]``: collective bandwidth tests in the style of nccl-tests.

Run it on every rank, e.g. ``neocomm run -n 4 -- neocomm bench all_reduce -b 1M
-e 64M --algo ring,rabenseifner``, or across nodes with ``--hostfile``. Several ops
(or ``all``) run one after the other in the one job, each with its own table, and
``--json`` then takes ``{op}`` in its name (a file per op). Rank 0
prints one line per size: for the native MPI peer (``mpi``) and each chosen
algorithm the time (us), algbw and busbw (GB/s), the number of wrong output
elements of the checked iterations (summed over ranks) and the ratio peer
time / algorithm time (above 1: faster than MPI).

With ``--device`` the buffers are CuPy arrays on each rank's GPU, so every
call runs over the device backend (NCCL), and the peer is that backend's own
collective (``native``) instead of the MPI host call.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

from topology.sizes import MIB, size_arg

__all__ = ["HELP", "add_arguments", "run"]

HELP = "collective bandwidth tests in the style of nccl-tests"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("ops: all_to_all all_to_all_v reduce_scatter all_reduce all_gather broadcast "
                "one_to_many many_to_many (all: every one)\nexamples: neocomm run -n 2 -- "
                "neocomm bench all_reduce -b 1M -e 64M --algo ring,rabenseifner --json "
                "ar.json\n          neocomm run -n 2 -- neocomm bench all -b 1K -e 1M "
                "--json 'bench_{op}.json'")
    p.add_argument("op", nargs="*", help="the collective(s) (see below), one after the other "
                   "in this job; 'all' for every one; omit with --list")
    p.add_argument("-b", "--minbytes", type=size_arg, default=64 << 10,
                   help="smallest size in bytes (K/M/G suffixes, powers of 1024: 1M, "
                        "1MB and 1MiB are 1048576), default 64K")
    p.add_argument("-e", "--maxbytes", type=size_arg, default=64 << 20,
                   help="largest size, default 64M")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0,
                   help="multiply the size by this between steps, default 2")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations, default 20")
    p.add_argument("-w", "--warmup_iters", type=int, default=5,
                   help="untimed warm-up iterations, default 5")
    p.add_argument("-c", "--check", type=int, default=1,
                   help="checked iterations per size and algorithm (0: none), default 1")
    p.add_argument("-r", "--repeat", type=int, default=3,
                   help="timed rounds per size, algorithms interleaved; the median is "
                        "reported, default 3")
    p.add_argument("--algo", action="append", default=[],
                   help="algorithm(s), comma-separated or repeated: names from --list, "
                        "'auto' (the selector's choice, default) or 'all'")
    p.add_argument("--dtype", default="float32", help="element type, default float32")
    p.add_argument("--op", dest="reduce_op", default="sum", help="reduction: sum max min prod")
    p.add_argument("--root", type=int, default=0, help="root of broadcast / one_to_many")
    p.add_argument("--group", default="world", choices=["world", "intra_node", "rail"],
                   help="process group to run on, default world")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="write every row as JSON; with several ops, a file each: FILE names "
                        "it with {op} (e.g. 'bench_{op}.json')")
    p.add_argument("--calibrate", default=None, metavar="FILE",
                   help="write (or update) a calibration file for NEOCOMM_CALIBRATION: "
                        "measured / modelled time of each algorithm")
    p.add_argument("--prepared", action="store_true",
                   help="run our algorithms as prepared (persistent) collectives, "
                        "collectives.prepare_*: validated once, then only run; the mpi peer "
                        "stays the plain blocking call")
    p.add_argument("--bare", action="store_true",
                   help="time the bare collective, argument agreement and checks off (as "
                        "nccl-tests does); by default the call a user makes is timed, "
                        "agreement and checks included")
    p.add_argument("-R", "--symmetric", action="store_true",
                   help="allocate the buffers as symmetric memory (collectives.symmetric), "
                        "for every algorithm and the MPI peer alike (as nccl-tests' -R "
                        "registers them)")
    p.add_argument("--device", action="store_true",
                   help="buffers are CuPy arrays on the rank's GPU: the collectives run over "
                        "the device backend (NCCL) and the peer is its own collective "
                        "('native') instead of the MPI host call; needs CuPy and CUDA")
    p.add_argument("--list", action="store_true", help="list the algorithms of every op")


def _list() -> int:
    from collectives.algorithms import names
    from collectives.types import CollectiveOp

    for op in CollectiveOp:
        print(f"{op.value:15s} {' '.join(names(op))}")
    return 0


def run(args) -> int:
    if args.list:
        return _list()
    if not args.op:
        print("neocomm bench: an op is required (or --list)", file=sys.stderr)
        return 2
    try:
        ops = _ops(args.op)
    except ValueError as exc:
        print(f"neocomm bench: {exc}", file=sys.stderr)
        return 2
    if args.json and len(ops) > 1 and "{op}" not in args.json:
        print(f"neocomm bench: --json {args.json}: {len(ops)} ops write a file each; name "
              f"it with {{op}} (e.g. bench_{{op}}.json)", file=sys.stderr)
        return 2
    for name, value, low in (("-n", args.iters, 1), ("-w", args.warmup_iters, 0),
                             ("-c", args.check, 0), ("-r", args.repeat, 1)):
        if value < low:
            print(f"neocomm bench: {name}: expected >= {low}, got {value}", file=sys.stderr)
            return 2
    if args.device and args.calibrate:
        print("neocomm bench: --calibrate: calibrates the host fabric; not with --device",
              file=sys.stderr)
        return 2
    import dataclasses

    import neocomm
    from collectives.bench import (BenchConfig, bench_algos, peak_rss_bytes, run_bench,
                                   staging_high_water)

    world = neocomm.init()
    group = getattr(world, args.group)
    if args.device:
        why = _device_unusable()
        from mpi4py import MPI

        if not group.comm.allreduce(why is None, op=MPI.LAND):  # agreed: all stop together
            if why is not None:
                print(f"neocomm bench: --device: rank {group.rank}: {why}", file=sys.stderr)
            return 2
    algos = tuple(a.strip() for item in (args.algo or ["auto"]) for a in item.split(",")
                  if a.strip())
    base = BenchConfig(op=ops[0], min_bytes=args.minbytes, max_bytes=args.maxbytes,
                       factor=args.stepfactor, iters=args.iters, warmup=args.warmup_iters,
                       check=args.check, repeat=args.repeat, algos=algos, dtype=args.dtype,
                       reduce_op=args.reduce_op, root=args.root, symmetric=args.symmetric,
                       prepared=args.prepared, device=args.device)
    cfgs = [dataclasses.replace(base, op=op) for op in ops]
    lead = group.rank == 0
    try:  # every op's options are checked before the first one runs
        for cfg in cfgs:
            bench_algos(cfg, group)
    except ValueError as exc:
        if lead:
            print(f"neocomm bench: {exc}", file=sys.stderr)
        return 2
    from collectives.state import state_of

    state = state_of(group)
    checked = state.check
    wrong = 0
    for cfg in cfgs:
        printer = _Printer(cfg, group, world, args.bare) if lead else None
        state.check = checked and not args.bare  # (plans made either way are redone)
        try:
            rows = run_bench(cfg, group, on_row=printer.row if printer else None)
        except (ValueError, TypeError) as exc:
            if lead:
                print(f"neocomm bench: {exc}", file=sys.stderr)
            return 2
        finally:
            state.check = checked
        rss, staging = peak_rss_bytes(group), staging_high_water(group)
        wrong += sum(r.wrong for r in rows)
        if lead:
            printer.footer(rows, rss, staging)
            if args.json:
                _write_json(args.json.replace("{op}", cfg.op.value), cfg, group, world, rows,
                            rss, staging, args.bare)
        if args.calibrate:
            _calibrate(args.calibrate, cfg, group, rows, lead)
    return 1 if wrong else 0


def _ops(given: list[str]) -> list:
    """The ops named on the command line, in their order, each once; ``all`` is every op."""
    from collectives.types import CollectiveOp

    ops: list = []
    for name in given:
        try:
            named = list(CollectiveOp) if name == "all" else [CollectiveOp.parse(name)]
        except ValueError as exc:
            raise ValueError(f"{exc} (or 'all')") from None
        for op in named:
            if op not in ops:
                ops.append(op)
    return ops


def _device_unusable() -> str | None:
    """Why ``--device`` cannot run on this rank (no CuPy, no CUDA device), or None."""
    try:
        import cupy
    except ImportError as exc:
        return f"needs CuPy (pip install -e '.[gpu]'): {exc}"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "needs a CUDA device; CuPy sees none"
    except Exception as exc:  # noqa: BLE001 - no driver, no runtime
        return f"needs a usable CUDA runtime: {exc}"
    return None


def overheads(rows, peer: str) -> dict:
    """``{algorithm: seconds}`` each algorithm's call takes beyond the peer's at the smallest
    size (the per-call overhead, where the bytes cost least)."""
    if not rows:
        return {}
    small = min(r.size for r in rows)
    at = {r.algo: r.time for r in rows if r.size == small}
    base = at.get(peer)
    return {} if base is None else {a: t - base for a, t in at.items() if a != peer}


class _Printer:
    def __init__(self, cfg, group, world, bare: bool = False):
        from collectives.bench import peer_name

        self.cfg = cfg
        self.peer = peer_name(cfg)
        self.algos = None
        layout = f"{group.num_nodes} node(s) x {group.ranks_per_node or 'uneven'}"
        print(f"# neocomm bench {cfg.op.value}: {group.size} ranks ({layout}), "
              f"{cfg.dtype}, {cfg.reduce_op}, {cfg.iters} iters, {cfg.warmup} warm-up, "
              f"{cfg.repeat} rounds (median), {cfg.check} checked"
              + (", symmetric buffers" if cfg.symmetric else "")
              + (", device buffers (peer: the backend's native collective)"
                 if cfg.device else "")
              + ("; bare calls (--bare: no agreement, no checks)" if bare else
                 "; the calls a user makes (agreement and checks on; --bare: off)"),
              flush=True)

    def row(self, rows) -> None:
        if self.algos is None:
            self.algos = [r.algo for r in rows]
            peer = self.peer
            head1 = f"# {'':>11} {'':>11} " + " ".join(
                f"{(a if a != peer else peer + ' (peer)'):^{43 if a == peer else 50}}"
                for a in self.algos)
            cols = ["time(us)", "algbw", "busbw", "#wrong"]
            head2 = f"# {'size':>11} {'count':>11} " + " ".join(
                " ".join(f"{c:>10}" for c in cols + ([] if a == peer else ["ratio"]))
                [:(43 if a == peer else 54)] for a in self.algos)
            print(head1)
            print(head2, flush=True)
            if self.cfg.prepared:
                print("# ours: prepared collectives (validated once, then run); mpi: the "
                      "plain blocking call", flush=True)
        cells = []
        for r in rows:
            text = f"{r.time * 1e6:10.1f} {r.algbw:10.3f} {r.busbw:10.3f} {r.wrong:10d}"
            if r.algo != self.peer:
                text += f" {r.ratio:10.2f}" if r.ratio else f" {'n/a':>10}"
            cells.append(text)
        print(f"  {rows[0].size:>11d} {rows[0].count:>11d} " + " ".join(cells), flush=True)

    def footer(self, rows, rss, staging) -> None:
        by_algo: dict = {}
        for r in rows:
            by_algo.setdefault(r.algo, []).append(r)
        for algo, rs in by_algo.items():
            bw = statistics.fmean(r.busbw for r in rs)
            line = f"# {algo:>14}: avg busbw {bw:.3f} GB/s"
            ratios = [r.ratio for r in rs if r.ratio]
            if ratios:
                line += (f", ratio vs {self.peer} min {min(ratios):.2f} max {max(ratios):.2f}")
            chosen = sorted({r.chosen for r in rs if r.chosen and r.chosen != r.algo})
            if chosen:
                line += f" (ran {', '.join(chosen)})"
            print(line)
        extra = overheads(rows, self.peer)
        if extra:
            small = min(r.size for r in rows)
            print(f"# per-call overhead at {small} bytes, beyond {self.peer}: " + ", ".join(
                f"{a} {t * 1e6:+.1f} us" for a, t in extra.items()))
        print(f"# wrong elements: {sum(r.wrong for r in rows)}; peak RSS {rss / MIB:.1f} "
              f"MiB; staging high-water {staging / MIB:.2f} MiB", flush=True)


def _write_json(path, cfg, group, world, rows, rss, staging, bare: bool = False) -> None:
    from collectives import settings
    from collectives.bench import peer_name
    from collectives.fabric import fabric_for

    data = {"kind": "neocomm-bench", "op": cfg.op.value, "ranks": group.size,
            "nodes": group.num_nodes, "ranks_per_node": group.ranks_per_node,
            "group": group.name, "dtype": cfg.dtype, "reduce_op": cfg.reduce_op,
            "iters": cfg.iters, "warmup": cfg.warmup, "repeat": cfg.repeat,
            "check": cfg.check, "symmetric": cfg.symmetric, "prepared": cfg.prepared,
            "device": cfg.device, "peer": peer_name(cfg), "bare": bare,
            "overhead_us": {a: t * 1e6 for a, t in overheads(rows, peer_name(cfg)).items()},
            "host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "settings": {k: v for k, v in vars(settings.current()).items()},
            "fabric_source": fabric_for(group).source,
            "fabric_links": {"intra": fabric_for(group).intra.kind,
                             "inter": fabric_for(group).inter.kind},
            "peak_rss_bytes": rss, "staging_high_water_bytes": staging,
            "rows": [r.to_dict() for r in rows]}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, default=str)
        fh.write("\n")


def _calibrate(path, cfg, group, rows, lead) -> None:
    """Per algorithm: median of measured / modelled time over the sweep."""
    from dataclasses import replace

    from collectives import cost
    from collectives.fabric import fabric_for, load_calibration, save_calibration
    from collectives.simulate import bench_request
    from collectives.types import SYMMETRIC_RECV, SYMMETRIC_SEND

    fabric = fabric_for(group)
    bare = replace(fabric, algorithm_factors=())
    factors = {}
    if os.path.exists(path):
        factors.update(load_calibration(path).get("algorithm_factors", {}))
    by_algo: dict = {}
    # the symmetric bits the calls had (AllReduce also reads the peers' outputs)
    sym = 0 if not cfg.symmetric else SYMMETRIC_SEND | (
        SYMMETRIC_RECV if cfg.op.value == "all_reduce" else 0)
    for r in rows:
        name = r.chosen if r.algo == "auto" else r.algo
        if name in ("mpi", "auto") or name not in cost.candidates(cfg.op):
            continue
        item = 2 if cfg.dtype in ("float16", "bfloat16") else \
            int(__import__("numpy").dtype(cfg.dtype).itemsize)
        req = bench_request(cfg.op, r.size, item, group.size, root=cfg.root, symmetric=sym)
        model = cost.algorithm_cost(cfg.op, name, req, bare)
        if 0 < model < float("inf"):
            by_algo.setdefault(name, []).append(r.time / model)
            bucket = f"{cfg.op.value}/{name}@{r.size.bit_length() - 1}"
            factors[bucket] = round(r.time / model, 4)
    for name, values in by_algo.items():
        factors[f"{cfg.op.value}/{name}"] = round(statistics.median(values), 4)
    if lead:
        save_calibration(path, bare, factors,
                         f"neocomm bench --calibrate on {socket.gethostname()} "
                         f"({group.size} ranks, {time.strftime('%Y-%m-%d')})")
        print(f"# calibration written to {path}: " + ", ".join(
            f"{k}={v}" for k, v in sorted(factors.items())
            if k.startswith(cfg.op.value) and "@" not in k))
