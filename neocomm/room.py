"""Room on a file system: free bytes, a write that proves a directory takes data, and
sizes as people read them. Used by the launcher's and the trainer's start-up checks."""
from __future__ import annotations

import os
import tempfile

__all__ = ["free_bytes", "probe_write"]


def free_bytes(path) -> int:
    """Bytes an unprivileged process may still write on the file system of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def probe_write(path, nbytes: int) -> None:
    """Write ``nbytes`` to a new file in directory ``path`` and remove it; OSError (full,
    read-only, over quota, not permitted) when that cannot be done."""
    fd, name = tempfile.mkstemp(prefix=".neocomm-probe-", dir=path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(bytes(nbytes))
    finally:
        os.unlink(name)
