#!/usr/bin/env python
"""Throughput of the embedding CUDA kernels against a device memcpy of the same bytes.

One process, the current CUDA device (CuPy)::

    python scripts/bench_device_kernels.py --json kernels.json
    python scripts/bench_device_kernels.py --quick          # tiny sizes, seconds

Kernels, through ``FusedTables(device="cuda")`` (row-wise AdaGrad):

- ``pooled_lookup``: reads ``ids * dim`` weight elements and writes the
  ``[batch, tables * dim]`` output; its bytes are those two together.
- ``backward_update``: reads the output gradient once per id
  (``ids * dim`` elements), reads and writes each unique row's weights and
  its optimizer state; its bytes are those together (the least it must touch).

The peer, ``memcpy``, is a CuPy device-to-device copy of the same number of
bytes (``dst[...] = src`` on a byte buffer), timed the same way. Each
timing synchronises the current stream before the clock starts and before
it is read; the median of ``--repeat`` rounds of ``--iters`` calls counts.
``GB/s = bytes / time / 1e9`` (bytes counted once, as cudaMemcpy bandwidth
is); ``ratio`` is the kernel's GB/s over memcpy's (1: as fast as a copy).
On the device stand-in (``tests/devsim``) the numbers describe a CPU and
mean nothing; only a real GPU gives figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

__all__ = ["run", "main"]


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise SystemExit(f"bench_device_kernels: needs CuPy (pip install -e '.[gpu]'): {exc}")
    return cupy


def _timed(cp, fn, iters: int, warmup: int, repeat: int) -> float:
    """Median seconds per call; the stream is synchronised around every timed round."""
    stream = cp.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    rounds = []
    for _ in range(repeat):
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        stream.synchronize()
        rounds.append((time.perf_counter() - t0) / iters)
    return statistics.median(rounds)


def _memcpy(cp, nbytes: int, iters: int, warmup: int, repeat: int) -> float:
    src = cp.ones(nbytes, cp.uint8)
    dst = cp.empty_like(src)

    def copy():
        dst[...] = src

    return _timed(cp, copy, iters, warmup, repeat)


def _row(name, nbytes, rows, seconds, memcpy_seconds) -> dict:
    gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    mgbps = nbytes / memcpy_seconds / 1e9 if memcpy_seconds > 0 else 0.0
    return {"name": name, "bytes": int(nbytes), "rows": int(rows), "time": seconds,
            "gbps": gbps, "memcpy_time": memcpy_seconds, "memcpy_gbps": mgbps,
            "ratio": gbps / mgbps if mgbps > 0 else None}


def run(args) -> list[dict]:
    """Measure both kernels and their memcpy peers; one row each."""
    from embedding.kernels import Bags, FusedTables
    from embedding.types import OptimizerConfig, OptimizerKind

    cp = _cupy()
    tables, rows, dim, batch, per_bag = args.tables, args.rows, args.dim, args.batch, \
        args.ids_per_bag
    timing = (args.iters, args.warmup, args.repeat)
    rng = np.random.default_rng(0)
    fused = FusedTables([rows] * tables, [dim] * tables,
                        OptimizerConfig(OptimizerKind.ROWWISE_ADAGRAD, lr=0.01),
                        device="cuda")
    fused.weights[:] = cp.asarray(
        ((rng.random(fused.weights.size, dtype=np.float32) - 0.5) * 0.02))
    ids = rng.integers(0, rows, tables * batch * per_bag).astype(np.int64)
    offsets = np.arange(0, ids.size + 1, per_bag, dtype=np.int64)
    bags = Bags(cp.asarray(ids), cp.asarray(offsets), tuple(range(tables)),
                tuple(range(0, tables * dim, dim)), (False,) * tables, batch, tables * dim)
    item = fused.dtype.itemsize
    out = cp.empty((batch, tables * dim), fused.dtype)
    grad = cp.asarray(rng.standard_normal((batch, tables * dim), dtype=np.float32))

    lookup_bytes = ids.size * dim * item + out.size * item
    t = _timed(cp, lambda: fused.lookup(bags, out=out), *timing)
    results = [_row("pooled_lookup", lookup_bytes, ids.size, t,
                    _memcpy(cp, lookup_bytes, *timing))]

    unique = sum(np.unique(ids[k * batch * per_bag:(k + 1) * batch * per_bag]).size
                 for k in range(tables))
    state_item = sum(a.dtype.itemsize for a in fused.state.values())  # per-row state
    backward_bytes = ids.size * dim * item + 2 * unique * (dim * item + state_item)
    t = _timed(cp, lambda: fused.backward_update(bags, grad), *timing)
    results.append(_row("backward_update", backward_bytes, unique, t,
                        _memcpy(cp, backward_bytes, *timing)))
    return results


def _print(results) -> None:
    from release_check_summary import header, row  # beside this script

    print(header("kernel", "rows", "memcpy GB/s"))
    for r in results:
        print(row(r["name"], r["bytes"], r["rows"], r["time"], r["gbps"], r["memcpy_gbps"],
                  r["ratio"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table, default 1M")
    p.add_argument("--dim", type=int, default=128, help="embedding dim, default 128")
    p.add_argument("--batch", type=int, default=8192, help="bags per table, default 8192")
    p.add_argument("--ids-per-bag", type=int, default=32, help="ids per bag, default 32")
    p.add_argument("--iters", type=int, default=20, help="timed calls per round, default 20")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls, default 3")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds (median), default 3")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and few iterations (a smoke test, seconds)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.tables, args.rows, args.dim, args.batch, args.ids_per_bag = 2, 1000, 16, 64, 4
        args.iters, args.warmup, args.repeat = 2, 1, 1
    for name in ("tables", "rows", "dim", "batch", "ids_per_bag", "iters", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    results = run(args)
    _print(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"kind": "neocomm-device-kernels", "config": vars(args),
                       "rows": results}, fh, indent=1)
            fh.write("\n")
    bad = [r["name"] for r in results if not r["gbps"] > 0]
    if bad:
        print(f"bench_device_kernels: no throughput measured for {', '.join(bad)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
