"""The ``neocomm`` command line.

The core keeps two commands, ``run`` and ``info``. Every other command is
carried by the package it belongs to and registered in the
``neocomm.commands`` entry-point group of the package metadata, e.g. in
``pyproject.toml``::

    [project.entry-points."neocomm.commands"]
    bench = "collectives.cli.bench"

A command is a module (or an object, ``"module:attr"``) with ``HELP`` (its
one-line help), ``add_arguments(parser)`` and ``run(args) -> int``. It is
imported only to run it, or to show its help line in ``neocomm --help``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

__all__ = ["main", "commands", "Command", "CommandLoadError", "COMMAND_GROUP", "SETTINGS_GROUP"]

#: the entry-point group the commands beyond the core's ``run`` and ``info`` are registered in
COMMAND_GROUP = "neocomm.commands"
#: the entry-point group of the modules that declare the layers' ``NEOCOMM_*`` settings
SETTINGS_GROUP = "neocomm.settings"
_CORE = {"run": "neocomm.cli.run", "info": "neocomm.cli.info"}
#: ``neocomm --help`` lists the core's commands, then the others by layer, lowest first
_LAYERS = ("topology", "neocomm", "collectives", "embedding")


class CommandLoadError(RuntimeError):
    """A command is registered but cannot be imported or lacks ``add_arguments``/``run``."""

    def __init__(self, name: str, target: str, why: str):
        super().__init__(f"command {name!r} cannot be loaded from {target}: {why}")
        self.name, self.target, self.why = name, target, why

    def __reduce__(self):
        return type(self), (self.name, self.target, self.why)


@dataclass(frozen=True)
class Command:
    """One ``neocomm`` command: its name and where it lives (``module`` or ``module:attr``)."""

    name: str
    target: str
    group: str = ""  # the entry-point group it was registered in; empty for the core's

    @property
    def origin(self) -> str:
        """Where the command comes from, in words, for error messages."""
        return f"{self.target} (entry point in {self.group})" if self.group else self.target

    def load(self):
        """The command's module or object; :class:`CommandLoadError` saying why it cannot be."""
        module, _, attr = self.target.partition(":")
        try:
            obj = importlib.import_module(module.strip())
            for part in filter(None, attr.strip().split(".")):
                obj = getattr(obj, part)
        except Exception as exc:  # noqa: BLE001 - any failure of a plug-in is reported as such
            raise CommandLoadError(self.name, self.origin,
                                   f"{type(exc).__name__}: {exc}") from exc
        missing = [f"{f}()" for f in ("add_arguments", "run") if not callable(getattr(obj, f, None))]
        if missing:
            raise CommandLoadError(self.name, self.origin, f"it has no {' and no '.join(missing)}")
        return obj


def help_line(command) -> str:
    """A loaded command's one-line help: ``HELP``, else its docstring's first line."""
    text = getattr(command, "HELP", None) or (command.__doc__ or "").strip()
    return text.splitlines()[0] if text else ""


def _layer(target: str) -> int:
    top = target.split(".", 1)[0].split(":", 1)[0].strip()
    return _LAYERS.index(top) if top in _LAYERS else len(_LAYERS)


def commands() -> dict[str, Command]:
    """Every command by name: the core's, then the registered ones by layer and name.

    A registered name that is already taken (by the core or an earlier
    registration) is left out.
    """
    from importlib.metadata import entry_points

    found = {name: Command(name, target) for name, target in _CORE.items()}
    registered: dict[str, Command] = {}
    for ep in entry_points(group=COMMAND_GROUP):
        if ep.name not in found and ep.name not in registered:
            registered[ep.name] = Command(ep.name, ep.value, COMMAND_GROUP)
    for command in sorted(registered.values(), key=lambda c: (_layer(c.target), c.name)):
        found[command.name] = command
    return found


def _listing(table: dict[str, Command]) -> str:
    lines = []
    for name, command in table.items():
        try:
            text = help_line(command.load())
        except CommandLoadError as exc:
            text = f"(cannot be loaded: {exc.why})"
        lines.append(f"  {name:<11} {text}")
    return "\n".join(lines)


def _top_parser(table: dict[str, Command], listing: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neocomm",
        description="Communication and topology runtime for recommendation-model training.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(f"commands:\n{_listing(table)}\n\n" if listing else "")
        + "`neocomm COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("command", nargs="?", choices=list(table), metavar="COMMAND")
    return parser


def declare_settings() -> None:
    """Import every module registered under ``neocomm.settings``, which declare the
    ``NEOCOMM_*`` settings of the layers above the core (each warned about, not fatal,
    when it cannot be imported)."""
    import warnings
    from importlib.metadata import entry_points

    for ep in entry_points(group=SETTINGS_GROUP):
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plug-in must not stop the job
            warnings.warn(f"settings of {ep.value} could not be loaded: {exc}", stacklevel=2)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``neocomm`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from neocomm import config

    # any command may start the world, which warns about unknown NEOCOMM_* names: the
    # settings of every layer are known first (loaded only when needed)
    config.add_declarations(declare_settings)
    # the core's commands need no look at the installed packages' entry points
    table = ({argv[0]: Command(argv[0], _CORE[argv[0]])} if argv and argv[0] in _CORE
             else commands())
    if not argv or argv[0] in ("-h", "--help"):
        _top_parser(table, listing=True).print_help()
        return 0 if argv else 2
    if argv[0] == "--version":
        from neocomm import __version__

        print(f"neocomm {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in table:
        _top_parser(table).error(f"unknown command {name!r}; choose from {', '.join(table)}")
    try:
        module = table[name].load()
    except CommandLoadError as exc:
        print(f"neocomm: {exc}", file=sys.stderr)
        return 1
    parser = argparse.ArgumentParser(prog=f"neocomm {name}", description=help_line(module))
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
