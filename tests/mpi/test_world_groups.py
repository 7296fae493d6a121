"""World bootstrap and process groups, on real and emulated node layouts."""
from __future__ import annotations

import os

import numpy as np
import pytest

from neocomm import CollectiveArgumentError
from neocomm.types import GroupKind

pytestmark = pytest.mark.layouts("all", why=(
    "the world and its groups are built from the layout"))


def test_world_layout_matches_setting(world, all_ranks):
    k = int(os.environ.get("NEOCOMM_RANKS_PER_NODE", "0") or 0)
    if k:  # nodes of k consecutive ranks; where k does not divide the world, the last is short
        all_ranks(world.node == world.rank // k and world.local_rank == world.rank % k
                  and world.local_size == min(k, world.size - world.node * k)
                  and world.num_nodes == -(-world.size // k))
        assert world.uniform == (world.size % k == 0)
    else:  # one host: the shared-memory split finds one node
        all_ranks(world.num_nodes == 1 and world.local_rank == world.rank)
        assert world.uniform
    assert world.ranks_of_node(world.node) == world.node_ranks


def test_groups_hold_the_right_ranks(world, all_ranks):
    """Each group's communicator holds exactly the world ranks the group names, in order:
    asked of the communicator itself, not of the world's bookkeeping."""
    from mpi4py import MPI

    intra, rail = world.intra_node, world.rail
    assert intra.kind is GroupKind.INTRA_NODE and rail.kind is GroupKind.RAIL
    ok = True
    for group in (world.world, intra, rail):
        members = group.comm.allgather(world.rank)
        ok &= tuple(members) == group.ranks and members[group.rank] == world.rank
        ok &= group.size == group.comm.Get_size() == len(members)
    # a node's members share its node index, and every node appears in a rail once
    ok &= set(intra.comm.allgather(world.node)) == {world.node}
    # (on nodes of different sizes, the nodes that hold this local rank)
    ok &= sorted(rail.comm.allgather(world.node)) == [
        n for n in range(world.num_nodes) if len(world.ranks_of_node(n)) > world.local_rank]
    ok &= set(rail.comm.allgather(world.local_rank)) == {world.local_rank}
    k = int(os.environ.get("NEOCOMM_RANKS_PER_NODE", "0") or 0)
    if not k:  # real nodes: the members of a node are the ranks on its host
        hosts = world.comm.allgather(MPI.Get_processor_name())
        ok &= intra.ranks == tuple(q for q in range(world.size) if hosts[q] == hosts[world.rank])
    # every rank sees the same layout
    layouts = world.comm.allgather((world.world.nodes, world.world.ranks_per_node))
    ok &= all(lay == layouts[0] for lay in layouts)
    seen = world.comm.allgather(intra.ranks)  # each rank's node, as its communicator holds it
    ok &= world.world.nodes == tuple(sorted(set(seen)))
    all_ranks(ok, f"rank {world.rank}: {intra.ranks} / {rail.ranks}")


def test_collectives_on_every_group(world, all_ranks):
    for group in (world.world, world.intra_node, world.rail):
        x = np.full(3, world.rank, np.int64)
        group.backend().all_reduce(x)
        all_ranks(np.array_equal(x, np.full(3, sum(group.ranks))))


def test_split_subgroup(world, all_ranks):
    members = list(range(0, world.size, 2))
    sub = world.world.split(members, name="even")
    if world.rank % 2:
        assert sub is None
    else:
        assert sub.ranks == tuple(members) and sub.name == "even"
        x = np.ones(2)
        sub.backend().all_reduce(x)
        assert x[0] == len(members)


def test_split_rejects_bad_ranks_everywhere(world):
    with pytest.raises(CollectiveArgumentError, match="split: ranks must lie in"):
        world.world.split([0, world.size])
    with pytest.raises(CollectiveArgumentError, match="duplicates"):
        world.world.split([0, 0])


@pytest.mark.mpi(min_size=2)
def test_split_disagreeing_ranks_raise_everywhere(world):
    with pytest.raises(CollectiveArgumentError, match="ranks differs across ranks"):
        world.world.split([0] if world.rank == 0 else [0, 1])


def test_init_is_idempotent(world):
    import neocomm

    assert neocomm.init() is world and neocomm.current_world() is world


def _raises_gone(call, *names):
    from neocomm import GroupGoneError

    with pytest.raises(GroupGoneError) as info:
        call()
    for name in names:
        assert name in str(info.value), (name, str(info.value))
    return info.value


def test_a_freed_group_refuses_every_later_call(world, all_ranks):
    import collectives as C

    sub = world.world.split(list(range(world.size)), name="short-lived")
    x = np.ones(3)
    C.all_reduce(x, group=sub)
    C.all_reduce(x, group=sub)  # a remembered plan now holds the group's communicator
    prepared = C.prepare_all_reduce(x, group=sub)
    prepared()
    sub.free()
    ranks = f"world ranks {list(range(world.size))}"
    err = _raises_gone(lambda: C.all_reduce(x, group=sub), "'short-lived'", ranks, "freed")
    assert err.ranks == tuple(range(world.size))
    _raises_gone(lambda: sub.backend(), "'short-lived'")
    _raises_gone(prepared, "prepared all_reduce", "'short-lived'")
    _raises_gone(lambda: C.all_gather(x, group=sub), "'short-lived'")
    sub.free()  # a second free is a no-op
    C.all_reduce(x)  # the world is untouched
    all_ranks(x[0] == world.size ** 4)


def test_free_against_another_call_fails_together(world, all_ranks):
    from neocomm import CollectiveArgumentError

    import collectives as C

    sub = world.world.split(list(range(world.size)), name="mixed")
    if world.size == 1:
        sub.free()
        return
    C.all_reduce(np.ones(2), group=sub)  # the group's first collective: its plan now
    with pytest.raises(CollectiveArgumentError) as info:
        if world.rank == 0:
            sub.free()
        else:
            C.all_reduce(np.ones(2), group=sub)
    text = str(info.value)
    assert "the ranks' calls differ" in text and "rank 0: free(" in text, text
    assert "rank 1: all_reduce(float64" in text, text
    assert sub.gone is None  # nobody freed it: it still works
    x = np.ones(2)
    C.all_reduce(x, group=sub)
    all_ranks(x[0] == world.size)
    sub.free()


def test_groups_of_a_closed_world_are_refused(world, all_ranks):
    import collectives as C
    import neocomm
    from mpi4py import MPI

    other = neocomm.init(comm=MPI.COMM_WORLD)
    sub = other.world.split([0], name="lone")
    x = np.ones(2)
    C.all_reduce(x, group=other.world)
    other.close()
    for group in (other.world, other.intra_node, other.rail):
        _raises_gone(lambda: C.all_reduce(x, group=group), "world.close()", repr(group.name))
    if sub is not None:
        _raises_gone(lambda: C.broadcast(x, group=sub), "'lone'", "world.close()")
    other.close()  # closing twice is a no-op
    y = np.ones(2)
    C.all_reduce(y)  # group=None: a new current world
    C.all_reduce(y, group=world.world)  # and the first world lives on
    all_ranks(y[0] == world.size ** 2)
    assert neocomm.current_world() is not other
