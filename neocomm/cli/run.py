"""``neocomm run -n N [--ranks-per-node K] [--hostfile F] -- CMD ...``"""
from __future__ import annotations

import argparse
import sys

from neocomm.launcher import LauncherNotFound, NoRoomError, launch

__all__ = ["HELP", "add_arguments", "run"]

HELP = "launch a command on N ranks under the MPI launcher"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="group ranks into emulated nodes of K (sets NEOCOMM_RANKS_PER_NODE)")
    p.add_argument("--hostfile", default=None, help="MPI hostfile for runs across nodes")
    p.add_argument("--timeout", type=float, default=None,
                   help="kill the job after this many seconds (exit 124)")
    p.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the MPI launcher (repeatable)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")


def run(args) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        print(f"neocomm run: --ranks-per-node: expected >= 1, got {args.ranks_per_node}",
              file=sys.stderr)
        return 2
    try:
        return launch(args.nprocs, command, ranks_per_node=args.ranks_per_node,
                      hostfile=args.hostfile, extra=args.mpi_arg, timeout=args.timeout)
    except LauncherNotFound as exc:
        print(f"neocomm run: {exc}", file=sys.stderr)
        return 127
    except NoRoomError as exc:
        print(f"neocomm run: cannot start the job: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"neocomm run: {exc}", file=sys.stderr)
        return 2
