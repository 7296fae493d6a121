"""What to probe: the options of ``neocomm topo`` and ``neocomm fabric`` and the topology they give.

``--fixture``, ``--sysfs-root``, ``--nvidia-smi-topo`` and ``--nvidia-smi-query``
probe a captured host instead of the live one. :func:`discover` probes this
host, or, given the job's communicator and the node of every rank, every host
of the job once (collective). The runtime's commands (``neocomm/cli``) start
the world and pass those plain values down: this layer never starts the runtime.
"""
from __future__ import annotations

import os
import sys
import warnings

__all__ = ["SourceError", "add_source_arguments", "probe_kwargs", "job_size", "discover",
           "load_topology", "print_cluster"]


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


def discover(kw: dict, comm=None, nodes=None):
    """The topology of the probe arguments ``kw`` (:func:`probe_kwargs`): this host alone,
    or with ``comm`` (an MPI communicator of the job) and ``nodes`` (the node of each of
    its ranks) every host of the job, each probed once (collective over ``comm``).

    Probe warnings are recorded in the topology, not printed.
    """
    from topology import ClusterTopology, ProbeWarning, discover_host, discover_world

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)
        if comm is not None:
            return discover_world(comm, list(nodes), **kw)
        return ClusterTopology.single(discover_host(**kw))


def load_topology(path: str):
    """The cluster of a topology JSON file (``neocomm topo --json``; one host is a
    cluster of one); OSError, UnicodeDecodeError or TopologyError when it cannot be."""
    from topology import ClusterTopology, HostTopology, from_json

    with open(path) as f:
        obj = from_json(f.read())
    return ClusterTopology.single(obj) if isinstance(obj, HostTopology) else obj


def print_cluster(cluster, as_json: bool = False, prog: str = "neocomm topo") -> None:
    """Print ``cluster`` as text (like ``nvidia-smi topo -m``) or as JSON, its hosts'
    probe warnings then going to stderr."""
    from topology import to_json
    from topology.render import render_cluster

    if as_json:
        for host in cluster.hosts:
            for w in host.warnings:
                print(f"{prog}: warning: {host.hostname}: {w}", file=sys.stderr)
        print(to_json(cluster))
    else:
        print(render_cluster(cluster))
