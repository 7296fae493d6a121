"""``neocomm fabric``: check a cluster against a fabric spec.

``neocomm fabric validate SPEC [--topology FILE.json] [--measure] [--json]``
compares the discovered topology (this host, every host of the job under
mpirun, a captured fixture, or a topology JSON file) with SPEC (a TOML file
or a preset name) and prints one check per rule and subject. ``--measure``
also measures, over the runtime, point-to-point bandwidth of a pair of ranks
in one node and of a pair in two nodes (host buffers through
``group.backend()``) and the all-reduce bus bandwidth, and checks them
against the spec's ``[bandwidth]`` minimums.

Exit status: 0 every check passed, 1 some check failed, 2 the spec, the
topology file or the options are invalid.
"""
from __future__ import annotations

import json
import sys

from topology.sizes import MIB, format_size, size_arg

__all__ = ["HELP", "add_arguments", "run", "measure"]

HELP = "validate a cluster against a fabric spec"


def add_arguments(parser) -> None:
    from topology.cli.topo import add_source_arguments

    parser.add_argument("action", choices=("validate", "presets"),
                        help="validate: check a cluster against SPEC; presets: list the presets")
    parser.add_argument("spec", nargs="?", metavar="SPEC",
                        help="fabric spec: a TOML file or a preset name")
    parser.add_argument("--topology", metavar="FILE.json",
                        help="validate this topology (from `neocomm topo --json`) instead of "
                             "discovering one")
    parser.add_argument("--measure", action="store_true",
                        help="also measure point-to-point and all-reduce bandwidth of the job")
    parser.add_argument("--bytes", type=size_arg, default=32 * MIB, metavar="SIZE",
                        help="message size of the measurements, e.g. 32M or 33554432 "
                        "(default 32M)")
    parser.add_argument("--iters", type=int, default=5, metavar="N",
                        help="timed repetitions of each measurement (default 5)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list passing checks too")
    add_source_arguments(parser)


def _error(message: str) -> int:
    print(f"neocomm fabric: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    from topology import SpecError, TopologyError, load_spec, preset_names

    if args.action == "presets":
        for name in preset_names():
            print(f"{name:<12} {load_spec(name).description}")
        return 0
    if not args.spec:
        return _error("validate needs SPEC (a TOML file or one of: "
                      f"{', '.join(preset_names())})")
    if args.iters < 1:
        return _error(f"--iters must be >= 1, got {args.iters}")
    if args.measure and args.topology:
        return _error("--measure measures the running job; it cannot be combined with "
                      "--topology")
    try:
        spec = load_spec(args.spec)
    except SpecError as exc:
        return _error(f"invalid spec: {exc}")
    world = None
    if args.topology:
        try:
            cluster = _load_topology(args.topology)
        except (OSError, UnicodeDecodeError, TopologyError) as exc:
            return _error(f"invalid topology file {args.topology}: {exc}")
    else:
        from topology.cli.topo import SourceError, discover

        try:
            cluster, world = discover(args)
        except SourceError as exc:
            return _error(str(exc))
    measured = notes = None
    if args.measure:
        if world is None:
            from topology.cli.topo import init_world

            world = init_world()
        measured, notes = measure(world, cluster, args.bytes, args.iters)
    from topology import validate

    report = validate(cluster, spec, measured, measured_notes=notes)
    if world is None or world.rank == 0:
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            print(report.format_text(verbose=args.verbose))
    return 0 if report.passed else 1


def _load_topology(path: str):
    from topology import ClusterTopology, HostTopology, from_json

    with open(path) as f:
        obj = from_json(f.read())
    return ClusterTopology.single(obj) if isinstance(obj, HostTopology) else obj


# -- measurement ------------------------------------------------------------

def measure(world, cluster, nbytes: int = 32 * MIB, iters: int = 5):
    """Measured GB/s per link class and how each was measured (collective).

    Point-to-point: rank a streams ``iters`` messages of ``nbytes`` to rank b
    after a warm-up, timed at b; one pair inside a node, one across nodes. The
    class is the physical path: ``shm`` when both ranks share a host (emulated
    nodes included), else the inter-node link of the cluster. All-reduce bus
    bandwidth uses nccl-tests' factor 2(n-1)/n on float32 buffers. ``world`` is
    the runtime's world of the job (:func:`~topology.cli.topo.init_world`):
    its ``comm``, ``size`` and the host backend of its ``world`` group are used.
    """
    import numpy as np

    from topology import inter_node_kind

    group = world.world
    buf = np.zeros(nbytes, dtype=np.uint8)
    backend = group.backend(buf)
    nodes = cluster.nodes
    pairs = []
    intra = next((n for n in nodes if len(n) >= 2), None)
    if intra is not None:
        pairs.append(("same node", intra[0], intra[1]))
    if len(nodes) >= 2:
        pairs.append(("different nodes", nodes[0][0], nodes[1][0]))
    results: dict[str, float] = {}
    notes: dict[str, str] = {}
    size = format_size(nbytes)
    for where, a, b in pairs:
        same_host = cluster.ranks[a].host == cluster.ranks[b].host
        cls = "shm" if same_host else inter_node_kind(cluster).value
        gbs = _p2p(world, backend, buf, a, b, iters)
        note = (f"ranks {a}->{b} {where}, {'same host' if same_host else 'two hosts'}: "
                f"{gbs:.3g} GB/s")
        # a class measured twice keeps its slower figure; the note shows both
        notes[cls] = f"{notes[cls]}; {note}" if cls in notes else note
        results[cls] = min(gbs, results.get(cls, gbs))
    for cls in results:
        notes[cls] += f"; {size} x {iters}"
    if world.size >= 2:
        results["allreduce_bus"] = _allreduce(world, backend, nbytes, iters)
        notes["allreduce_bus"] = f"{world.size} ranks, float32; {size} x {iters}"
    else:
        notes["allreduce_bus"] = "not measured: needs at least 2 ranks"
    if not pairs:
        for cls in ("shm", "tcp", "roce", "infiniband"):
            notes[cls] = "not measured: needs at least 2 ranks"
    for cls in ("nvlink", "pcie"):
        notes.setdefault(cls, "not measured: --measure moves host buffers only")
    return results, notes


def _p2p(world, backend, buf, a: int, b: int, iters: int) -> float:
    from mpi4py import MPI

    comm = world.comm
    rank = comm.Get_rank()
    seconds = 0.0
    for rep in range(iters + 1):  # the first round is a warm-up
        comm.Barrier()
        t0 = MPI.Wtime()
        if rank == a:
            backend.send(buf, b, tag=17)
        elif rank == b:
            backend.recv(buf, a, tag=17)
        if rep:
            seconds += MPI.Wtime() - t0
    gbs = buf.nbytes * iters / seconds / 1e9 if rank == b and seconds > 0 else 0.0
    return comm.bcast(gbs, root=b)


def _allreduce(world, backend, nbytes: int, iters: int) -> float:
    import numpy as np
    from mpi4py import MPI

    comm = world.comm
    n = world.size
    data = np.ones(max(nbytes // 4, 1), dtype=np.float32)
    backend.all_reduce(data)  # warm-up
    comm.Barrier()
    t0 = MPI.Wtime()
    for _ in range(iters):
        backend.all_reduce(data)
    elapsed = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
    algbw = data.nbytes * iters / elapsed / 1e9
    return algbw * 2 * (n - 1) / n
