"""Collectives on arrays of other kinds: the buffer protocol and DLPack (torch: its own file)."""
from __future__ import annotations

import array

import numpy as np
import pytest

import collectives as C
from neocomm import CollectiveArgumentError

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.layouts("1x2", why=(
    "a caller's array is converted before any exchange: one layout with a peer shows it"))]


class _DLPackOnly:
    """An array that offers DLPack only (as other libraries' arrays do)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_buffer_protocol_objects_are_filled_in_place(world, all_ranks):
    p = world.size
    send = array.array("d", [float(world.rank)] * p)
    recv = array.array("d", [0.0] * p)
    res = C.all_to_all(send, recv)
    raw = bytearray(np.arange(4, dtype=np.float32).tobytes())
    summed = C.all_reduce(memoryview(raw).cast("f"))
    ok = res is recv and list(recv) == [float(i) for i in range(p)]
    ok = ok and np.array_equal(np.frombuffer(raw, np.float32), np.arange(4) * p)
    all_ranks(ok and summed is not None, f"{recv} {np.frombuffer(raw, np.float32)}")


def test_dlpack_arrays_are_read_without_a_copy(world, all_ranks):
    a = np.arange(6, dtype=np.float64) + world.rank
    got = C.all_gather(_DLPackOnly(a))
    want = np.stack([np.arange(6, dtype=np.float64) + r for r in range(world.size)])
    all_ranks(isinstance(got, np.ndarray) and np.array_equal(got, want), f"{got}")


def test_a_read_only_buffer_as_recvbuf_is_refused_on_every_rank(world, all_ranks):
    send = np.ones(world.size, np.float64)
    recv = bytes(8 * world.size) if world.rank == 0 else np.empty(world.size)
    with pytest.raises(CollectiveArgumentError) as info:
        C.all_to_all(send, recv)
    msg = str(info.value)
    all_ranks("recvbuf" in msg and "read-only" in msg and "rank 0" in msg, msg)
