"""Measure collectives between hosts joined by TCP: the test cluster's hosts (network
namespaces on this machine, ``tests/cluster/testcluster.py``), their links shaped to a rate.

Builds the cluster (root, Linux), runs ``neocomm bench OP --json`` under ``neocomm run
--hostfile`` for each operation, ``--launches`` times over (every operation once, then
again), and writes the runs as one measurements file (each call's median over the
launches and every launch's time), the file ``neocomm simulate calibrate --bench`` and
``neocomm simulate validate --bench`` read::

    python scripts/bench_tcp_cluster.py --rate 1gbit --layout 2x1 -o cal.json
    neocomm simulate calibrate --fabric tcp.toml --bench cal.json -o fitted.toml
    python scripts/bench_tcp_cluster.py --rate 1gbit --layout 2x1 -o val.json   # later
    neocomm simulate validate --fabric fitted.toml --bench val.json

``tc`` shapes the links' rate (a token bucket at both ends of each host's link); it
cannot add delay here (the kernel has no netem), so the links' latency is the kernel's.

``--config RATE,LAYOUT,MAXBYTES[,OPS]`` (repeatable) measures several rates and layouts in
one run on one cluster (as many hosts as the largest layout, the links reshaped between
configurations), each written to ``-o`` with ``{rate}`` and ``{layout}`` filled in::

    python scripts/bench_tcp_cluster.py --config 1gbit,2x1,64M --config 1gbit,3x1,16M \
        -o 'cal-{rate}-{layout}.json'

``--step FABRIC`` validates the training step there instead: ``neocomm simulate validate
--step --fabric FABRIC --hostfile`` at each configuration's rate and layout, typed on the
first host; ``-o`` is then the training runs it records (``--record``), which ``neocomm
simulate validate --step --fabric FABRIC --bench FILE`` reprints::

    python scripts/bench_tcp_cluster.py --step fitted.toml --config 1gbit,2x1,0 \
        --config 1gbit,2x2,0 --config 1gbit,3x1,0 -o 'step-{rate}-{layout}.json'

The machine's 1-minute load average is read before the run (``--wait-load``: wait, a
minute at a time and at most ``--wait-max`` seconds, for it to fall to that) and before
every bench, and written with each run (``loadavg_1m``): the hosts share this machine's
cores with whatever else runs on it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))
sys.path.insert(0, ROOT)

from testcluster import TestCluster, why_unavailable  # noqa: E402

NAMES = ("node-a", "node-b", "node-c", "node-d")


def loadavg() -> float:
    """The machine's 1-minute load average (0.0 where it cannot be read)."""
    try:
        with open("/proc/loadavg") as fh:
            return float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def wait_for_load(limit: float, most: float, echo=print) -> float:
    """Wait, a minute at a time and at most ``most`` seconds, for the 1-minute load average
    to fall to ``limit``; the load average it goes ahead under."""
    waited, load = 0.0, loadavg()
    while load > limit and waited < most:
        echo(f"# load average {load:.2f} > {limit}: waiting 60 s ({waited:.0f} s so far)")
        time.sleep(60)
        waited += 60
        load = loadavg()
    echo(f"# measuring under a 1-minute load average of {load:.2f}")
    return load


def measure(rate: str, hosts: int, per_host: int, ops: list[str], *, minbytes: str,
            maxbytes: str, factor: str, launches: int, iters: int, rounds: int,
            echo=print, cluster=None) -> list[dict]:
    """The bench runs of ``ops`` on ``hosts`` hosts x ``per_host`` ranks over links of
    ``rate`` (``None``: unshaped), ``launches`` times, merged per measurement; on
    ``cluster`` (its links reshaped to ``rate``) when given, else on one built for it."""
    if cluster is not None:
        if rate and cluster.rate != rate:
            cluster.shape(rate)
        return _measure(cluster, hosts, per_host, ops, minbytes=minbytes, maxbytes=maxbytes,
                        factor=factor, launches=launches, iters=iters, rounds=rounds,
                        echo=echo)
    why = why_unavailable()
    if why:
        raise SystemExit(f"bench_tcp_cluster: cannot build the cluster: {why}")
    with TestCluster(list(NAMES[:hosts]), rate=rate) as built:
        return _measure(built, hosts, per_host, ops, minbytes=minbytes, maxbytes=maxbytes,
                        factor=factor, launches=launches, iters=iters, rounds=rounds,
                        echo=echo)


