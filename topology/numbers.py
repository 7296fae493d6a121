"""Positive numbers given by users: one rule for every layer and its commands.

A positive number is an int (or, where allowed, a float) greater than zero:
never a bool, never NaN. It lives in the lowest layer so that fabric specs,
the planner's arguments and every command's options read it the same way
(sizes in bytes have their own module, :mod:`topology.sizes`).
"""
from __future__ import annotations

import argparse

__all__ = ["is_positive", "positive_arg", "positive_float_arg"]


def is_positive(value, kind=(int, float)) -> bool:
    """True when ``value`` is a number of ``kind`` (never a bool) greater than zero."""
    return not isinstance(value, bool) and isinstance(value, kind) and value > 0


def positive_arg(name: str, value, kind=(int, float)):
    """``value`` when it is a positive number of ``kind`` (``int``, or by default int or
    float; never a bool); ValueError naming the argument ``name`` and the value otherwise."""
    if not is_positive(value, kind):
        what = "int" if kind is int else "number"
        raise ValueError(f"{name}: expected a positive {what}, got {value!r:.80}")
    return value


def positive_float_arg(text: str) -> float:
    """``type=`` of an argparse option taking a positive number (argparse names the option)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not is_positive(value):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value
