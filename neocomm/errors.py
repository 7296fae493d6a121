"""The neocomm error family.

Every error carries structured fields (which ranks, which argument) and
survives pickling, so one rank's failure can be shipped to the others and
re-raised there with the same meaning.
"""
from __future__ import annotations

__all__ = [
    "NeocommError",
    "CollectiveArgumentError",
    "BackendUnavailableError",
    "GroupGoneError",
]


class NeocommError(RuntimeError):
    """Base of neocomm's own errors.

    ``ranks`` names the ranks the error is about (empty when it is local).
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.message = message
        self.ranks = tuple(int(r) for r in ranks)

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.__dict__.copy()))


def _rebuild(cls, message, state):
    err = cls.__new__(cls)
    RuntimeError.__init__(err, message)
    err.__dict__.update(state)
    return err


class CollectiveArgumentError(NeocommError, ValueError):
    """Arguments of a collective were rejected on at least one rank.

    Raised on *every* rank of the group, so nobody is left waiting.
    ``field`` names the offending argument (``"sendbuf"``, ``"recv_counts"``,
    ``"dtype"`` …), ``per_rank`` maps each failing rank to its own message.
    """

    def __init__(self, message: str, *, op: str = "", field: str = "",
                 ranks: tuple[int, ...] = (), per_rank: dict[int, str] | None = None):
        super().__init__(message, ranks=ranks)
        self.op = op
        self.field = field
        self.per_rank = dict(per_rank or {})


class BackendUnavailableError(NeocommError):
    """A backend was asked for that cannot run here; ``reason`` says why."""

    def __init__(self, backend: str, reason: str):
        super().__init__(f"backend {backend!r} is not available: {reason}")
        self.backend = backend
        self.reason = reason


class GroupGoneError(NeocommError, ValueError):
    """A call on a process group that was freed, or whose world was closed;
    ``ranks`` are the group's world ranks."""
