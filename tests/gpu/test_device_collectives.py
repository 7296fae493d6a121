"""Every collective and every algorithm on device buffers, over NCCL and the staged backend.

Compared with MPI on the same data on the host: bit for bit for copies
and integer reductions, within float tolerance for float reductions. Runs
under mpirun at 2 and 4 ranks, on one node and on two emulated nodes.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupy as cp
import collectives
from collectives.algorithms import registry
from collectives.types import CollectiveOp
from gpu_cases import load_mpi_tests

pytestmark = pytest.mark.mpi(min_size=2)

SIZES = [1, 7, 40_000]  # one element, odd, several 64 KiB staging pieces (float32)
OPS = [CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V, CollectiveOp.REDUCE_SCATTER,
       CollectiveOp.ALL_REDUCE, CollectiveOp.ALL_GATHER, CollectiveOp.BROADCAST]


def _cases():
    for op in OPS:
        for algo in registry()[op]:
            if algo.name != "symmetric":  # host shared memory only
                yield op, algo.name


def _supported(op, algo, world):
    from collectives.fabric import fabric_for

    return registry()[op][[a.name for a in registry()[op]].index(algo)].supports(
        collectives.types.Request(op, 1024, 4, world.size), fabric_for(world.world, device=True))


def _run(op, algo, world, host, root=0):
    """(device result, host reference) of ``op`` on ``host`` (this rank's input)."""
    comm, n = world.comm, world.size
    d = cp.asarray(host)
    if op is CollectiveOp.ALL_REDUCE:
        collectives.all_reduce(d, algo=algo)
        want = np.empty_like(host)
        comm.Allreduce(host, want)
        return d.get(), want
    # the copying collectives' references move the bits (MPI has no bfloat16 or bool buffer)
    bits = host.view(f"u{host.itemsize}")
    if op in (CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V):
        want = np.empty_like(bits)
        comm.Alltoall(bits, want)
        if op is CollectiveOp.ALL_TO_ALL:
            return collectives.all_to_all(d, algo=algo).get(), want.view(host.dtype)
        counts = [host.size // n] * n
        out, _ = collectives.all_to_all_v(d, counts, recv_counts=counts, algo=algo)
        return out.get(), want.view(host.dtype)
    if op is CollectiveOp.REDUCE_SCATTER:
        want = np.empty(host.size // n, host.dtype)
        comm.Reduce_scatter_block(host, want)
        return collectives.reduce_scatter(d, algo=algo).get(), want
    if op is CollectiveOp.ALL_GATHER:
        want = np.empty(host.size * n, bits.dtype)
        comm.Allgather(bits, want)
        return collectives.all_gather(d, algo=algo).get().reshape(-1), want.view(host.dtype)
    want = bits.copy()
    comm.Bcast(want, root=root)
    collectives.broadcast(d, root=root, algo=algo)
    return d.get(), want.view(host.dtype)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op,algo", list(_cases()), ids=lambda v: getattr(v, "value", v))
def test_algorithm_matches_mpi(op, algo, size, device_backend, world, rng, all_ranks):
    why = _supported(op, algo, world)
    if why is not None:
        pytest.skip(f"{algo}: {why}")
    per_rank = op in (CollectiveOp.ALL_TO_ALL, CollectiveOp.ALL_TO_ALL_V,
                      CollectiveOp.REDUCE_SCATTER)
    host = rng.integers(-50, 50, size * (world.size if per_rank else 1)).astype(np.float32)
    got, want = _run(op, algo, world, host, root=world.size - 1)
    all_ranks(np.array_equal(got, want), f"{op.value}/{algo}/{device_backend}: differs from MPI")


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "int32", "int64",
                                   "uint64", "float16", "bfloat16", "float64", "bool"])
def test_every_dtype_on_both_backends(dtype, device_backend, world, rng, all_ranks):
    from neocomm.types import dtype_from_code, DTYPE_CODES

    dt = np.dtype(dtype_from_code(DTYPE_CODES[dtype]))
    n = world.size
    host = (rng.integers(0, 2, 12 * n) if dtype == "bool" else rng.integers(-3, 100, 12 * n)
            ).astype(dt)
    got, want = _run(CollectiveOp.ALL_TO_ALL, None, world, host)
    all_ranks(np.array_equal(got, want), f"all_to_all {dtype}")
    got, want = _run(CollectiveOp.ALL_GATHER, None, world, host)
    all_ranks(np.array_equal(got, want), f"all_gather {dtype}")
    got, want = _run(CollectiveOp.BROADCAST, None, world, host)
    all_ranks(np.array_equal(got, want), f"broadcast {dtype}")
    if dtype == "bool":
        return
    for op in ("sum", "max", "min", "prod"):
        d = cp.asarray(host)
        collectives.all_reduce(d, op=op, algo="native")
        every = world.comm.allgather(host)
        acc = every[0].copy()
        with np.errstate(over="ignore"):
            for x in every[1:]:
                acc = getattr(np, {"sum": "add", "max": "maximum", "min": "minimum",
                                   "prod": "multiply"}[op])(acc, x).astype(dt)
        ok = np.array_equal(d.get(), acc) if dt.kind in "iu" else \
            np.allclose(d.get().astype(np.float64), acc.astype(np.float64), rtol=2e-2)
        all_ranks(ok, f"all_reduce {op} {dtype}")


def test_default_all_reduce_of_16_mib(device_backend, world, all_ranks):
    """The default path at a size where selection may pick a point-to-point algorithm
    (an ungrouped NCCL send/recv deadlocked here)."""
    host = np.arange(4 << 20, dtype=np.float32) % 97 + world.rank
    got, want = _run(CollectiveOp.ALL_REDUCE, None, world, host)
    all_ranks(np.array_equal(got, want))


def test_async_handles(device_backend, world, rng, all_ranks):
    """Two collectives in flight at once; each handle's wait gives its own result."""
    ha_in = rng.integers(0, 9, 1000 * world.size).astype(np.float32)
    hb_in = rng.integers(0, 9, 1000).astype(np.float32)
    ha = collectives.all_to_all(cp.asarray(ha_in), async_op=True)
    hb = collectives.all_reduce(cp.asarray(hb_in), async_op=True)
    rb = hb.wait()
    ra = ha.wait()
    want_a = np.empty_like(ha_in)
    world.comm.Alltoall(ha_in, want_a)
    want_b = np.empty_like(hb_in)
    world.comm.Allreduce(hb_in, want_b)
    all_ranks(np.array_equal(ra.get(), want_a), "all_to_all(async_op=True)")
    all_ranks(np.array_equal(rb.get(), want_b), "all_reduce(async_op=True)")


def test_staged_point_to_point_posts_send_then_receive(world, all_ranks, monkeypatch):
    """Above MPI's eager limit two ranks that each post a send and then a receive must
    not block in the send (the staged backend did)."""
    if world.size != 2:
        pytest.skip("a two-rank exchange")
    be = world.world.backend(kind="staged")
    peer = 1 - world.rank
    mine = cp.full(16 << 10, world.rank, cp.float32)     # 64 KiB
    theirs = cp.empty(16 << 10, cp.float32)
    hs = be.send(mine, peer, async_op=True)
    hr = be.recv(theirs, peer, async_op=True)
    hs.wait()
    hr.wait()
    all_ranks((theirs.get() == peer).all())


def test_staged_broadcast_of_several_pieces(world, all_ranks):
    """Non-root ranks copy each received piece to the device; the pinned piece must not
    be overwritten by the next one before that copy ran."""
    be = world.world.backend(kind="staged")
    host = np.arange(100_000, dtype=np.float32) if world.rank == 0 else \
        np.zeros(100_000, np.float32)
    d = cp.asarray(host)
    be.broadcast(d, root=0)
    all_ranks(np.array_equal(d.get(), np.arange(100_000, dtype=np.float32)))


def test_each_rank_of_a_host_drives_its_own_gpu(world, all_ranks):
    """Emulated nodes share the host's GPUs: the device comes from the rank's place on its
    real host (found here from the host names), never from its place in an emulated node,
    and it is the device CuPy works on."""
    from mpi4py import MPI

    hosts = world.comm.allgather(MPI.Get_processor_name())
    on_host = [q for q in range(world.size) if hosts[q] == hosts[world.rank]]
    want = on_host.index(world.rank) % cp.cuda.runtime.getDeviceCount()
    devices = world.comm.allgather(world.device)
    ok = world.device == want and cp.cuda.Device().id == want
    ok = ok and cp.zeros(4, cp.float32).device.id == want
    if getattr(cp, "STANDIN", False) and cp.cuda.runtime.getDeviceCount() >= world.size:
        ok = ok and len(set(devices)) == world.size  # enough devices: one each
    all_ranks(ok, f"rank {world.rank}: device {world.device}, expected {want}; all {devices}")


def test_two_ranks_on_one_gpu_are_a_clear_error(world, all_ranks):
    from neocomm.errors import BackendUnavailableError

    if not getattr(cp, "STANDIN", False):
        pytest.skip("moves ranks onto one device of the stand-in")
    group = world.world.split(list(range(world.size)), name="one-gpu")
    before = cp.cuda.Device().id
    cp.cuda.Device(0).use()
    try:
        with pytest.raises(BackendUnavailableError) as err:
            group.backend(kind="nccl")
    finally:
        cp.cuda.Device(before).use()
    all_ranks("ranks 0 and 1 both on GPU 0" in str(err.value), str(err.value))


@pytest.mark.parametrize("algo", [None, "native"])
def test_prepared_collectives_on_device(device_backend, world, rng, all_ranks, algo):
    """Prepared (persistent) collectives on device buffers follow their contents, as the
    plain calls do: each run after the input changed on the device gives the new result."""
    bad = load_mpi_tests("test_persistent").prepared_mismatches(world, rng, algo, cp)
    all_ranks(not bad, f"rank {world.rank}: {bad}")


def test_repeated_device_calls_stay_correct(device_backend, world, rng, all_ranks):
    """The same device buffers called again and again (the implicit plan's path)."""
    host = rng.integers(-8, 8, 64 * world.size).astype(np.float32)
    x, out = cp.asarray(host), cp.empty(64 * world.size, cp.float32)
    bad = []
    for step in range(4):
        x += 1
        host += 1
        want = np.empty_like(host)
        world.comm.Allreduce(host, want)
        if not np.array_equal(collectives.all_reduce(x, out).get(), want):
            bad.append(step)
    all_ranks(not bad, f"rank {world.rank}: wrong at steps {bad}")


def test_symmetric_memory_refuses_device_buffers(device_backend, world, all_ranks):
    """Symmetric memory is host shared memory: forcing it on a device buffer is refused on
    every rank with the reason, and the default path never picks it for one."""
    from neocomm import CollectiveArgumentError

    x = cp.ones(1 << 16, cp.float32)
    node = world.intra_node  # the symmetric algorithm's other rule: one node
    try:
        collectives.all_reduce(x, group=node, algo="symmetric")
        msg = ""
    except CollectiveArgumentError as exc:
        msg = str(exc)
    all_ranks("'symmetric'" in msg and "host buffers only" in msg, msg or "no error")
    collectives.all_reduce(x, group=node)
    all_ranks(bool((x.get() == node.size).all()), "the default all_reduce after the refusal")


@pytest.mark.parametrize("dtype,why", [("bool", "cannot be reduced"),
                                       ("complex64", "is not supported")])
def test_dtypes_without_a_reduction_are_refused_by_name(device_backend, world, all_ranks, dtype,
                                                        why):
    """No bare KeyError from a dtype table: the dtype, the operation and what is supported
    (the collectives check; a backend moves what it is given)."""
    from neocomm import CollectiveArgumentError

    msgs = []
    try:
        collectives.all_reduce(cp.ones(4, dtype))
        msgs.append("")
    except CollectiveArgumentError as exc:
        msgs.append(str(exc))
    all_ranks(all(f"dtype {dtype} {why}" in m and "all_reduce" in m and "float32" in m
                  for m in msgs), f"{msgs}")
