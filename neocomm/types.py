"""Vocabulary of the runtime core: reduce ops, backend kinds, dtypes."""
from __future__ import annotations

import enum
import re

import numpy as np

__all__ = ["ReduceOp", "REDUCE_CODES", "BackendKind", "GroupKind", "DTYPE_CODES", "dtype_code",
           "dtype_from_code", "bfloat16", "SUPPORTED_DTYPES", "REDUCIBLE_DTYPES", "HALF_DTYPES",
           "is_half", "check_array_bfloat16",
           "CUPY_BF16_MIN_NUMPY"]


class ReduceOp(enum.Enum):
    """Element-wise reduction of a collective."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    @classmethod
    def parse(cls, value: "ReduceOp | str") -> "ReduceOp":
        """Accept a ReduceOp or its name (case-insensitive); ValueError otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.lower())
            except ValueError:
                pass
        raise ValueError(f"op: expected one of {[o.value for o in cls]}, got {value!r}")


#: Stable numbers of the reduce ops in agreement signatures.
REDUCE_CODES = {op: i for i, op in enumerate(ReduceOp, start=1)}


class BackendKind(enum.Enum):
    """Which transport moves the bytes."""

    MPI = "mpi"        # host buffers through mpi4py
    NCCL = "nccl"      # device buffers through cupy.cuda.nccl
    STAGED = "staged"  # device buffers through pinned host buffers and MPI


class GroupKind(enum.Enum):
    """What a process group spans."""

    WORLD = "world"
    INTRA_NODE = "intra_node"
    RAIL = "rail"
    SUB = "sub"


def __getattr__(name: str):
    """``bfloat16``: the NumPy dtype of ``ml_dtypes`` (None without the package), looked up
    at first use: importing ml_dtypes costs about half a second, which every process of a
    job would otherwise pay at start-up, bfloat16 or not."""
    if name != "bfloat16":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from ml_dtypes import bfloat16 as _bf16
    except ImportError:  # pragma: no cover - depends on the environment
        dtype = None
    else:
        dtype = np.dtype(_bf16)
    globals()["bfloat16"] = dtype
    return dtype

#: dtypes every backend moves and reduces. Codes are stable across ranks
#: and versions: they travel in argument-agreement messages.
DTYPE_CODES: dict[str, int] = {
    "float16": 1, "bfloat16": 2, "float32": 3, "float64": 4,
    "int8": 5, "uint8": 6, "int32": 7, "int64": 8, "uint32": 9, "uint64": 10,
    "int16": 11, "uint16": 12, "bool": 13,
}
_CODE_NAMES = {v: k for k, v in DTYPE_CODES.items()}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(DTYPE_CODES)
#: the dtypes a reduction takes: every supported dtype but bool
REDUCIBLE_DTYPES: frozenset[str] = frozenset(SUPPORTED_DTYPES) - {"bool"}
#: the 2-byte float types: reduced, and computed on in tables, through float32
HALF_DTYPES: tuple[str, ...] = ("float16", "bfloat16")


def is_half(dtype) -> bool:
    """Whether ``dtype`` is float16 or bfloat16."""
    return np.dtype(dtype).name in HALF_DTYPES


def dtype_code(dtype) -> int:
    """The stable wire code of ``dtype``; TypeError for unsupported dtypes."""
    try:
        return DTYPE_CODES[np.dtype(dtype).name]
    except (KeyError, TypeError):
        raise TypeError(f"dtype: expected one of {list(DTYPE_CODES)}, got {dtype!r:.80}") from None


def dtype_from_code(code: int) -> str:
    """Name of the dtype with wire code ``code``."""
    return _CODE_NAMES.get(int(code), f"<unknown dtype code {code}>")


#: The first NumPy release with which CuPy 14 registers its bfloat16 kernels (CuPy's bfloat16
#: is ``ml_dtypes``'s, whose NumPy hooks it needs; with an older NumPy it has no bfloat16).
CUPY_BF16_MIN_NUMPY = (2, 1, 2)


def _release(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a version string, one patch lower for a pre-release or
    development build of it (``"2.1.2rc1"`` comes before 2.1.2); None when unreadable."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?(.*)", str(version))
    if m is None:
        return None
    major, minor, patch = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    if re.match(r"\.?(a|b|rc|dev|alpha|beta|pre)", m.group(4) or "", re.IGNORECASE):
        return (major, minor, patch - 1) if patch else (major, minor - 1, 999) if minor \
            else (major - 1, 999, 999)
    return major, minor, patch


def check_array_bfloat16(xp, what: str) -> None:
    """ValueError naming ``what`` (the user's setting) when the array module ``xp`` cannot
    hold bfloat16 arrays: NumPy needs ``ml_dtypes``; CuPy needs version 14 or later (its
    bfloat16 is ``ml_dtypes``'s; CuPy 13 and older refuse the dtype) together with NumPy
    2.1.2 or later (:data:`CUPY_BF16_MIN_NUMPY`: CuPy registers its bfloat16 kernels only
    then)."""
    if __getattr__("bfloat16") is None:
        raise ValueError(f"{what}: bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
    if xp is np:
        return
    version = str(getattr(xp, "__version__", "0"))
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major < 14:
        raise ValueError(f"{what}: bfloat16 on CuPy arrays needs CuPy 14 or later (bfloat16 "
                         f"through ml_dtypes); CuPy {version} is installed: use float16 or "
                         f"upgrade CuPy (pip install 'cupy-cuda12x>=14')")
    have = _release(np.__version__)
    if have is None or have < CUPY_BF16_MIN_NUMPY:
        need = ".".join(map(str, CUPY_BF16_MIN_NUMPY))
        raise ValueError(f"{what}: bfloat16 on CuPy arrays needs NumPy {need} or later (CuPy "
                         f"{version} registers its bfloat16 kernels only with it); NumPy "
                         f"{np.__version__} is installed: use float16 or upgrade NumPy "
                         f"(pip install 'numpy>={need}')")
