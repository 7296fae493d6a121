"""Rank-aware logging, installed by the launcher or the command line, never at import."""
from __future__ import annotations

import logging
import os

__all__ = ["install_cli_logging", "rank_from_env"]


def rank_from_env() -> int | None:
    """This process's rank as the MPI launcher exported it, without touching MPI."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID"):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                return None
    return None


def install_cli_logging(level: str | None = None) -> None:
    """Send neocomm's log records to stderr with a ``[rank N]`` prefix."""
    from neocomm import config

    rank = rank_from_env()
    tag = f"[rank {rank}] " if rank is not None else ""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s",
                                           "%H:%M:%S"))
    root = logging.getLogger()
    if not any(getattr(h, "_neocomm", False) for h in root.handlers):
        handler._neocomm = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level or config.get("LOG_LEVEL"))