def _measure(cluster, hosts, per_host, ops, *, minbytes, maxbytes, factor, launches, iters,
             rounds, echo) -> list[dict]:
    from collectives.calibrate import median_of_launches

    runs = []
    hostfile = cluster.hostfile({n: per_host for n in NAMES[:hosts]})
    # a first, unrecorded call on the (re)shaped links: a host's first connections to a
    # peer start from nothing the kernel has cached about the path, later ones do not
    warm = ["neocomm", "run", "-n", str(hosts * per_host), "--hostfile", hostfile, "--",
            "neocomm", "bench", "all_reduce", "-b", "1M", "-e", "4M", "-f", "4", "-n", "1",
            "-w", "1", "-r", "1"]
    echo("# warm-up: " + " ".join(warm))
    done = cluster.run(NAMES[0], warm, cwd=ROOT, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"bench_tcp_cluster: {' '.join(warm)} exited {done.returncode}\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    for launch in range(launches):
        for op in ops:
            path = os.path.join(cluster.workdir, f"{op}-{launch}.json")
            argv = ["neocomm", "run", "-n", str(hosts * per_host), "--hostfile", hostfile,
                    "--", "neocomm", "bench", op, "-b", minbytes, "-e", maxbytes, "-f",
                    factor, "-n", str(iters), "-w", "1", "-r", str(rounds), "--json",
                    path]
            load = loadavg()
            echo(f"# [load {load:.2f}] " + " ".join(argv))
            began = time.monotonic()
            done = cluster.run(NAMES[0], argv, cwd=ROOT, timeout=600)
            if done.returncode != 0:
                raise SystemExit(f"bench_tcp_cluster: {' '.join(argv)} exited "
                                 f"{done.returncode}\n{done.stdout[-3000:]}\n"
                                 f"{done.stderr[-3000:]}")
            echo(f"#   {time.monotonic() - began:.1f} s")
            with open(path) as fh:
                run = json.load(fh)
            run["loadavg_1m"] = [load]
            runs.append(run)
    merged = median_of_launches(runs)
    for run in merged:  # every launch's load, in the order of the launches
        run["loadavg_1m"] = [r["loadavg_1m"][0] for r in runs if r["op"] == run["op"]]
    return merged


def validate_step(cluster, rate: str | None, hosts: int, per_host: int, fabric: str, *,
                  steps: int, launches: int, echo=print) -> tuple[int, str, dict]:
    """``neocomm simulate validate --step`` of ``fabric`` at ``hosts`` x ``per_host`` over
    links of ``rate``, typed on the first host: its exit status, output and recorded runs."""
    import shutil

    if rate and cluster.rate != rate:
        cluster.shape(rate)
    here = os.path.join(cluster.workdir, os.path.basename(fabric))
    if os.path.abspath(fabric) != here:
        shutil.copy(fabric, here)
    hostfile = cluster.hostfile({n: per_host for n in NAMES[:hosts]}, name="hosts-step")
    record = os.path.join(cluster.workdir, f"step-{hosts}x{per_host}.json")
    argv = ["neocomm", "simulate", "validate", "--step", "--fabric", here, "--hostfile",
            hostfile, "--ranks", str(hosts * per_host), "--nodes", str(hosts), "--steps",
            str(steps), "--launches", str(launches), "--record", record]
    echo(f"# [load {loadavg():.2f}] " + " ".join(argv))
    began = time.monotonic()
    done = cluster.run(NAMES[0], argv, cwd=ROOT, timeout=1800)
    echo(f"#   {time.monotonic() - began:.1f} s")
    if done.returncode not in (0, 1) or not os.path.exists(record):
        raise SystemExit(f"bench_tcp_cluster: {' '.join(argv)} exited {done.returncode}\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(record) as fh:
        return done.returncode, done.stdout, json.load(fh)


def _gbps(rate: str) -> float:
    """Gb/s of a tc rate (``500mbit``, ``1gbit``, ``5gbit``)."""
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        if rate.lower().endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise SystemExit(f"bench_tcp_cluster: --rate {rate!r}: expected a tc rate like 1gbit")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit",
                   help="tc rate of every host's link (e.g. 500mbit, 1gbit, 5gbit), or "
                   "'none' for unshaped links; default 1gbit")
    p.add_argument("--layout", default="2x1", help="HOSTSxRANKS, default 2x1")
    p.add_argument("--ops", default="all_reduce,all_to_all", help="collectives, comma-separated")
    p.add_argument("-b", "--minbytes", default="1M")
    p.add_argument("-e", "--maxbytes", default="16M")
    p.add_argument("-f", "--stepfactor", default="4")
    p.add_argument("--launches", type=int, default=2)
    p.add_argument("--iters", type=int, default=1, help="timed iterations per round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (their median)")
    p.add_argument("--config", action="append", default=[],
                   help="RATE,LAYOUT,MAXBYTES[,OPS] (OPS joined by +), repeatable: several "
                   "configurations in one run, on one cluster; -o then names each file with "
                   "{rate} and {layout}")
    p.add_argument("--wait-load", type=float, default=2.0,
                   help="before the run, wait for the 1-minute load average to fall to this "
                   "(default 2.0)")
    p.add_argument("--wait-max", type=float, default=600.0,
                   help="wait at most this many seconds for it (default 600), then go ahead")
    p.add_argument("--step", metavar="FABRIC", default=None,
                   help="validate the training step of this calibrated fabric at each "
                   "configuration instead (neocomm simulate validate --step --hostfile); -o: "
                   "the training runs it records")
    p.add_argument("--steps", type=int, default=100,
                   help="with --step: steps each training run makes (default 100)")
    p.add_argument("-o", "--output", required=True, help="the measurements file to write")
    args = p.parse_args(argv)
    configs = []
    for text in args.config or [f"{args.rate},{args.layout},{args.maxbytes},"
                                f"{args.ops.replace(',', '+')}"]:
        parts = text.split(",")
        if len(parts) not in (3, 4):
            raise SystemExit(f"bench_tcp_cluster: --config {text!r}: expected "
                             f"RATE,LAYOUT,MAXBYTES[,OPS]")
        hosts, _, per_host = parts[1].partition("x")
        ops = (parts[3] if len(parts) == 4 else args.ops.replace(",", "+")).split("+")
        configs.append((parts[0], int(hosts), int(per_host), parts[2], [o for o in ops if o]))
    if len(configs) > 1 and "{" not in args.output:
        raise SystemExit("bench_tcp_cluster: several --config: name the files with {rate} "
                         "and {layout} in -o")
    start_load = wait_for_load(args.wait_load, args.wait_max)
    why = why_unavailable()
    if why:
        raise SystemExit(f"bench_tcp_cluster: cannot build the cluster: {why}")
    most = max(c[1] for c in configs)
    first = None if configs[0][0] == "none" else configs[0][0]
    with TestCluster(list(NAMES[:most]), rate=first) as cluster:
        for rate, hosts, per_host, maxbytes, ops in configs:
            out = args.output.format(rate=rate, layout=f"{hosts}x{per_host}")
            if args.step:
                code, text, record = validate_step(
                    cluster, None if rate == "none" else rate, hosts, per_host, args.step,
                    steps=args.steps, launches=args.launches)
                print(text, flush=True)
                record["start_loadavg_1m"] = start_load
                with open(out, "w") as fh:
                    json.dump(record, fh, indent=1)
                    fh.write("\n")
                print(f"# wrote {out} (validate exited {code})", flush=True)
                continue
            runs = measure(None if rate == "none" else rate, hosts, per_host, ops,
                           minbytes=args.minbytes, maxbytes=maxbytes, factor=args.stepfactor,
                           launches=args.launches, iters=args.iters, rounds=args.rounds,
                           cluster=cluster)
            for run in runs:
                run["start_loadavg_1m"] = start_load
                if rate != "none":  # the rate it was measured at, for calibrate and validate
                    run["link_rate_gbps"] = _gbps(rate)
            with open(out, "w") as fh:
                json.dump({"kind": "neocomm-measurements", "runs": runs}, fh, indent=1)
                fh.write("\n")
            print(f"# wrote {out}: {len(runs)} runs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
