"""``neocomm fabric``: check a cluster against a fabric spec.

``neocomm fabric validate SPEC [--topology FILE.json] [--measure] [--json]``
compares the discovered topology (this host, every host of the job under
mpirun, a captured fixture, or a topology JSON file) with SPEC (a TOML file
or a preset name) and prints one check per rule and subject. ``--measure``
also measures, over the runtime, point-to-point bandwidth of a pair of ranks
in one node and of a pair in two nodes (host buffers through
``group.backend()``, :mod:`neocomm.bandwidth`) and the all-reduce bus
bandwidth, and checks them against the spec's ``[bandwidth]`` minimums: the
runtime measures, the topology layer validates the numbers.

Exit status: 0 every check passed, 1 some check failed, 2 the spec, the
topology file or the options are invalid.
"""
from __future__ import annotations

import json
import sys

from topology.sizes import MIB, size_arg

__all__ = ["HELP", "add_arguments", "run"]

HELP = "validate a cluster against a fabric spec"


def add_arguments(parser) -> None:
    from topology.cli.sources import add_source_arguments

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
    from topology.cli.sources import load_topology

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
            cluster = load_topology(args.topology)
        except (OSError, UnicodeDecodeError, TopologyError) as exc:
            return _error(f"invalid topology file {args.topology}: {exc}")
    else:
        from neocomm.cli.topo import discover
        from topology.cli.sources import SourceError

        try:
            cluster, world = discover(args)
        except SourceError as exc:
            return _error(str(exc))
    measured = notes = None
    if args.measure:
        from neocomm.bandwidth import measure

        if world is None:
            from neocomm.world import init

            world = init()
        measured, notes = measure(world, cluster, args.bytes, args.iters)
    from topology import validate

    report = validate(cluster, spec, measured, measured_notes=notes)
    if world is None or world.rank == 0:
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            print(report.format_text(verbose=args.verbose))
    return 0 if report.passed else 1
