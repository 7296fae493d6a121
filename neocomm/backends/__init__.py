"""Backends: the transports under the collectives (MPI, NCCL, staged)."""
from __future__ import annotations

from neocomm.backends.base import Backend, CompletedHandle, Handle
from neocomm.types import BackendKind

__all__ = ["Backend", "Handle", "CompletedHandle", "availability"]


def availability() -> dict[BackendKind, tuple[bool, str | None]]:
    """For every backend kind: ``(available, reason when not)``, without building a group."""
    from neocomm.group import backend_class

    return {kind: backend_class(kind).availability() for kind in BackendKind}
