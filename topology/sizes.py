"""Sizes in bytes: one meaning for every command, setting and config file.

A size is a number with an optional unit; the units are powers of 1024, as
nccl-tests reads ``-b``/``-e``: ``K``, ``KB`` and ``KiB`` are 2^10 bytes,
``M``/``MB``/``MiB`` 2^20, ``G``/``GB``/``GiB`` 2^30, ``T``/``TB``/``TiB``
2^40 (``B`` or no unit: bytes). Case does not matter and a fraction is
allowed (``1.5K`` is 1536). So ``1MB``, ``1MiB``, ``1M`` and ``1048576`` are
the same size wherever a size is read.

It lives in the lowest layer so that every layer, and every layer's
commands, reads and writes sizes the same way.
"""
from __future__ import annotations

import argparse
import re

__all__ = ["KIB", "MIB", "GIB", "TIB", "UNITS", "parse_size", "size_arg", "size_or_zero_arg",
           "format_size"]

#: bytes in a KiB, MiB, GiB and TiB
KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
#: unit (lower case) -> bytes; every multiple is a power of 1024
UNITS = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB,
         "g": GIB, "gb": GIB, "gib": GIB, "t": TIB, "tb": TIB, "tib": TIB}

_PATTERN = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*")

_EXAMPLES = "a size such as 64K, 1M, 1MiB, 80GB or 1048576 (K, M, G, T: powers of 1024)"


def parse_size(text, *, zero: bool = False) -> int:
    """Bytes of ``text``: ``"64K"`` 65536, ``"1MB"`` = ``"1MiB"`` = ``"1M"`` = ``"1048576"``.

    ValueError naming the value as given for anything else, and for a size
    below one byte (zero is allowed with ``zero=True``).
    """
    m = _PATTERN.fullmatch(str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"expected {_EXAMPLES}, got {text!r}")
    value = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if value < 0 or (value == 0 and not zero):
        raise ValueError(f"expected a {'non-negative' if zero else 'positive'} size, "
                         f"got {text!r}")
    return value


def size_arg(text: str, *, zero: bool = False) -> int:
    """``type=`` of an argparse size argument: argparse names the argument in its error."""
    try:
        return parse_size(text, zero=zero)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_or_zero_arg(text: str) -> int:
    """As :func:`size_arg`, where 0 means "none"."""
    return size_arg(text, zero=True)


def format_size(n: float) -> str:
    """``512 bytes``, ``64 KiB``, ``1.7 MiB``, ``24.1 GiB``, ``2 TiB``: three significant digits."""
    for unit, scale in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.3g} {unit}"
    return f"{int(n)} bytes"
