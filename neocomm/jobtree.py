"""The processes and shared-memory files of a job that ``neocomm run`` started.

:class:`JobTree` finds every process the job started (walking /proc from the
launching process, a sub-reaper on Linux), signals the whole tree, and removes the
/dev/shm files the job left behind; :func:`neocomm.launcher.launch` drives it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["JobTree", "become_subreaper", "shm_names", "SHM_DIR"]

SHM_DIR = "/dev/shm"
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux): ranks whose
    launcher died are re-parented here, not to init, and stay in the tracked tree."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - no prctl
        return False


def _stat(pid: int) -> tuple[int, int, str] | None:
    """``(parent pid, start time, state)`` of ``pid`` from /proc, or None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[19]), fields[0]


class JobTree:
    """Every process the job started, tracked by pid and start time (a pid reused by an
    unrelated process is never signalled), found by walking /proc from this process."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.me = os.getpid()
        self.seen: dict[int, int] = {}  # pid -> start time
        self.has_proc = os.path.isdir("/proc")

    def refresh(self) -> None:
        if not self.has_proc:
            return
        children: dict[int, list[tuple[int, int]]] = {}  # parent -> [(pid, start time)]
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = _stat(int(entry))
                if st is not None:
                    children.setdefault(st[0], []).append((int(entry), st[1]))
        stack = [self.me]
        while stack:
            for child, start in children.get(stack.pop(), ()):
                self.seen.setdefault(child, start)
                stack.append(child)
        self._reap()

    def _reap(self) -> None:
        """Collect orphans re-parented to this process (never the launcher itself:
        ``Popen.wait`` reads its status)."""
        for pid in list(self.seen):
            if pid == self.proc.pid:
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def alive(self) -> list[int]:
        out = []
        for pid, start in self.seen.items():
            st = _stat(pid)
            if st is not None and st[1] == start and st[2] not in ("Z", "X"):
                out.append(pid)
        return out

    def outliving(self, grace: float) -> list[int]:
        """After the launcher has exited: the ranks of this host (processes under
        :mod:`neocomm.rankwatch`) still alive ``grace`` seconds later. Other processes
        of the job, such as the remote shells that started the launcher's daemons on
        other hosts, may take a moment to end after it and are not ranks."""
        end = time.monotonic() + grace
        while True:
            self.refresh()
            ranks = [pid for pid in self.alive() if _is_rank(pid)]
            if not ranks or time.monotonic() >= end:
                return ranks
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        if not self.has_proc:  # pragma: no cover - no /proc: the launcher's session
            try:
                os.killpg(self.proc.pid, sig)
            except OSError:
                pass
            return
        for pid in self.alive():
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def stop(self, sig: int, grace: float) -> None:
        """Send ``sig`` to the whole tree; SIGKILL what is left after ``grace`` seconds."""
        self.refresh()
        self.signal(sig)
        end = time.monotonic() + grace
        while time.monotonic() < end:
            self.refresh()
            if self.proc.poll() is not None and not self.alive():
                self._reap()  # those that turned zombie after refresh's reap
                return
            time.sleep(0.05)
        self.refresh()
        self.signal(signal.SIGKILL)
        for _ in range(100):
            self.refresh()
            if not self.alive():
                break
            time.sleep(0.02)
        self._reap()

    def remove_shared_memory(self, before: set[str]) -> list[str]:
        """Remove the /dev/shm files the job left behind: neocomm's (``neocomm-<pid>-*``
        of a pid of the job: see :mod:`collectives.symmetric`) and the MPI library's
        shared-memory segments that appeared during the job (not in ``before``) and
        that no process maps any more (a job killed mid-run cannot remove its own)."""
        removed = []
        try:
            names = set(os.listdir(SHM_DIR))
        except OSError:
            return removed
        pids = set(self.seen)
        ours = {n for n in names if _shm_owner(n) in pids}
        mpi = {n for n in names - before if n.startswith(_MPI_SEGMENTS)}
        if mpi:
            mpi -= _mapped_shm()
        for name in sorted(ours | mpi):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
        return removed


def _is_rank(pid: int) -> bool:
    """Whether ``pid`` is a rank's watcher (or the rank it runs) on this host."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            words = fh.read().split(b"\0")
    except OSError:
        return False
    if b"neocomm.rankwatch" in words:
        return True
    parent = _stat(pid)
    if parent is None or parent[0] <= 1:
        return False
    try:
        with open(f"/proc/{parent[0]}/cmdline", "rb") as fh:
            return b"neocomm.rankwatch" in fh.read().split(b"\0")
    except OSError:
        return False


#: name prefixes of MPI libraries' shared-memory segments in /dev/shm (Open MPI's sm/vader)
_MPI_SEGMENTS = ("sm_segment.", "vader_segment.")


def _shm_owner(name: str) -> int | None:
    parts = name.split("-")
    if len(parts) >= 3 and parts[0] == "neocomm" and parts[1].isdigit():
        return int(parts[1])
    return None


def shm_names() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def _mapped_shm() -> set[str]:
    """Names of the /dev/shm files some process maps now (from /proc/*/maps)."""
    out = set()
    prefix = SHM_DIR + "/"
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps", "rb") as fh:
                for line in fh:
                    i = line.find(prefix.encode())
                    if i >= 0:
                        out.add(line[i + len(prefix):].split(b" ")[0].strip().decode(
                            errors="replace"))
        except OSError:
            continue
    return out
