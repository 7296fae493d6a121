"""The ``NEOCOMM_*`` settings of the collectives layer, declared once.

They are read from the environment at first use and kept (a collective
call must not pay for parsing the environment); :func:`reload` re-reads
them. Sizes accept K/M/G suffixes (powers of 1024). Every rank must see the same values.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from neocomm import config

__all__ = ["Snapshot", "current", "reload", "version", "algorithm_override",
           "staging_buffers", "calibration_path"]

config.declare("ALGO_", str, "", "Force the algorithm of one collective, e.g. "
               "NEOCOMM_ALGO_ALL_REDUCE=ring (names: `neocomm bench --list`); empty: the "
               "cheapest by the cost model", prefix=True)
config.declare("CHUNK_BYTES", int, None, "Chunk size of every link class (unset: per link "
               "class from the topology); a positive multiple of the element size",
               unit="bytes")
config.declare("CHUNK_BYTES_INTRA", int, None, "Chunk size between ranks of one node "
               "(unset: NEOCOMM_CHUNK_BYTES, then the topology)", unit="bytes")
config.declare("CHUNK_BYTES_INTER", int, None, "Chunk size between nodes (unset: "
               "NEOCOMM_CHUNK_BYTES, then the topology)", unit="bytes")
config.declare("CHUNKING", bool, True, "Split large messages into chunks (off: one message "
               "per transfer; staging buffers then grow with the message)")
config.declare("PIPELINE_DEPTH", int, 4, "Chunks in flight per stream of a pipelined "
               "algorithm", unit="chunks", minimum=1)
config.declare("STAGING_BUFFERS", int, 16, "Most staging buffers (one chunk each) a process "
               "keeps for pipelined algorithms; bounds staging memory", unit="buffers",
               minimum=4)
config.declare("CALIBRATION", str, "", "JSON written by `neocomm bench --calibrate`: link "
               "parameters and per-algorithm factors for the cost model (empty: none)")

_ALGO_PREFIX = "NEOCOMM_ALGO_"


@dataclass(frozen=True)
class Snapshot:
    """The collectives settings as read at one moment (hashable, comparable)."""

    chunking: bool = True
    depth: int = 4
    staging: int = 16
    chunk_intra: int | None = None
    chunk_inter: int | None = None
    calibration: str = ""
    algos: tuple[tuple[str, str], ...] = ()
    error: str = ""  # a malformed setting, reported by the next call that needs it


_SNAPSHOT: Snapshot | None = None
#: How many times the settings' values changed: a plan made under another number was made
#: for other settings (see :func:`version`).
VERSION = 0


def _load() -> Snapshot:
    try:
        common = config.get("CHUNK_BYTES")
        intra = config.get("CHUNK_BYTES_INTRA")
        inter = config.get("CHUNK_BYTES_INTER")
        algos = tuple(sorted((key[len(_ALGO_PREFIX):].lower(), value.strip().lower())
                             for key, value in os.environ.items()
                             if key.startswith(_ALGO_PREFIX) and value.strip()))
        staging = int(config.get("STAGING_BUFFERS"))
        depth = min(int(config.get("PIPELINE_DEPTH")), max(1, (staging - 2) // 2))
        return Snapshot(chunking=bool(config.get("CHUNKING")), depth=depth, staging=staging,
                        chunk_intra=intra if intra is not None else common,
                        chunk_inter=inter if inter is not None else common,
                        calibration=str(config.get("CALIBRATION")), algos=algos)
    except config.SettingsError as exc:
        return Snapshot(error=str(exc))


def current() -> Snapshot:
    """The settings snapshot (read from the environment on first use)."""
    if _SNAPSHOT is None:
        _keep(_load())
    return _SNAPSHOT


def reload() -> Snapshot:
    """Re-read the settings from the environment (e.g. after changing ``os.environ``)."""
    _keep(_load())
    return _SNAPSHOT


def version() -> int:
    """The number of the settings' values now: it changes when a :func:`reload` finds
    other values, never when it finds the same ones (plans compare it, an int, on every
    call)."""
    current()
    return VERSION


def _keep(snapshot: Snapshot) -> None:
    global _SNAPSHOT, VERSION
    if snapshot != _SNAPSHOT:
        VERSION += 1
    _SNAPSHOT = snapshot


def algorithm_override(op_name: str) -> str:
    """``NEOCOMM_ALGO_<OP>`` for ``op_name`` (``"all_reduce"``), or ``""``."""
    key = op_name.lower()
    for name, value in current().algos:
        if name == key:
            return value
    return ""


def staging_buffers() -> int:
    return current().staging


def calibration_path() -> str:
    return current().calibration
