"""Checksums of checkpoint files: ``"<algorithm>:<hex>"`` strings, CRC-32 or SHA-256."""
from __future__ import annotations

import hashlib
import zlib

__all__ = ["CHECKSUMS", "Hasher", "HashingFile", "file_checksum"]

#: the checksum algorithms a checkpoint's files may carry
CHECKSUMS = ("crc32", "sha256")


class Hasher:
    """Incremental checksum of one algorithm; :meth:`hexdigest` is ``"<algorithm>:<hex>"``."""

    def __init__(self, algorithm: str):
        if algorithm not in CHECKSUMS:
            raise ValueError(f"checksum: expected one of {list(CHECKSUMS)}, got {algorithm!r}")
        self.algorithm = algorithm
        self._crc = 0
        self._sha = hashlib.sha256() if algorithm == "sha256" else None

    def update(self, data) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        digest = self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"
        return f"{self.algorithm}:{digest}"


class HashingFile:
    """A write-only file wrapper that hashes what passes through (np.save writes via .write)."""

    def __init__(self, f, hasher: Hasher):
        self._f, self._h, self.bytes = f, hasher, 0

    def write(self, data) -> int:
        self._h.update(data)
        self.bytes += len(memoryview(data).cast("B"))
        return self._f.write(data)


def file_checksum(path, algorithm: str = "crc32", block: int = 16 << 20) -> str:
    """``"<algorithm>:<hex>"`` of the whole file at ``path``, read in blocks of ``block`` bytes."""
    h = Hasher(algorithm)
    with open(path, "rb") as f:
        while True:
            data = f.read(block)
            if not data:
                return h.hexdigest()
            h.update(data)
