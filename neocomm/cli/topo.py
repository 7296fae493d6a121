"""``neocomm topo``: print the discovered topology of this host or of the whole job.

Run alone it probes this host; under ``mpirun`` with several ranks it starts
the world, every host of the job is probed once and rank 0 prints the cluster
(ranks, nodes - emulated ones included - hosts, GPUs, NICs). ``--fixture``,
``--sysfs-root``, ``--nvidia-smi-topo`` and ``--nvidia-smi-query`` probe a
captured host instead of the live one (:mod:`topology.cli.sources`).
"""
from __future__ import annotations

import sys

__all__ = ["HELP", "add_arguments", "run", "discover"]

HELP = "print the discovered topology of the job"


def add_arguments(parser) -> None:
    from topology.cli.sources import add_source_arguments

    parser.add_argument("--json", action="store_true",
                        help="print the topology as JSON (input of `neocomm fabric validate "
                             "--topology`)")
    add_source_arguments(parser)


def discover(args):
    """``(cluster, world)``: the topology the options of ``args`` choose, and the World
    when running under mpirun with several ranks (else None; collective then).

    The options are checked (:class:`~topology.cli.sources.SourceError`) before
    the world starts.
    """
    from topology.cli import sources

    kw = sources.probe_kwargs(args)
    if sources.job_size() <= 1:
        return sources.discover(kw), None
    from neocomm.world import init

    world = init()
    nodes = [world.node_of(r) for r in range(world.size)]
    return sources.discover(kw, world.comm, nodes), world


def run(args) -> int:
    from topology.cli.sources import SourceError, print_cluster

    try:
        cluster, world = discover(args)
    except SourceError as exc:
        print(f"neocomm topo: {exc}", file=sys.stderr)
        return 2
    if world is not None and world.rank != 0:
        return 0
    print_cluster(cluster, args.json)
    return 0
