"""What a finished command left in /dev/shm, on a host that other jobs may share."""
from __future__ import annotations

import os

SHM = "/dev/shm"


def _held() -> set[str]:
    """The /dev/shm files some live process maps or holds open."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as fh:
                held.update(line.split(None, 5)[5].strip() for line in fh
                            if f" {SHM}/" in line and len(line.split(None, 5)) == 6)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM + "/"):
                    held.add(target)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return {os.path.basename(path.removesuffix(" (deleted)")) for path in held}


def left_since(before: set[str]) -> list[str]:
    """Files that appeared in /dev/shm since ``before`` (``os.listdir`` of it) and that no
    live process holds: what a command that has ended left behind. A file still held
    belongs to a job still running beside it (its launcher removes it at the end)."""
    new = set(os.listdir(SHM)) - before
    return sorted(new - _held()) if new else []
