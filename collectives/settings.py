"""The ``NEOCOMM_*`` settings of the collectives layer, declared once.

Read with :func:`neocomm.config.get`; sizes accept K/M/G suffixes.
"""
from __future__ import annotations

from neocomm import config

__all__ = ["algorithm_override", "chunk_override", "chunking_enabled", "pipeline_depth",
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
               minimum=2)
config.declare("CALIBRATION", str, "", "JSON written by `neocomm bench --calibrate`: link "
               "parameters and per-algorithm factors for the cost model (empty: none)")


def algorithm_override(op_name: str) -> str:
    """``NEOCOMM_ALGO_<OP>`` for ``op_name`` (``"all_reduce"``), or ``""``."""
    return config.prefixed("ALGO_", op_name.upper()).strip().lower()


def chunk_override(link_class: str) -> int | None:
    """Chunk bytes forced for ``"intra"`` or ``"inter"`` links (None: not forced)."""
    specific = config.get("CHUNK_BYTES_" + link_class.upper())
    return specific if specific is not None else config.get("CHUNK_BYTES")


def chunking_enabled() -> bool:
    return bool(config.get("CHUNKING"))


def pipeline_depth() -> int:
    return int(config.get("PIPELINE_DEPTH"))


def staging_buffers() -> int:
    return int(config.get("STAGING_BUFFERS"))


def calibration_path() -> str:
    return str(config.get("CALIBRATION"))
