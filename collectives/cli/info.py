"""The collectives layer's lines in ``neocomm info`` (entry points of ``neocomm.info``)."""
from __future__ import annotations

__all__ = ["symmetric_memory"]


def symmetric_memory() -> tuple[str, str]:
    """``(title, state)``: whether host collectives can use symmetric (shared) memory, and where."""
    from collectives import symmetric

    ok, where = symmetric.availability()
    return "symmetric memory (host collectives)", f"{'available' if ok else 'unavailable'}: {where}"
