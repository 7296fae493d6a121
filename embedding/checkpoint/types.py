"""Vocabulary of checkpoints: the manifest, its file records, tensor slices, errors.

A checkpoint is a directory ``step-<step>`` holding one sub-directory per
rank with ``.npy`` files (no pickle), ``manifest.json`` and the marker
``COMPLETE``. The manifest is plain JSON; every dataclass here round-trips
through :meth:`to_dict` / :meth:`from_dict`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from embedding.types import ShardingPlan, TableConfig
from neocomm.errors import NeocommError

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "MARKER", "TensorSlice", "FileRecord",
           "Manifest", "CheckpointError", "ChecksumError", "CheckpointMismatchError",
           "manifest_version"]

FORMAT = "neocomm-checkpoint"
#: The newest manifest version this code reads and writes. Version 2 adds strided tensor
#: slices (cyclic row-wise shards); a checkpoint without them is written as version 1,
#: which readers that predate strides read as before.
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
MARKER = "COMPLETE"


class CheckpointError(NeocommError, ValueError):
    """A checkpoint cannot be used; ``path`` says which, the message says why."""

    def __init__(self, message: str, *, path: str = ""):
        super().__init__(f"{path}: {message}" if path else message)
        self.path = str(path)
        self.reason = message


class ChecksumError(CheckpointError):
    """A file's bytes do not match the checksum its manifest records (``file``)."""

    def __init__(self, message: str, *, path: str = "", file: str = ""):
        super().__init__(message, path=path)
        self.file = file


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model it is loaded into; ``field`` names what differs."""

    def __init__(self, message: str, *, path: str = "", field: str = ""):
        super().__init__(message, path=path)
        self.field = field


@dataclass(frozen=True)
class TensorSlice:
    """Which part of a global tensor (``table``'s ``tensor``) an array holds.

    The array's element ``i`` is the global element ``offset + i * stride``
    (per dimension) of a tensor of ``global_shape``: for an embedding shard
    of rows ``[r, r + n)`` and columns ``[c, c + m)`` of a ``R x D`` table,
    ``offset = (r, c)``, ``stride = (1, 1)`` and ``global_shape = (R, D)``;
    a cyclic row-wise shard of rows ``k, k + N, …`` has ``offset = (k, 0)``
    and ``stride = (N, 1)``. Per-row optimizer state is 1-D: ``offset =
    (r,)``, ``global_shape = (R,)``. ``stride`` defaults to all ones.
    """

    table: str
    tensor: str
    offset: tuple[int, ...]
    global_shape: tuple[int, ...]
    stride: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "offset", tuple(int(x) for x in self.offset))
        object.__setattr__(self, "global_shape", tuple(int(x) for x in self.global_shape))
        object.__setattr__(self, "stride", tuple(int(x) for x in self.stride)
                           or (1,) * len(self.global_shape))
        if not self.table or not self.tensor:
            raise ValueError("table/tensor: a tensor slice needs a table and a tensor name")
        if len(self.offset) != len(self.global_shape):
            raise ValueError(f"offset: expected {len(self.global_shape)} coordinates for global "
                             f"shape {self.global_shape}, got {self.offset}")
        if len(self.stride) != len(self.global_shape) or any(s < 1 for s in self.stride):
            raise ValueError(f"stride: expected {len(self.global_shape)} steps >= 1 for global "
                             f"shape {self.global_shape}, got {self.stride}")

    @property
    def strided(self) -> bool:
        """Some dimension steps by more than one element."""
        return any(s != 1 for s in self.stride)

    def check_shape(self, shape: tuple[int, ...], name: str) -> None:
        """ValueError unless an array of ``shape`` fits inside the global tensor at ``offset``
        with ``stride``."""
        if len(shape) != len(self.global_shape) or any(
                o < 0 or n < 0 or (n and o + (n - 1) * st >= g)
                for o, n, st, g in zip(self.offset, shape, self.stride, self.global_shape)):
            step = f" with stride {self.stride}" if self.strided else ""
            raise ValueError(f"slices[{name!r}]: an array of shape {tuple(shape)} at offset "
                             f"{self.offset}{step} does not fit in {self.table}/{self.tensor} "
                             f"of shape {self.global_shape}")

    def to_dict(self) -> dict:
        """The slice as JSON; ``stride`` only when some step is not 1."""
        d = {"table": self.table, "tensor": self.tensor, "offset": list(self.offset),
             "global_shape": list(self.global_shape)}
        if self.strided:
            d["stride"] = list(self.stride)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSlice":
        return cls(d["table"], d["tensor"], tuple(d["offset"]), tuple(d["global_shape"]),
                   tuple(d.get("stride") or ()))


def manifest_version(files) -> int:
    """The manifest version a checkpoint of ``files`` (:class:`FileRecord`) is written as:
    :data:`FORMAT_VERSION` when a slice is strided, else 1."""
    strided = any(f.slice is not None and f.slice.strided for f in files)
    return FORMAT_VERSION if strided else 1


@dataclass(frozen=True)
class FileRecord:
    """One ``.npy`` file of a checkpoint: whose, what, how big and its checksum.

    ``path`` is relative to the checkpoint directory; ``checksum`` is
    ``"<algorithm>:<hex digest>"`` (``crc32`` or ``sha256``) of the whole file.
    """

    path: str
    rank: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    checksum: str
    slice: TensorSlice | None = None

    def to_dict(self) -> dict:
        return {"path": self.path, "rank": self.rank, "name": self.name,
                "shape": list(self.shape), "dtype": self.dtype, "bytes": self.bytes,
                "checksum": self.checksum,
                "slice": self.slice.to_dict() if self.slice is not None else None}

    @classmethod
    def from_dict(cls, d: dict) -> "FileRecord":
        sl = d.get("slice")
        return cls(d["path"], int(d["rank"]), d["name"], tuple(int(x) for x in d["shape"]),
                   d["dtype"], int(d["bytes"]), d["checksum"],
                   TensorSlice.from_dict(sl) if sl else None)


@dataclass(frozen=True)
class Manifest:
    """Everything a loader needs to know before touching a file.

    ``state`` is free JSON from the trainer: RNG states, the data reader's
    position, hyper-parameters.
    """

    step: int
    world_size: int
    files: tuple[FileRecord, ...]
    tables: tuple[TableConfig, ...] = ()
    plan: ShardingPlan | None = None
    state: dict = field(default_factory=dict)
    created: float = 0.0
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        d = {"format": FORMAT, "version": self.version, "step": self.step,
             "world_size": self.world_size, "created": self.created,
             "plan": json.loads(self.plan.to_json()) if self.plan is not None else None,
             "tables": [t.to_dict() for t in self.tables], "state": self.state,
             "files": [f.to_dict() for f in self.files]}
        return json.dumps(d, indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str, path: str = "") -> "Manifest":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"manifest is not valid JSON: {exc}", path=path) from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            got = d.get("format") if isinstance(d, dict) else None
            raise CheckpointError(f"manifest format is {got!r}, expected {FORMAT!r}", path=path)
        if int(d.get("version", -1)) not in range(1, FORMAT_VERSION + 1):
            raise CheckpointError(f"manifest version {d.get('version')} is not supported (this "
                                  f"reader knows 1 to {FORMAT_VERSION})", path=path)
        try:
            plan = (ShardingPlan.from_json(json.dumps(d["plan"])) if d.get("plan") else None)
            return cls(step=int(d["step"]), world_size=int(d["world_size"]),
                       files=tuple(FileRecord.from_dict(f) for f in d["files"]),
                       tables=tuple(TableConfig.from_dict(t) for t in d.get("tables", ())),
                       plan=plan, state=dict(d.get("state") or {}),
                       created=float(d.get("created", 0.0)), version=int(d["version"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"manifest is malformed: {type(exc).__name__}: {exc}",
                                  path=path) from None

    def table(self, name: str) -> TableConfig | None:
        for t in self.tables:
            if t.name == name:
                return t
        return None
