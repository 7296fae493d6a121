"""Point-to-point transport of the algorithms: the backend's send/recv, or a
lean path straight to mpi4py for host buffers over MPI.

An algorithm posts dozens of chunk messages per call; the backend's
public ``send``/``recv`` still build a full handle
and enter the stall watchdog for every chunk. For NumPy buffers on the MPI
backend the lean path posts ``Isend``/``Irecv`` on the group's communicator
with the bytes as ``MPI.BYTE`` (the algorithms reduce with NumPy, MPI only
moves bytes, so every dtype travels alike) and returns a small request.
The stall watchdog then guards the whole collective once
(:func:`collectives.progress.start`) instead of every chunk. On NCCL the
sends and receives of a round are posted and issued as one NCCL group when
the algorithm first waits (:meth:`neocomm.backends.nccl.NcclBackend.post`):
bare NCCL sends and receives between two ranks block each other.
"""
from __future__ import annotations

from neocomm.types import BackendKind

from collectives.progress import MpiRequest

__all__ = ["Transport", "transport_for"]


class Transport:
    """``isend(buf, peer, tag)`` / ``irecv(buf, peer, tag)`` returning handles."""

    __slots__ = ("isend", "irecv", "lean")

    def __init__(self, backend):
        comm = getattr(backend, "comm", None)
        self.lean = (backend.kind is BackendKind.MPI and not backend.device
                     and comm is not None)
        if self.lean:
            from mpi4py import MPI

            byte, isend, irecv = MPI.BYTE, comm.Isend, comm.Irecv
            self.isend = lambda buf, peer, tag: MpiRequest(isend([buf, byte], peer, tag))
            self.irecv = lambda buf, peer, tag: MpiRequest(irecv([buf, byte], peer, tag))
        elif hasattr(backend, "post"):  # NCCL: posted, issued as one group (see its docs)
            post = backend.post
            self.isend = lambda buf, peer, tag: post("send", buf, peer)
            self.irecv = lambda buf, peer, tag: post("recv", buf, peer)
        else:
            send, recv = backend.send, backend.recv
            self.isend = lambda buf, peer, tag: send(buf, peer, tag=tag, async_op=True)
            self.irecv = lambda buf, peer, tag: recv(buf, peer, tag=tag, async_op=True)


def transport_for(backend) -> Transport:
    """The transport of a backend (kept in its group's state)."""
    from collectives.state import state_of

    transports = state_of(backend.group).transports
    found = transports.get(backend.kind)
    if found is None or found[0] is not backend:
        found = transports[backend.kind] = (backend, Transport(backend))
    return found[1]
