#!/usr/bin/env python
"""Gather the GPU release check's results into one table and one JSON file.

Called by ``scripts/gpu_release_check.sh`` as ``release_check_summary.py DIR``:
reads ``DIR/bench_<op>.json`` (``neocomm bench --device --json``),
``DIR/kernels.json`` (``bench_device_kernels.py --json``), ``DIR/device.json``
and ``DIR/steps.tsv`` (step name, exit status), prints one table and writes
``DIR/release_check.json``. Per collective: the largest size's row of our
``auto`` choice with the peer's (``native``) busbw next to it, and ``#wrong``
summed over every size and algorithm. Exits 1 when a step failed, naming it.
"""
from __future__ import annotations

import glob
import json
import os
import sys


def _load(path):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def header(name: str, count: str, peer: str, wrong: bool = False) -> str:
    """The column line of the release check's tables (and of the kernel benchmark's)."""
    return (f"# {name:<16} {'bytes':>12} {count:>10} {'time(us)':>11} {'GB/s':>9} "
            f"{peer:>12} {'ratio':>7}" + (f" {'#wrong':>7}" if wrong else ""))


def row(name, nbytes, count, seconds, gbps, peer_gbps, ratio, wrong=None) -> str:
    """One table row; a missing peer figure or ratio shows as n/a."""
    peer = f"{peer_gbps:12.3f}" if peer_gbps is not None else f"{'n/a':>12}"
    shown = f"{ratio:7.2f}" if ratio else f"{'n/a':>7}"
    tail = "" if wrong is None else f" {wrong:>7}"
    return (f"  {name:<16} {int(nbytes):>12d} {int(count):>10d} {seconds * 1e6:11.1f} "
            f"{gbps:9.3f} {peer} {shown}{tail}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: release_check_summary.py DIR", file=sys.stderr)
        return 2
    out = argv[0]
    steps = []
    if os.path.exists(os.path.join(out, "steps.tsv")):
        with open(os.path.join(out, "steps.tsv"), encoding="utf-8") as fh:
            for line in fh:
                name, rc = line.rstrip("\n").split("\t")
                steps.append({"step": name, "rc": int(rc)})
    collectives = []
    for path in sorted(glob.glob(os.path.join(out, "bench_*.json"))):
        data = _load(path)
        if not data or not data.get("rows"):
            continue
        rows, peer = data["rows"], data.get("peer", "native")
        top = max(r["size"] for r in rows)
        ours = [r for r in rows if r["size"] == top and r["algo"] != peer] or \
            [r for r in rows if r["size"] == top]
        peer_row = next((r for r in rows if r["size"] == top and r["algo"] == peer), None)
        collectives.append({
            "op": data["op"], "ranks": data["ranks"], "size": top, "algo": ours[0]["algo"],
            "chosen": ours[0].get("chosen", ""), "time": ours[0]["time"],
            "algbw": ours[0]["algbw"], "busbw": ours[0]["busbw"],
            "peer": peer, "peer_busbw": peer_row["busbw"] if peer_row else None,
            "ratio": ours[0].get("ratio"), "wrong": sum(r["wrong"] for r in rows),
            "file": os.path.basename(path)})
    kernels = (_load(os.path.join(out, "kernels.json")) or {}).get("rows", [])
    failed = [s["step"] for s in steps if s["rc"] != 0]
    summary = {"kind": "neocomm-gpu-release-check",
               "device": _load(os.path.join(out, "device.json")),
               "steps": steps, "failed": failed, "collectives": collectives,
               "kernels": kernels}
    with open(os.path.join(out, "release_check.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
        fh.write("\n")

    print(header("name", "rows/ranks", "peer GB/s", wrong=True))
    for c in collectives:
        print(row(c["op"], c["size"], c["ranks"], c["time"], c["busbw"], c["peer_busbw"],
                  c["ratio"], c["wrong"]))
    for k in kernels:
        print(row(k["name"], k["bytes"], k["rows"], k["time"], k["gbps"], k["memcpy_gbps"],
                  k["ratio"], "-"))
    print("# collectives: GB/s is busbw of our 'auto' at the largest size, peer is the "
          "backend's native collective (NCCL); kernels: peer is a device memcpy of the same "
          "bytes")
    print(f"# results: {os.path.join(out, 'release_check.json')}")
    if failed:
        print(f"release check FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("release check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
