"""Backends: the transports under the collectives (MPI, NCCL, staged)."""
from __future__ import annotations

from neocomm.backends.base import Backend, CompletedHandle, Handle
from neocomm.types import BackendKind

__all__ = ["Backend", "Handle", "CompletedHandle", "availability", "backend_class",
           "device_backend_kind"]


def availability() -> dict[BackendKind, tuple[bool, str | None]]:
    """For every backend kind: ``(available, reason when not)``, without building a group."""
    return {kind: backend_class(kind).availability() for kind in BackendKind}


def backend_class(kind: BackendKind):
    """The Backend implementation of ``kind`` (imported when first asked for)."""
    if kind is BackendKind.MPI:
        from neocomm.backends.mpi import MpiBackend

        return MpiBackend
    if kind is BackendKind.NCCL:
        from neocomm.backends.nccl import NcclBackend

        return NcclBackend
    from neocomm.backends.staged import StagedBackend

    return StagedBackend


def device_backend_kind() -> BackendKind:
    """The backend of device buffers: ``NEOCOMM_BACKEND``, or NCCL when it is available,
    else the staged one."""
    from neocomm import config

    choice = config.get("BACKEND")
    if choice != "auto":
        return BackendKind(choice)
    ok, _ = backend_class(BackendKind.NCCL).availability()
    return BackendKind.NCCL if ok else BackendKind.STAGED
