"""One typed table of ``NEOCOMM_*`` settings.

Every setting is declared once here with its type, default, unit and help.
``settings()`` reads the environment; unknown ``NEOCOMM_*`` names are warned
about (a typo must not silently do nothing). Packages above register their
own entries with :func:`declare` when they are imported, so the table stays
one and the core never looks upward for them; a program that may meet the
settings of layers it has not imported yet (the ``neocomm`` command line)
registers a loader for them with :func:`add_declarations`.
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = ["Setting", "declare", "settings", "get", "prefixed", "table", "add_declarations",
           "load_declarations", "SettingsError"]

_log = logging.getLogger(__name__)


class SettingsError(ValueError):
    """A ``NEOCOMM_*`` variable holds a value of the wrong type or range."""


@dataclass(frozen=True)
class Setting:
    """One ``NEOCOMM_<name>`` variable: type, default, unit and help text."""

    name: str
    type: type
    default: Any
    help: str
    unit: str = ""
    choices: tuple | None = None
    minimum: float | None = None
    prefix: bool = False  # NEOCOMM_<name><SUFFIX> family, e.g. ALGO_ALL_REDUCE

    @property
    def env(self) -> str:
        return "NEOCOMM_" + self.name

    def parse(self, raw: str, env: str | None = None) -> Any:
        env = env or self.env
        try:
            if self.type is bool:
                low = raw.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    value: Any = True
                elif low in ("0", "false", "no", "off", ""):
                    value = False
                else:
                    raise ValueError(raw)
            elif self.type is int:
                # A plain integer stays as given (range checks name the setting); sizes with
                # units go through parse_size (imported here: the topology package costs
                # start-up time that most settings never need).
                from topology.sizes import parse_size

                plain = re.fullmatch(r"\s*[-+]?[0-9]+\s*", raw)
                value = parse_size(raw) if self.unit == "bytes" and not plain else int(raw)
            else:
                value = self.type(raw)
        except ValueError as exc:
            why = f"; {exc}" if self.unit == "bytes" else ""
            raise SettingsError(f"{env}={raw!r}: expected {self.type.__name__}"
                                f"{' (' + self.unit + ')' if self.unit else ''}{why}") from None
        if self.choices is not None and value not in self.choices:
            raise SettingsError(f"{env}={raw!r}: expected one of {list(self.choices)}")
        if self.minimum is not None and value < self.minimum:
            raise SettingsError(f"{env}={raw!r}: must be >= {self.minimum}")
        return value


_TABLE: dict[str, Setting] = {}


def declare(name: str, type: type, default: Any, help: str, **kw) -> Setting:
    """Add a setting to the table (idempotent for the same declaration)."""
    setting = Setting(name, type, default, help, **kw)
    old = _TABLE.get(name)
    if old is not None and old != setting:
        raise ValueError(f"setting NEOCOMM_{name} declared twice with different meanings")
    _TABLE[name] = setting
    return setting


def table() -> list[Setting]:
    """All declared settings, sorted by name."""
    return [_TABLE[k] for k in sorted(_TABLE)]


# The core's own settings. Units in the ``unit`` field; sizes accept K/M/G suffixes
# (powers of 1024, as everywhere: topology.sizes).
declare("RANKS_PER_NODE", int, 0, "Group ranks into emulated nodes of this many ranks "
        "(0: real nodes, found with MPI's shared-memory split)", unit="ranks", minimum=0)
declare("BACKEND", str, "auto", "Backend for device buffers: auto picks nccl, then staged",
        choices=("auto", "nccl", "staged", "mpi"))
declare("CHECK_ARGS", bool, True, "Agree collective arguments (op, dtype, counts) across ranks "
        "before moving data, so mismatches raise on every rank instead of hanging")
declare("TIMEOUT", float, 300.0, "Abort the job when a collective has not completed after this "
        "long (0: never)", unit="seconds", minimum=0)
declare("STAGING_BYTES", int, 64 << 20, "Pinned host staging pool of the staged backend",
        unit="bytes", minimum=4096)
declare("LOG_LEVEL", str, "WARNING", "Logging level of the rank-aware log format",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
declare("LAUNCHER", str, "", "MPI launcher for `neocomm run` (default: mpirun or mpiexec next to "
        "this Python, else on PATH)")
declare("STDOUT_TTY", bool, False, "Set by `neocomm run` when its own output is a terminal "
        "(under a launcher every rank sees a pseudo-terminal, so ranks cannot tell)")
declare("ABORT_ON_EXCEPTION", bool, True, "An unhandled exception on any rank aborts the job")
declare("HOST_KEEP_FREED", int, 1 << 30, "Freed host memory each process keeps for reuse instead "
        "of returning it to the OS (glibc's malloc thresholds), so a training step's temporaries "
        "stop page-faulting every step (0: the C library's defaults)", unit="bytes", minimum=0)


def get(name: str, environ: dict | None = None) -> Any:
    """The value of ``NEOCOMM_<name>`` (its default when unset)."""
    setting = _TABLE[name]
    env = os.environ if environ is None else environ
    raw = env.get(setting.env)
    return setting.default if raw is None or raw == "" else setting.parse(raw)


def prefixed(name: str, suffix: str, environ: dict | None = None) -> Any:
    """Value of a prefix family member, e.g. ``prefixed('ALGO_', 'ALL_REDUCE')``."""
    setting = _TABLE[name]
    env = os.environ if environ is None else environ
    key = setting.env + suffix.upper()
    raw = env.get(key)
    return setting.default if raw is None or raw == "" else setting.parse(raw, key)


_LOADERS: list = []  # functions declaring settings, not run yet
_ADDED: set = set()  # every loader ever given (each runs once)


def add_declarations(loader) -> None:
    """Run ``loader`` (a function that declares settings, e.g. by importing the modules
    that declare them) once, before unknown names are next warned about."""
    if loader not in _ADDED:
        _ADDED.add(loader)
        _LOADERS.append(loader)


def load_declarations() -> None:
    """Run the loaders given to :func:`add_declarations` (each once).

    The layers above the core declare their settings when imported; a loader
    lets a program complete the table with layers it has not imported (yet)
    before unknown names are warned about. A loader that fails is warned
    about, never fatal.
    """
    while _LOADERS:
        loader = _LOADERS.pop(0)
        try:
            loader()
        except Exception as exc:  # noqa: BLE001 - a broken plug-in must not stop the job
            warnings.warn(f"settings could not be loaded: {exc}", stacklevel=2)


def settings(environ: dict | None = None, *, warn_unknown: bool = True) -> dict[str, Any]:
    """Read every declared setting; warn about unknown ``NEOCOMM_*`` variables."""
    env = os.environ if environ is None else environ
    if warn_unknown:
        load_declarations()
    out = {s.name: get(s.name, env) for s in table() if not s.prefix}
    if warn_unknown:
        for key in sorted(env):
            if key.startswith("NEOCOMM_") and not _known(key):
                close = [s.env for s in table() if _similar(key, s.env)]
                hint = f" (did you mean {close[0]}?)" if close else ""
                warnings.warn(f"unknown setting {key}{hint}; see `neocomm info`",
                              stacklevel=2)
    return out


def _known(key: str) -> bool:
    name = key[len("NEOCOMM_"):]
    if name in _TABLE and not _TABLE[name].prefix:
        return True
    return any(s.prefix and name.startswith(s.name) and len(name) > len(s.name)
               for s in _TABLE.values())


def _similar(a: str, b: str) -> bool:
    import difflib

    return difflib.SequenceMatcher(None, a, b).ratio() > 0.8
