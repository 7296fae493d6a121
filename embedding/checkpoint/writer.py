"""Atomic, checksummed checkpoint writes from every rank.

Protocol for ``world_size`` ranks sharing a file system::

    every rank:  CheckpointWriter(root, step, rank, n).write(arrays, slices)
                 -> root/.tmp-step-<step>/rank-<r>/*.npy (+ part.json), each fsynced
    barrier
    rank 0:      writer.commit(plan=..., tables=..., state=...)
                 -> manifest.json and COMPLETE in the temp directory (fsynced),
                    then one rename to root/step-<step>
    barrier

A run killed at any point leaves either the previous checkpoints untouched
plus a ``.tmp-*`` directory that no reader considers, or the new checkpoint
complete. :func:`save_checkpoint` runs the protocol with an injected barrier.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from embedding.checkpoint.checksum import CHECKSUMS, Hasher, HashingFile, file_checksum
from embedding.checkpoint.reader import list_checkpoints
from embedding.checkpoint.types import (MANIFEST, MARKER, CheckpointError, FileRecord, Manifest,
                                        TensorSlice, manifest_version)

__all__ = ["CheckpointWriter", "save_checkpoint", "checkpoint_name", "prune", "file_checksum",
           "CHECKSUMS"]

_log = logging.getLogger(__name__)
_NAME = re.compile(r"^[A-Za-z0-9_.\-/]+$")
_PART = "part.json"


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint of ``step``: ``step-`` and 12 digits."""
    if int(step) < 0:
        raise ValueError(f"step: expected >= 0, got {step}")
    return f"step-{int(step):012d}"


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj) -> str:
    text = obj if isinstance(obj, str) else json.dumps(obj, indent=1)
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return text


