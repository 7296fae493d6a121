"""The NCCL stand-in enforces NCCL's rules across ranks: each rule is shown broken.

Run under mpirun (``--with-mpi``) at 2 and 4 ranks. Each test makes its own
communicator, so a failure (which aborts a communicator) stays in its test.
"""
from __future__ import annotations

import pytest

import cupy as cp

pytestmark = [pytest.mark.mpi(min_size=2),
              pytest.mark.skipif(not getattr(cp, "STANDIN", False),
                                 reason="checks the device stand-in itself; a real GPU is in use")]


def _comm(world):
    from cupy.cuda import nccl

    uid = nccl.get_unique_id() if world.rank == 0 else None
    return nccl.NcclCommunicator(world.size, world.comm.bcast(uid), world.rank)


def _sync():
    cp.cuda.get_current_stream().synchronize()


def test_grouped_exchange_runs(world, all_ranks):
    from cupy.cuda import nccl

    c = _comm(world)
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    send, got = cp.full(5, world.rank, cp.int32), cp.empty(5, cp.int32)
    nccl.groupStart()
    c.send(send.data.ptr, 5, nccl.NCCL_INT32, right, 0)
    c.recv(got.data.ptr, 5, nccl.NCCL_INT32, left, 0)
    nccl.groupEnd()
    all_ranks((got.get() == left).all())


def test_bare_send_facing_a_bare_send_is_a_deadlock(world, all_ranks):
    from cupy.cuda import nccl

    if world.size != 2:
        pytest.skip("a two-rank exchange")
    c = _comm(world)
    peer = 1 - world.rank
    send, got = cp.ones(4, cp.float32), cp.empty(4, cp.float32)
    c.send(send.data.ptr, 4, nccl.NCCL_FLOAT32, peer, 0)
    c.recv(got.data.ptr, 4, nccl.NCCL_FLOAT32, peer, 0)
    with pytest.raises(nccl.NcclError) as err:
        _sync()
    msg = str(err.value)
    all_ranks("deadlock between rank" in msg and f"rank {peer}" in msg
              and "test_standin_nccl.py" in msg and "groupStart" in msg, msg)


def test_collectives_in_another_order_fail_naming_each_call(world, all_ranks):
    from cupy.cuda import nccl

    c = _comm(world)
    x = cp.ones(8, cp.float32)
    if world.rank == 0:
        c.bcast(x.data.ptr, 8, nccl.NCCL_FLOAT32, 0, 0)
    else:
        c.allReduce(x.data.ptr, x.data.ptr, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    with pytest.raises(nccl.NcclError) as err:
        _sync()
    msg = str(err.value)
    all_ranks("differ across ranks" in msg and "rank 0: ncclBcast" in msg
              and "rank 1: ncclAllReduce" in msg, msg)


def test_receive_of_another_size_fails(world, all_ranks):
    from cupy.cuda import nccl

    c = _comm(world)
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    send, got = cp.ones(4, cp.float32), cp.empty(3, cp.float32)
    nccl.groupStart()
    c.send(send.data.ptr, 16, nccl.NCCL_UINT8, right, 0)
    c.recv(got.data.ptr, 12, nccl.NCCL_UINT8, left, 0)
    nccl.groupEnd()
    with pytest.raises(nccl.NcclError) as err:
        _sync()
    all_ranks("16 bytes" in str(err.value) and "12 bytes" in str(err.value), str(err.value))


def test_result_is_there_only_after_the_stream_ran(world, all_ranks):
    from cupy.cuda import nccl

    c = _comm(world)
    x = cp.full(4, world.rank + 1, cp.float32)
    out = cp.zeros(4, cp.float32)
    c.allReduce(x.data.ptr, out.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                cp.cuda.get_current_stream().ptr)
    want = world.size * (world.size + 1) / 2
    all_ranks((out.get() == want).all())  # get() synchronises the stream


def test_two_ranks_on_one_gpu_are_refused(world, all_ranks):
    from cupy.cuda import nccl

    before = cp.cuda.Device().id
    cp.cuda.Device(0).use()
    try:
        with pytest.raises(nccl.NcclError, match="Duplicate GPU detected: rank 0 and rank 1"):
            _comm(world)
    finally:
        cp.cuda.Device(before).use()


def test_nccl_has_no_int16(world):
    from cupy.cuda import nccl

    assert not hasattr(nccl, "NCCL_INT16")
    c = _comm(world)
    x = cp.ones(4, cp.int16)
    with pytest.raises(nccl.NcclError, match="invalid datatype"):
        c.allReduce(x.data.ptr, x.data.ptr, 4, 10, nccl.NCCL_SUM, 0)


def test_a_group_may_span_streams(world, all_ranks):
    """NCCL allows a group's calls on several streams: the launch follows the work queued
    so far on each, and each stream's later work follows the launch."""
    from cupy.cuda import nccl

    c = _comm(world)
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    a, b = cp.cuda.Stream(), cp.cuda.Stream()
    send, got = cp.full(6, world.rank, cp.int32), cp.empty(6, cp.int32)
    cp.cuda.get_current_stream().synchronize()
    nccl.groupStart()
    c.send(send.data.ptr, 6, nccl.NCCL_INT32, right, a.ptr)
    c.recv(got.data.ptr, 6, nccl.NCCL_INT32, left, b.ptr)
    nccl.groupEnd()
    with b:
        twice = got * 2  # queued behind the group on b
    with a:
        send += 1        # after the group on a: the send read the old values
    issued = [(kind, ptr) for kind, _, ptr in list(c.issued)[-2:]]
    b.synchronize()
    a.synchronize()
    all_ranks(issued == [("send", a.ptr), ("recv", b.ptr)]
              and (twice.get(stream=b) == 2 * left).all()
              and (send.get(stream=a) == world.rank + 1).all(), f"{issued}")
