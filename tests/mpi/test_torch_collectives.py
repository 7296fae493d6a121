"""Every collective on torch tensors: torch out, the caller's own memory, no copies.

    neocomm run -n 2 -- python -m pytest --with-mpi tests/mpi/test_torch_collectives.py

Collected only where torch is installed (tests/conftest.py says so when it is not).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import collectives as C
from neocomm import CollectiveArgumentError
from neocomm.types import bfloat16

pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.layouts("1x2", "1x3", why=(
    "tensors are converted before any exchange; uneven blocks need three ranks"))]


def _t(rng, n, dtype=torch.float32):
    return torch.from_numpy(rng.integers(-8, 8, n).astype(np.float64)).to(dtype)


def _same(t, a) -> bool:
    return isinstance(t, torch.Tensor) and np.array_equal(t.numpy(), np.asarray(a))


def test_every_collective_returns_tensors_equal_to_numpys(world, all_ranks, rng):
    p, r = world.size, world.rank
    x = _t(rng, 6 * p)
    n = x.numpy().copy()
    checks = {
        "all_to_all": (C.all_to_all(x), C.all_to_all(n)),
        "all_reduce": (C.all_reduce(x, torch.empty_like(x)), C.all_reduce(n, np.empty_like(n))),
        "reduce_scatter": (C.reduce_scatter(x), C.reduce_scatter(n)),
        "all_gather": (C.all_gather(x), C.all_gather(n)),
        "all_to_all_v": (C.all_to_all_v(x, [6] * p)[0], C.all_to_all_v(n, [6] * p)[0]),
        "broadcast": (C.broadcast(x.clone(), root=0), C.broadcast(n.copy(), root=0)),
    }
    got, want = C.many_to_many(x[:3], [(r + 1) % p], [3])[0], \
        C.many_to_many(n[:3], [(r + 1) % p], [3])[0]
    checks["many_to_many"] = (got, want)
    recv = torch.empty(3) if r != 0 else None
    got = C.one_to_many(x[:3] if r == 0 else None, recv, root=0, ranks=list(range(1, p)))
    want = C.one_to_many(n[:3] if r == 0 else None, None if r == 0 else np.empty(3, np.float32),
                         root=0, ranks=list(range(1, p)))
    if r != 0:
        checks["one_to_many"] = (got, want)
    bad = sorted(k for k, (g, w) in checks.items() if not _same(g, w))
    all_ranks(not bad, f"differ or not tensors: {bad}")


def test_results_are_the_callers_memory(world, all_ranks, rng):
    p = world.size
    x = _t(rng, 4 * p)
    out = torch.empty_like(x)
    ptr = out.data_ptr()
    res = C.all_to_all(x, out)
    ok = res is out and out.data_ptr() == ptr
    inplace = C.all_reduce(x)  # no recvbuf: in place, the caller's tensor back
    ok = ok and inplace is x
    grown = C.all_gather(x)  # allocated: a tensor sharing the result's memory
    ok = ok and isinstance(grown, torch.Tensor) and grown.shape == (p, 4 * p)
    g = x.clone().requires_grad_(False)
    h = C.all_reduce(g, async_op=True)
    ok = ok and h.wait() is g
    all_ranks(ok, "a result is not the caller's tensor")


def test_prepared_runs_return_tensors(world, all_ranks):
    x = _t(np.random.default_rng(7), 8)  # the same on every rank
    out = torch.empty_like(x)
    with C.prepare_all_reduce(x, out) as run:
        first, second = run(), run()
    all_ranks(first is out and second is out and torch.equal(out, x * world.size),
              f"{type(first)}")


@pytest.mark.skipif(bfloat16 is None, reason="bfloat16 needs ml_dtypes")
def test_bfloat16_tensors(world, all_ranks):
    x = _t(np.random.default_rng(8), 10, torch.bfloat16)  # the same on every rank
    got = C.all_reduce(x, torch.empty_like(x))
    all_ranks(got.dtype == torch.bfloat16 and torch.equal(got, x * world.size),
              f"{got} vs {x * world.size}")


def test_a_tensor_the_collectives_cannot_take_fails_every_rank(world, all_ranks):
    """A non-contiguous tensor on the last rank only: every rank raises, naming it."""
    x = torch.ones(4, 4)
    send = x.t() if world.rank == world.size - 1 else x
    with pytest.raises(CollectiveArgumentError) as info:
        C.all_reduce(send, torch.empty(4, 4))
    msg = str(info.value)
    all_ranks("sendbuf: a torch.Tensor (device cpu, dtype torch.float32) must be contiguous"
              in msg and f"rank {world.size - 1}" in msg, msg)
    with pytest.raises(CollectiveArgumentError) as info:
        C.all_to_all(torch.ones(world.size, dtype=torch.complex64))
    msg = str(info.value)
    all_ranks("sendbuf: dtype complex64 is not supported" in msg, msg)
