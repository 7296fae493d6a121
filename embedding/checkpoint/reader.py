"""Finding, verifying and loading checkpoints, and checking them against a model.

``latest_checkpoint(root)`` is the newest *complete* checkpoint: a directory
``step-<step>`` whose ``COMPLETE`` marker records the SHA-256 of its
manifest. Temp directories and directories without a valid marker are
skipped. Opening a :class:`Checkpoint` parses the manifest; each file's
checksum is verified the first time it is read (or all at once with
:meth:`Checkpoint.verify`), and a bad file is refused with its name.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from embedding.checkpoint.checksum import file_checksum
from embedding.checkpoint.types import (MANIFEST, MARKER, CheckpointError,
                                        CheckpointMismatchError, ChecksumError, FileRecord,
                                        Manifest)

__all__ = ["CheckpointInfo", "list_checkpoints", "latest_checkpoint", "Checkpoint",
           "load_checkpoint", "FileStatus"]

_log = logging.getLogger(__name__)
_DIR = re.compile(r"^step-(\d{12})$")


@dataclass(frozen=True)
class CheckpointInfo:
    """A ``step-*`` directory under a root and whether its marker completes it (``why`` not)."""

    step: int
    path: Path
    complete: bool
    why: str = ""


def _marker_problem(path: Path) -> str:
    """Empty when ``path`` is a complete checkpoint, else why not."""
    for name in (MARKER, MANIFEST):
        why = _link_problem(path, name) if (path / name).exists() or \
            (path / name).is_symlink() else None
        if why:
            return why
    try:
        marker = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return f"no {MARKER} marker (an interrupted write)"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"the {MARKER} marker is unreadable"
    try:
        text = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        return f"no {MANIFEST}"
    if not isinstance(marker, dict) or marker.get("manifest_sha256") != \
            hashlib.sha256(text).hexdigest():
        return f"{MANIFEST} does not match the hash in {MARKER}"
    return ""


def _link_problem(root: Path, rel: str) -> str | None:
    """Why file ``rel`` of checkpoint ``root`` must not be read: a symbolic link on its way
    (a checkpoint holds regular files only) or a path that resolves outside ``root``."""
    here = root
    for part in Path(rel).parts:
        here = here / part
        if here.is_symlink():
            return (f"file {rel} of the checkpoint is a symbolic link ({here} -> "
                    f"{os.readlink(here)}); a checkpoint holds regular files only, "
                    f"refusing to load it")
    try:
        inside = (root / rel).resolve().is_relative_to(root.resolve())
    except OSError:
        inside = False
    if not inside:
        return f"file {rel} resolves outside the checkpoint directory; refusing to load it"
    return None


def list_checkpoints(root) -> list[CheckpointInfo]:
    """Every ``step-*`` directory under ``root``, oldest step first, with its completeness."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _DIR.match(p.name)
        if m and p.is_dir():
            why = _marker_problem(p)
            out.append(CheckpointInfo(int(m.group(1)), p, not why, why))
    return sorted(out, key=lambda i: i.step)


def latest_checkpoint(root) -> Path | None:
    """The newest complete checkpoint under ``root`` (None when there is none)."""
    for info in reversed(list_checkpoints(root)):
        if info.complete:
            return info.path
        _log.warning("skipping incomplete checkpoint %s: %s", info.path, info.why)
    return None


@dataclass(frozen=True)
class FileStatus:
    """Verification of one file: ``status`` is ok, missing, bad-size or bad-checksum."""

    record: FileRecord
    status: str
    actual: str = ""


