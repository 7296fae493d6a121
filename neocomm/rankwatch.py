"""The parent of one rank under ``neocomm run``: names the rank when it dies of a signal.

A rank killed by a signal (SIGKILL from the OOM killer or a user, SIGSEGV, SIGBUS) cannot
say so itself, and the MPI launcher often names another rank: the first peer whose
connection broke and that aborted. ``neocomm run`` therefore starts every rank as
``python -m neocomm.rankwatch CMD...``: this process starts ``CMD``, forwards the signals
it is sent, and when ``CMD`` dies of a signal that was not sent through it, prints which rank,
pid and host died of which signal, then ends by the same signal, so the MPI launcher sees
what it would have seen. The rank dies with it if it is killed itself (``PDEATHSIG``).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

#: signals passed on to the rank (the ones MPI launchers and users send)
FORWARD = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1",
                                                   "SIGUSR2", "SIGCONT", "SIGTSTP")
                if hasattr(signal, name))
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # in the child, before exec
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


#: the launcher's word for a rank's place on its host: (local rank, ranks on this host)
_LOCAL = (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
          ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


def _no_room_here() -> str | None:
    """On the first rank of each host: why this host has no room for its ranks (its
    /dev/shm or temporary directory full), or None. Every host checks its own, so a
    full /dev/shm on a remote host stops the job at once, naming that host."""
    for rank_key, size_key in _LOCAL:
        if os.environ.get(rank_key) is not None:
            if os.environ[rank_key] != "0":
                return None
            try:
                local = int(os.environ.get(size_key, "1"))
            except ValueError:
                local = 1
            from neocomm.launcher import NoRoomError, check_room

            try:
                check_room(local)
            except NoRoomError as exc:
                return str(exc)
            return None
    return None


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        sys.stderr.write("neocomm.rankwatch: nothing to run\n")
        return 2
    full = _no_room_here()
    if full:
        sys.stderr.write(f"neocomm run: cannot start the job on {socket.gethostname()}: "
                         f"{full}\n")
        return 1
    sent: list[int] = []
    try:
        proc = subprocess.Popen(argv, preexec_fn=_die_with_parent if sys.platform.startswith(
            "linux") else None)
    except OSError as exc:
        sys.stderr.write(f"neocomm run: cannot start {argv[0]!r} on {socket.gethostname()}: "
                         f"{exc.strerror or exc}; every host needs it at the same path "
                         f"(give its absolute path, or install it there)\n")
        return 127

    def forward(signum, frame):
        try:  # has it died already (what made the launcher signal us, perhaps)? Not reaped.
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                return
        except ChildProcessError:
            return
        sent.append(signum)
        try:
            os.kill(proc.pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARD:
        signal.signal(sig, forward)
    _, status = os.waitpid(proc.pid, 0)  # (retried after a forwarded signal)
    proc.returncode = 0  # reaped here: Popen must not try again
    if not os.WIFSIGNALED(status):
        return os.waitstatus_to_exitcode(status)
    sig = os.WTERMSIG(status)
    if sig not in sent:  # a signal nobody sent through us (the launcher's SIGCONT aside)
        from neocomm.logs import rank_from_env

        rank = rank_from_env()
        who = f"rank {rank}" if rank is not None else "a rank"
        sys.stderr.write(f"neocomm run: {who} (pid {proc.pid} on {socket.gethostname()}) "
                         f"died of {signal.Signals(sig).name}; the job ends\n")
        sys.stderr.flush()
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    return 128 + sig  # pragma: no cover - a signal that does not end a process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
