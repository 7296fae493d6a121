#!/usr/bin/env python3
"""Plot and tabulate ``neocomm bench --json`` files: bus bandwidth against size.

    python scripts/plot_bench.py out/all_reduce-n2.json out/all_reduce-n4.json -o ar.png
    python scripts/plot_bench.py out/*.json --markdown      # tables for the docs

One line per (file, algorithm); the native MPI peer is dashed. Needs
matplotlib for the picture (``pip install neocomm[plot]``); ``--markdown``
prints the tables without it.
"""
from __future__ import annotations

import argparse
import json
import sys

from topology.sizes import format_size

__all__ = ["load", "plot", "markdown", "compact"]


def load(path: str) -> dict:
    """A bench JSON file; ValueError naming the file when it is not one."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if data.get("kind") != "neocomm-bench":
        raise ValueError(f"{path}: not a `neocomm bench --json` file")
    return data


def plot(runs: list[dict], out: str, title: str | None = None) -> bool:
    """Write a PNG of busbw against size; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_bench: matplotlib is not installed (pip install matplotlib); "
              "no picture written", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = [plt.cm.tab10(i % 10) for i in range(10)] + \
        [plt.cm.tab20b(i % 20) for i in range(20)]
    k = 0
    for run in runs:
        algos = []
        for row in run["rows"]:
            if row["algo"] not in algos:
                algos.append(row["algo"])
        paired = len(algos) == 2  # MPI and one algorithm: one colour, MPI dashed
        for algo in algos:
            rows = [r for r in run["rows"] if r["algo"] == algo]
            label = f"{run['op']} n={run['ranks']}: {algo}"
            if algo == "mpi":
                label += " (native MPI)"
            ax.plot([r["size"] for r in rows], [r["busbw"] for r in rows],
                    linestyle="--" if algo == "mpi" else "-", marker="o", markersize=3,
                    label=label, color=colors[k % len(colors)])
            if not paired or algo != "mpi":
                k += 1
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes per rank)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title or ", ".join(sorted({r["op"] for r in runs})))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def compact(run: dict) -> str:
    """A narrower table: MPI time and busbw, then each algorithm's busbw and
    ratio against MPI (above 1: faster), and what ``auto`` ran."""
    algos = []
    for row in run["rows"]:
        if row["algo"] not in algos:
            algos.append(row["algo"])
    ran = "auto" in algos and any(r.get("chosen") not in (None, "", "auto")
                                  for r in run["rows"] if r["algo"] == "auto")
    head = ["size", "mpi us", "mpi GB/s"] + [f"{a} GB/s (x mpi)" for a in algos
                                             if a != "mpi"] + (["auto ran"] if ran else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in sorted({r["size"] for r in run["rows"]}):
        by = {r["algo"]: r for r in run["rows"] if r["size"] == size}
        cells = [format_size(size), f"{by['mpi']['time'] * 1e6:.0f}", f"{by['mpi']['busbw']:.2f}"]
        for a in algos:
            if a != "mpi":
                ratio = by[a].get("ratio")
                cells.append(f"{by[a]['busbw']:.2f} ({ratio:.2f})" if ratio else
                             f"{by[a]['busbw']:.2f}")
        if ran:
            cells.append(by["auto"].get("chosen", ""))
        lines.append("| " + " | ".join(cells) + " |")
    wrong = sum(r["wrong"] for r in run["rows"])
    lines.append("")
    lines.append(f"{run['op']}, {run['ranks']} ranks: busbw in GB/s, median of "
                 f"{run['repeat']} rounds of {run['iters']} iterations; #wrong {wrong}.")
    return "\n".join(lines)


def markdown(run: dict) -> str:
    """A markdown table of one run: per size, time and busbw of each algorithm and
    its ratio against the MPI peer."""
    algos = []
    for row in run["rows"]:
        if row["algo"] not in algos:
            algos.append(row["algo"])
    ran = "auto" in algos and any(r.get("chosen") not in (None, "", "auto")
                                  for r in run["rows"] if r["algo"] == "auto")
    head = ["size"] + [f"{a} us" for a in algos] + [f"{a} busbw" for a in algos] + \
        [f"{a} / mpi" for a in algos if a != "mpi"] + (["auto ran"] if ran else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    sizes = sorted({r["size"] for r in run["rows"]})
    for size in sizes:
        by = {r["algo"]: r for r in run["rows"] if r["size"] == size}
        cells = [format_size(size)]
        cells += [f"{by[a]['time'] * 1e6:.0f}" for a in algos]
        cells += [f"{by[a]['busbw']:.2f}" for a in algos]
        cells += [f"{by[a]['ratio']:.2f}" if by[a].get("ratio") else "-" for a in algos
                  if a != "mpi"]
        if ran:
            cells.append(by["auto"].get("chosen", ""))
        lines.append("| " + " | ".join(cells) + " |")
    wrong = sum(r["wrong"] for r in run["rows"])
    lines.append("")
    lines.append(f"{run['op']}, {run['ranks']} ranks ({run['nodes']} node(s)), {run['dtype']},"
                 f" {run['iters']} iterations x {run['repeat']} rounds (median), "
                 f"#wrong {wrong}, peak RSS {run['peak_rss_bytes'] / 2**20:.0f} MiB, "
                 f"staging high-water {run['staging_high_water_bytes'] / 2**20:.1f} MiB.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="neocomm bench --json files")
    p.add_argument("-o", "--output", default=None, help="PNG to write")
    p.add_argument("--title", default=None)
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.add_argument("--compact", action="store_true", help="print narrower markdown tables")
    args = p.parse_args(argv)
    try:
        runs = [load(f) for f in args.files]
    except (OSError, ValueError) as exc:
        print(f"plot_bench: {exc}", file=sys.stderr)
        return 2
    if args.markdown or args.compact:
        for run in runs:
            print(compact(run) if args.compact else markdown(run))
            print()
    if args.output:
        plot(runs, args.output, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
