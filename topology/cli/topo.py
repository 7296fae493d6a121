"""``neocomm topo``: print the discovered topology of this host or of the whole job.

Run alone it probes this host; under ``mpirun`` with several ranks every
host of the job is probed once and rank 0 prints the cluster (ranks, nodes
- emulated ones included - hosts, GPUs, NICs). ``--fixture``,
``--sysfs-root``, ``--nvidia-smi-topo`` and ``--nvidia-smi-query`` probe a
captured host instead of the live one.

Topology sits below the runtime: under ``mpirun`` the job's world comes
from the runtime registered as the ``world`` entry point of the
``neocomm.runtime`` group (``neocomm.init``), never from an import of it.
"""
from __future__ import annotations

import os
import sys
import warnings

__all__ = ["HELP", "add_arguments", "run", "add_source_arguments", "discover", "init_world",
           "SourceError"]

HELP = "print the discovered topology of the job"
RUNTIME_GROUP = "neocomm.runtime"


class SourceError(ValueError):
    """A topology source given on the command line cannot be used."""


def add_source_arguments(parser) -> None:
    """The options that choose what to probe (shared with ``neocomm fabric``)."""
    from topology import fixture_names

    group = parser.add_argument_group("what to probe (default: this host, or every host of "
                                      "the job under mpirun)")
    group.add_argument("--fixture", metavar="NAME",
                       help=f"a captured host shipped with neocomm: {', '.join(fixture_names())}")
    group.add_argument("--sysfs-root", metavar="DIR",
                       help="read DIR/sys and DIR/proc instead of /sys and /proc")
    group.add_argument("--nvidia-smi-topo", metavar="FILE",
                       help="captured `nvidia-smi topo -m` output")
    group.add_argument("--nvidia-smi-query", metavar="FILE",
                       help="captured `nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,"
                            "memory.total --format=csv` output")


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print the topology as JSON (input of `neocomm fabric validate "
                             "--topology`)")
    add_source_arguments(parser)


def _read(path: str, what: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"{what} {path}: cannot read ({exc})") from None


def probe_kwargs(args) -> dict:
    """Keyword arguments of :func:`topology.discover_host` from the command line."""
    from topology import fixture, fixture_names

    kw: dict = {}
    if args.fixture:
        if args.fixture not in fixture_names():
            raise SourceError(f"--fixture: expected one of {fixture_names()}, got {args.fixture!r}")
        fx = fixture(args.fixture)
        kw = {"root": fx.root, "nvidia_smi_topo": fx.nvidia_smi_topo,
              "nvidia_smi_query": fx.nvidia_smi_query, "live": False}
    if args.sysfs_root:
        if not os.path.isdir(args.sysfs_root):
            raise SourceError(f"--sysfs-root {args.sysfs_root}: not a directory")
        kw["root"] = args.sysfs_root
    if args.nvidia_smi_topo:
        kw["nvidia_smi_topo"] = _read(args.nvidia_smi_topo, "--nvidia-smi-topo")
    if args.nvidia_smi_query:
        kw["nvidia_smi_query"] = _read(args.nvidia_smi_query, "--nvidia-smi-query")
    if kw and "live" not in kw:
        # captured text for this very host still lets NVML and sysfs speak for the rest
        kw["live"] = os.path.realpath(kw.get("root", "/")) == "/"
    return kw


def job_size() -> int:
    """Number of ranks the MPI launcher started, without initialising MPI."""
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 1


def init_world():
    """The runtime's world of this MPI job (collective: every rank calls it).

    The runtime registers its ``init`` as the entry point ``world`` of the
    ``neocomm.runtime`` group; RuntimeError when none is installed.
    """
    from importlib.metadata import entry_points

    found = entry_points(group=RUNTIME_GROUP, name="world")
    if not found:
        raise RuntimeError(f"no runtime to start the job's world: no entry point 'world' in "
                           f"group {RUNTIME_GROUP!r} (is neocomm installed? pip install -e .)")
    return next(iter(found)).load()()


def discover(args):
    """``(cluster, world)``: the topology to show or validate, and the neocomm
    World when running under mpirun with several ranks (else None).

    Probe warnings are recorded in the topology, not printed.
    """
    from topology import ClusterTopology, ProbeWarning, discover_host, discover_world

    kw = probe_kwargs(args)
    world = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)
        if job_size() > 1:
            world = init_world()
            nodes = [world.node_of(r) for r in range(world.size)]
            cluster = discover_world(world.comm, nodes, **kw)
        else:
            cluster = ClusterTopology.single(discover_host(**kw))
    return cluster, world


def run(args) -> int:
    from topology import to_json
    from topology.render import render_cluster

    try:
        cluster, world = discover(args)
    except SourceError as exc:
        print(f"neocomm topo: {exc}", file=sys.stderr)
        return 2
    if world is not None and world.rank != 0:
        return 0
    if args.json:
        for host in cluster.hosts:
            for w in host.warnings:
                print(f"neocomm topo: warning: {host.hostname}: {w}", file=sys.stderr)
        print(to_json(cluster))
    else:
        print(render_cluster(cluster))
    return 0
