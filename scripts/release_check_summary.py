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

    print(f"# {'name':<16} {'bytes':>12} {'rows/ranks':>10} {'time(us)':>11} {'GB/s':>9} "
          f"{'peer GB/s':>10} {'ratio':>7} {'#wrong':>7}")
    for c in collectives:
        ratio = f"{c['ratio']:7.2f}" if c["ratio"] else f"{'n/a':>7}"
        peer = f"{c['peer_busbw']:10.3f}" if c["peer_busbw"] is not None else f"{'n/a':>10}"
        print(f"  {c['op']:<16} {c['size']:>12d} {c['ranks']:>10d} {c['time'] * 1e6:11.1f} "
              f"{c['busbw']:9.3f} {peer} {ratio} {c['wrong']:>7d}")
    for k in kernels:
        ratio = f"{k['ratio']:7.2f}" if k["ratio"] is not None else f"{'n/a':>7}"
        print(f"  {k['name']:<16} {k['bytes']:>12d} {k['rows']:>10d} {k['time'] * 1e6:11.1f} "
              f"{k['gbps']:9.3f} {k['memcpy_gbps']:10.3f} {ratio} {'-':>7}")
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