class CheckpointWriter:
    """Writes one rank's part of the checkpoint of ``step`` under ``root``; rank 0 commits."""

    def __init__(self, root, step: int, rank: int = 0, world_size: int = 1, *,
                 checksum: str = "crc32"):
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank/world_size: expected 0 <= rank < world_size, got {rank}, "
                             f"{world_size}")
        if checksum not in CHECKSUMS:
            raise ValueError(f"checksum: expected one of {list(CHECKSUMS)}, got {checksum!r}")
        self.root = Path(root)
        self.step = int(step)
        self.rank, self.world_size = int(rank), int(world_size)
        self.checksum = checksum
        self.name = checkpoint_name(step)
        self.tmp = self.root / f".tmp-{self.name}"
        self.final = self.root / self.name

    def _rank_dir(self, rank: int) -> Path:
        return self.tmp / f"rank-{rank:05d}"

    def write(self, arrays: Mapping[str, np.ndarray],
              slices: Mapping[str, TensorSlice] | None = None) -> list[FileRecord]:
        """Write this rank's arrays (``name -> array``) and their records; fsync everything.

        ``slices[name]`` says which part of a global tensor ``arrays[name]``
        holds (embedding shards and their optimizer state); arrays without a
        slice are whole, rank-local or replicated (dense parameters, step
        counters). Names may contain letters, digits, ``_ . - /``.
        """
        slices = dict(slices or {})
        unknown = sorted(set(slices) - set(arrays))
        if unknown:
            raise ValueError(f"slices: names {unknown} are not in arrays")
        for name, arr in arrays.items():
            if not isinstance(name, str) or not _NAME.match(name) or ".." in name \
                    or name.startswith("/"):
                raise ValueError(f"arrays: name {name!r} must be letters, digits, '_.-/' "
                                 f"without '..' or a leading '/'")
            a = np.asarray(arr)
            if a.dtype.hasobject or a.dtype.kind not in "biuf":
                raise TypeError(f"arrays[{name!r}]: expected a numeric array, got {a.dtype}")
            if name in slices:
                slices[name].check_shape(a.shape, name)
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(exist_ok=True)
        rdir = self._rank_dir(self.rank)
        if rdir.exists():  # left over from a killed attempt at this step
            shutil.rmtree(rdir)
        rdir.mkdir()
        records = []
        for i, (name, arr) in enumerate(arrays.items()):
            a = np.require(arr, requirements='C')  # keeps 0-d arrays 0-d
            rel = f"{rdir.name}/{i:05d}-{name.replace('/', '.')}.npy"
            h = Hasher(self.checksum)
            with open(self.tmp / rel, "wb") as f:
                hf = HashingFile(f, h)
                np.lib.format.write_array(hf, a, allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            records.append(FileRecord(rel, self.rank, name, tuple(a.shape), a.dtype.str,
                                      hf.bytes, h.hexdigest(), slices.get(name)))
        _write_json(rdir / _PART, {"rank": self.rank, "step": self.step,
                                   "files": [r.to_dict() for r in records]})
        _fsync_dir(rdir)
        _fsync_dir(self.tmp)
        return records

    def commit(self, *, plan=None, tables=(), state: dict | None = None) -> Path:
        """Rank 0, after every rank's :meth:`write`: write the manifest and publish atomically."""
        if self.rank != 0:
            raise RuntimeError(f"commit: only rank 0 commits, this is rank {self.rank}")
        if not self.tmp.is_dir():
            raise CheckpointError("no rank has written this checkpoint", path=str(self.tmp))
        files: list[FileRecord] = []
        for r in range(self.world_size):
            part = self._rank_dir(r) / _PART
            try:
                d = json.loads(part.read_text())
            except FileNotFoundError:
                raise CheckpointError(f"rank {r} has not written its part (no {part.name}); "
                                      f"commit after every rank's write", path=str(self.tmp)
                                      ) from None
            if int(d["step"]) != self.step:
                raise CheckpointError(f"rank {r}'s part is for step {d['step']}",
                                      path=str(self.tmp))
            files += [FileRecord.from_dict(f) for f in d["files"]]
        for stray in self.tmp.glob("rank-*"):  # a larger world that wrote this step before
            if stray.is_dir() and int(stray.name.split("-")[1]) >= self.world_size:
                shutil.rmtree(stray)
        _check_global_shapes(files, str(self.tmp))
        try:
            json.dumps(state or {})
        except TypeError as exc:
            raise TypeError(f"state: expected JSON-serialisable values: {exc}") from None
        manifest = Manifest(step=self.step, world_size=self.world_size, files=tuple(files),
                            tables=tuple(tables), plan=plan, state=dict(state or {}),
                            created=time.time(), version=manifest_version(files))
        text = _write_json(self.tmp / MANIFEST, manifest.to_json())
        _write_json(self.tmp / MARKER, {"manifest_sha256": hashlib.sha256(
            text.encode()).hexdigest()})
        _fsync_dir(self.tmp)
        old = None
        if self.final.exists():
            old = self.root / f".old-{self.name}-{os.getpid()}"
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        _fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _log.info("checkpoint of step %d written to %s (%d files)", self.step, self.final,
                  len(files))
        return self.final


def _check_global_shapes(files: list[FileRecord], path: str) -> None:
    shapes: dict[tuple[str, str], tuple[int, ...]] = {}
    for f in files:
        if f.slice is None:
            continue
        key = (f.slice.table, f.slice.tensor)
        if shapes.setdefault(key, f.slice.global_shape) != f.slice.global_shape:
            raise CheckpointError(f"{key[0]}/{key[1]} is written with global shapes "
                                  f"{shapes[key]} and {f.slice.global_shape}", path=path)


def save_checkpoint(root, step: int, arrays: Mapping[str, np.ndarray],
                    slices: Mapping[str, TensorSlice] | None = None, *, rank: int = 0,
                    world_size: int = 1, barrier: Callable[[], None] | None = None,
                    plan=None, tables=(), state: dict | None = None,
                    checksum: str = "crc32") -> Path:
    """Write and publish the checkpoint of ``step``; every rank calls it.

    ``barrier`` synchronises the ranks (required when ``world_size > 1``);
    it is called twice. ``plan`` (:class:`~embedding.types.ShardingPlan`),
    ``tables`` and ``state`` go into the manifest. Returns the checkpoint's path.
    """
    if world_size > 1 and barrier is None:
        raise ValueError("barrier: required when world_size > 1")
    writer = CheckpointWriter(root, step, rank, world_size, checksum=checksum)
    writer.write(arrays, slices)
    if barrier is not None:
        barrier()
    if rank == 0:
        writer.commit(plan=plan, tables=tables, state=state)
    if barrier is not None:
        barrier()
    return writer.final


def prune(root, keep_last: int) -> list[Path]:
    """Remove all but the ``keep_last`` newest complete checkpoints, and stale temp dirs.

    A temp dir is stale when a complete checkpoint of a later or equal step
    exists. Returns the removed paths.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last: expected >= 1, got {keep_last}")
    root = Path(root)
    infos = list_checkpoints(root)
    complete = [i for i in infos if i.complete]
    removed = []
    for info in complete[:-keep_last]:
        shutil.rmtree(info.path)
        removed.append(info.path)
    if complete:
        newest = complete[-1].step
        for tmp in root.glob(".tmp-step-*"):
            try:
                step = int(tmp.name[len(".tmp-step-"):])
            except ValueError:
                continue
            if step <= newest:
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
    return removed
