"""The ``neocomm`` command line.

It sits on top of every layer and imports each subcommand lazily: a
subcommand is a module ``neocomm.cli.<name>`` with ``add_arguments(parser)``
and ``run(args) -> int``. Listing one here is all it takes to add it.
"""
from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "COMMANDS"]

#: name -> one-line help. The module is ``neocomm.cli.<name>``.
COMMANDS: dict[str, str] = {
    "run": "launch a command on N ranks under the MPI launcher",
    "info": "versions, MPI library, backends available and why not, settings",
    "topo": "print the discovered topology of the job",
    "fabric": "validate a cluster against a fabric spec",
    "bench": "collective bandwidth tests in the style of nccl-tests",
    "plan": "plan the sharding of embedding tables",
    "train": "train a DLRM with sharded embeddings",
    "checkpoint": "inspect and verify checkpoints",
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neocomm",
        description="Communication and topology runtime for recommendation-model training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {k:<11} {v}" for k, v in COMMANDS.items())
        + "\n\n`neocomm COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("command", nargs="?", choices=list(COMMANDS), metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``neocomm`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0 if argv else 2
    if argv[0] == "--version":
        from neocomm import __version__

        print(f"neocomm {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        top.error(f"unknown command {name!r}; choose from {', '.join(COMMANDS)}")
    module = importlib.import_module(f"neocomm.cli.{name}")
    parser = argparse.ArgumentParser(prog=f"neocomm {name}", description=COMMANDS[name])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    from neocomm.logs import install_cli_logging

    install_cli_logging()
    try:
        return int(module.run(args) or 0)
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