class Checkpoint:
    """A complete checkpoint directory, opened for reading.

    ``verify`` (default True) checks each file's checksum before its first
    read. Reads go through ``np.load(mmap_mode="r", allow_pickle=False)``,
    so a slice of a file costs only the bytes it covers (plus the one-off
    checksum pass).
    """

    def __init__(self, path, *, verify: bool = True):
        self.path = Path(path)
        why = _marker_problem(self.path)
        if why:
            raise CheckpointError(f"not a complete checkpoint: {why}", path=str(self.path))
        self.manifest = Manifest.from_json((self.path / MANIFEST).read_text(), str(self.path))
        self.verify_reads = bool(verify)
        self._verified: set[str] = set()
        self._by_name: dict[str, list[FileRecord]] = {}
        for rec in self.manifest.files:
            if ".." in Path(rec.path).parts or Path(rec.path).is_absolute():
                raise CheckpointError(f"manifest names a file outside the checkpoint: "
                                      f"{rec.path!r}", path=str(self.path))
            why = _link_problem(self.path, rec.path)
            if why:
                raise CheckpointError(why, path=str(self.path))
            self._by_name.setdefault(rec.name, []).append(rec)

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def state(self) -> dict:
        return self.manifest.state

    # ------------------------------------------------------------ verifying
    def check_file(self, rec: FileRecord) -> FileStatus:
        """Verify one file's size and checksum (no exception)."""
        p = self.path / rec.path
        if not p.is_file():
            return FileStatus(rec, "missing")
        if p.stat().st_size != rec.bytes:
            return FileStatus(rec, "bad-size", f"{p.stat().st_size} bytes")
        algorithm = rec.checksum.split(":", 1)[0]
        try:
            actual = file_checksum(p, algorithm)
        except ValueError:
            return FileStatus(rec, "bad-checksum", f"unknown algorithm {algorithm!r}")
        return FileStatus(rec, "ok" if actual == rec.checksum else "bad-checksum", actual)

    def verify(self) -> list[FileStatus]:
        """Check every file; the per-file results (use :meth:`verify_or_raise` to refuse)."""
        out = [self.check_file(rec) for rec in self.manifest.files]
        self._verified.update(s.record.path for s in out if s.status == "ok")
        return out

    def verify_or_raise(self, records: Iterable[FileRecord] | None = None) -> None:
        """Raise :class:`ChecksumError` for the first bad file of ``records`` (all by default)."""
        for rec in (self.manifest.files if records is None else records):
            if rec.path in self._verified:
                continue
            st = self.check_file(rec)
            if st.status != "ok":
                detail = {"missing": "is missing",
                          "bad-size": f"has {st.actual}, the manifest records {rec.bytes}",
                          "bad-checksum": f"has checksum {st.actual}, the manifest records "
                                          f"{rec.checksum}"}[st.status]
                raise ChecksumError(f"file {rec.path} ({rec.name!r} of rank {rec.rank}) "
                                    f"{detail}; refusing to load it", path=str(self.path),
                                    file=rec.path)
            self._verified.add(rec.path)

    # ------------------------------------------------------------- reading
    def open_array(self, rec: FileRecord) -> np.ndarray:
        """The array of ``rec``, memory-mapped read-only, after verification."""
        if self.verify_reads:
            self.verify_or_raise([rec])
        try:
            arr = np.load(self.path / rec.path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise CheckpointError(f"file {rec.path} is not a readable .npy file: {exc}",
                                  path=str(self.path)) from None
        if tuple(arr.shape) != rec.shape or arr.dtype.str != rec.dtype:
            raise CheckpointError(f"file {rec.path} holds {arr.dtype.str} {arr.shape}, the "
                                  f"manifest records {rec.dtype} {rec.shape}",
                                  path=str(self.path))
        return arr

    def names(self) -> list[str]:
        """Names of the arrays in the checkpoint (each may be held by several ranks)."""
        return list(self._by_name)

    def read_array(self, name: str, rank: int | None = None) -> np.ndarray:
        """The whole array ``name``: written by ``rank``, or by the lowest rank that wrote it."""
        recs = self._by_name.get(name)
        if not recs:
            raise KeyError(f"array {name!r} is not in checkpoint {self.path}")
        if rank is not None:
            recs = [r for r in recs if r.rank == rank]
            if not recs:
                raise KeyError(f"rank {rank} did not write {name!r} in checkpoint {self.path}")
        rec = min(recs, key=lambda r: r.rank)
        return np.array(self.open_array(rec))

    def tensors(self) -> dict[tuple[str, str], tuple[tuple[int, ...], str]]:
        """``(table, tensor) -> (global shape, dtype)`` of every sliced tensor."""
        out = {}
        for rec in self.manifest.files:
            if rec.slice is not None:
                out.setdefault((rec.slice.table, rec.slice.tensor),
                               (rec.slice.global_shape, rec.dtype))
        return out

    # ---------------------------------------------------------- model check
    def check_compatible(self, tables: Iterable | None = None,
                         arrays: Mapping[str, tuple] | None = None) -> None:
        """Refuse, with :class:`CheckpointMismatchError`, a checkpoint that does not fit the model.

        ``tables``: the model's :class:`~embedding.types.TableConfig` list;
        names, rows, dims and dtypes must match the manifest and each
        table's ``weight`` slices. ``arrays``: ``name -> (shape, dtype)`` of
        whole arrays the model will load (dense parameters, optimizer state).
        """
        p = str(self.path)
        if tables is not None:
            model = {t.name: t for t in tables}
            saved = {t.name: t for t in self.manifest.tables}
            if set(model) != set(saved):
                raise CheckpointMismatchError(
                    f"tables differ: the checkpoint has {sorted(set(saved) - set(model)) or 'no'} "
                    f"extra and lacks {sorted(set(model) - set(saved)) or 'no'} tables of the "
                    f"model", path=p, field="tables")
            tensors = self.tensors()
            for name, t in model.items():
                s = saved[name]
                for fld in ("num_rows", "dim"):  # any float dtype loads, rounded to nearest
                    if getattr(s, fld) != getattr(t, fld):
                        raise CheckpointMismatchError(
                            f"table {name!r}: {fld} is {getattr(s, fld)} in the checkpoint, "
                            f"{getattr(t, fld)} in the model", path=p, field=f"{name}.{fld}")
                if getattr(s, "dynamic", False) != t.dynamic:
                    raise CheckpointMismatchError(
                        f"table {name!r}: dynamic is {s.dynamic} in the checkpoint, "
                        f"{t.dynamic} in the model", path=p, field=f"{name}.dynamic")
                if t.dynamic:  # entries by id, not weight slices (embedding.train.state)
                    continue
                w = tensors.get((name, "weight"))
                if w is None:
                    raise CheckpointMismatchError(f"table {name!r}: no weight shards in the "
                                                  f"checkpoint", path=p, field=f"{name}.weight")
                if w[0] != (t.num_rows, t.dim) or np.dtype(w[1]).kind != "f":
                    raise CheckpointMismatchError(
                        f"table {name!r}: weight shards are {np.dtype(w[1]).name} {w[0]}, the "
                        f"model has {t.dtype} {(t.num_rows, t.dim)}", path=p,
                        field=f"{name}.weight")
        for name, (shape, dtype) in (arrays or {}).items():
            recs = self._by_name.get(name)
            if not recs:
                raise CheckpointMismatchError(f"array {name!r} of the model is not in the "
                                              f"checkpoint", path=p, field=name)
            rec = recs[0]
            if rec.shape != tuple(shape) or np.dtype(rec.dtype) != np.dtype(dtype):
                raise CheckpointMismatchError(
                    f"array {name!r}: {np.dtype(rec.dtype).name} {rec.shape} in the checkpoint, "
                    f"the model expects {np.dtype(dtype).name} {tuple(shape)}", path=p,
                    field=name)


def load_checkpoint(path_or_root, *, verify: bool = True) -> Checkpoint:
    """Open a checkpoint directory, or the newest complete one under a root directory."""
    p = Path(path_or_root)
    if (p / MANIFEST).exists() or _DIR.match(p.name):
        return Checkpoint(p, verify=verify)
    latest = latest_checkpoint(p)
    if latest is None:
        refused = [f"{c.path.name}: {c.why}" for c in list_checkpoints(p) if c.why]
        raise CheckpointError("no complete checkpoint here" + (
            f" ({'; '.join(refused)})" if refused else ""), path=str(p))
    return Checkpoint(latest, verify=verify)
