"""Batches, rank-sliced readers and the broadcast reader with an in-process transport."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.data import (Batch, BatchError, BroadcastReader, ShardedReader, SyntheticConfig,
                            SyntheticDataset, shard_bounds)
from embedding.dense import NonFiniteError

SIZES = (500,) * 26


def dataset(n=64 * 10):
    return SyntheticDataset(SyntheticConfig(table_sizes=SIZES, seed=11), n)


def same(a: Batch, b: Batch) -> bool:
    return (np.array_equal(a.dense, b.dense) and np.array_equal(a.labels, b.labels)
            and all(np.array_equal(x, y) for x, y in zip(a.values, b.values))
            and all(np.array_equal(x, y) for x, y in zip(a.lengths, b.lengths)))


@pytest.mark.parametrize("shuffle", [False, True])
def test_one_two_and_four_ranks_see_the_same_global_batches(shuffle):
    ds = dataset()
    one = ShardedReader(ds, 64, 0, 1, shuffle=shuffle, seed=7)
    global_batches = [one.next() for _ in range(23)]  # crosses two epoch boundaries
    for n in (2, 4):
        readers = [ShardedReader(ds, 64, r, n, shuffle=shuffle, seed=7) for r in range(n)]
        for g in global_batches:
            parts = [r.next() for r in readers]
            assert all(p.batch_size == 64 // n for p in parts)
            assert same(Batch.concat(parts), g)
    if shuffle:  # epochs come in different orders
        e0 = [b.labels.tobytes() for b in global_batches[:10]]
        e1 = [b.labels.tobytes() for b in global_batches[10:20]]
        assert sorted(e0) == sorted(e1) and e0 != e1
    else:
        assert same(global_batches[10], global_batches[0])


def test_iteration_covers_one_epoch_and_state_resumes():
    ds = dataset()
    r = ShardedReader(ds, 64, 1, 2, shuffle=True, seed=3)
    assert len(list(r)) == 10 and r.epoch == 1 and r.batch == 0
    for _ in range(4):
        r.next()
    state = r.state_dict()
    expect = [r.next() for _ in range(3)]
    s = ShardedReader(ds, 64, 1, 2, shuffle=True, seed=3)
    s.load_state_dict(state)
    assert all(same(s.next(), e) for e in expect)
    with pytest.raises(ValueError, match="seed"):
        ShardedReader(ds, 64, 1, 2, seed=4).load_state_dict(state)


def test_bad_reader_arguments():
    ds = dataset()
    with pytest.raises(ValueError, match="multiple of world_size 3"):
        ShardedReader(ds, 64, 0, 3)
    with pytest.raises(ValueError, match="rank"):
        ShardedReader(ds, 64, 4, 4)
    with pytest.raises(ValueError, match="larger than the data set"):
        ShardedReader(ds, 1024)
    assert shard_bounds(12, 2, 3) == (8, 12)


class Mailbox:
    """An in-process OneToMany: the root posts every rank's buffer; the others collect theirs."""

    def __init__(self):
        self.posted = {}

    def transport_for(self, rank):
        def transport(pieces, root):
            if pieces is not None:
                assert rank == root
                self.posted = {r: np.array(p) for r, p in enumerate(pieces)}
            return self.posted.pop(rank)
        return transport


def test_broadcast_reader_matches_sharded_reader():
    ds = dataset()
    n = 4
    box = Mailbox()
    readers = [BroadcastReader(ds if r == 1 else None, 64, r, n, box.transport_for(r), root=1,
                               shuffle=True, seed=9) for r in range(n)]
    reference = [ShardedReader(ds, 64, r, n, shuffle=True, seed=9) for r in range(n)]
    for _ in range(12):
        order = [1] + [r for r in range(n) if r != 1]  # the root sends first
        got = {r: readers[r].next() for r in order}
        for r in range(n):
            assert same(got[r], reference[r].next())
            assert got[r].feature_names == ds.feature_names
    assert readers[1].state_dict()["epoch"] == 1
    with pytest.raises(ValueError, match="data set"):
        BroadcastReader(None, 64, 0, 2, box.transport_for(0))
    with pytest.raises(TypeError, match="transport"):
        BroadcastReader(ds, 64, 0, 2, "one_to_many")


def jagged_batch():
    ids = np.array([[1, -1, 3], [-1, -1, 4], [2, 5, -1]])
    return Batch.from_ids(np.arange(9, dtype=np.float32).reshape(3, 3), [0, 1, 1], ids,
                          ("a", "b", "c"))


def test_batch_from_ids_slice_pack_and_jagged():
    b = jagged_batch()
    assert [x.tolist() for x in b.lengths] == [[1, 0, 1], [0, 0, 1], [1, 1, 0]]
    s = b.slice(1, 3)
    assert s.values[0].tolist() == [2] and s.values[2].tolist() == [4]
    back = Batch.unpack(b.pack(), b.feature_names)
    assert same(back, b) and back.feature_names == ("a", "b", "c")
    kj = b.to_jagged()
    assert kj.keys == ("a", "b", "c") and kj.batch_size == 3
    assert kj.feature("a").bags() == [[1], [], [2]]
    assert kj.feature("c").bags() == [[3], [4], []]
    with pytest.raises(ValueError, match="packed batch"):
        Batch.unpack(np.zeros(48, np.uint8))
    with pytest.raises(ValueError, match="header describes"):
        Batch.unpack(b.pack()[:-1])
    with pytest.raises(ValueError, match="lengths sum"):
        Batch(b.dense, b.labels, (np.zeros(1, np.int64),), (np.ones(3, np.int32),))
    with pytest.raises(ValueError, match="labels"):
        Batch(b.dense, np.zeros(2), (), ())


def test_batch_check_names_step_and_tensor():
    b = jagged_batch()
    b.check(step=3, table_sizes=(10, 10, 10))
    bad = Batch(b.dense, np.array([0, 2, 1], np.float32), b.values, b.lengths)
    with pytest.raises(BatchError, match=r"step 12: labels: 1 label\(s\) outside \{0, 1\}") as e:
        bad.check(step=12)
    assert e.value.step == 12 and e.value.tensor == "labels" and e.value.index == 1
    dense = b.dense.copy()
    dense[2, 1] = np.inf
    with pytest.raises(NonFiniteError, match="step 5: dense holds 1 non-finite") as e:
        Batch(dense, b.labels, b.values, b.lengths).check(step=5)
    assert e.value.tensor == "dense" and e.value.index == 7
    with pytest.raises(BatchError, match=r"values\[1\] \(b\): id 5 .* < 5"):
        b.check(table_sizes=(10, 5, 10))


def test_one_to_many_transport_wiring(monkeypatch):
    """The real transport: sizes broadcast first, then one OneToMany to the other ranks."""
    import collectives
    from embedding.data import one_to_many_transport

    class Group:  # what the transport reads of a group (a real one has a communicator)
        size = 3
        comm = backend = None

    calls = []

    def broadcast(buf, *, root, group):
        calls.append(("broadcast", buf.tolist(), root))
        return buf

    def one_to_many(send, *, root, ranks, counts, group):
        calls.append(("one_to_many", None if send is None else send.tolist(), root, ranks,
                      counts.tolist()))
        return np.zeros(int(counts[0]), np.uint8)

    monkeypatch.setattr(collectives, "broadcast", broadcast)
    monkeypatch.setattr(collectives, "one_to_many", one_to_many)
    t = one_to_many_transport(Group())
    pieces = [np.array([1, 2], np.uint8), np.array([3], np.uint8), np.array([4, 5, 6], np.uint8)]
    assert t(pieces, 1).tolist() == [3]  # the root keeps its own piece
    assert calls == [("broadcast", [2, 3], 1), ("one_to_many", [1, 2, 4, 5, 6], 1, [0, 2], [2, 3])]
    calls.clear()
    assert t(None, 1).size == 0 and calls[1][1] is None
    with pytest.raises(ValueError, match="one buffer per rank"):
        t(pieces[:2], 0)
    Group.size = 1
    assert t([pieces[0]], 0).tolist() == [1, 2]  # a group of one moves nothing


@pytest.mark.parametrize("window", [0, 100])
def test_a_position_carries_over_to_another_global_batch(window):
    """Written with batches of 64 after 3 of them (192 records read), resumed with batches of
    60: in record order (or records shuffled in windows) the 4th batch, the first at or after
    record 192; with whole batches shuffled, the next epoch."""
    ds = dataset()
    old = ShardedReader(ds, 64, 0, 2, shuffle=bool(window), seed=7, shuffle_window=window)
    for _ in range(3):
        old.next()
    new = ShardedReader(ds, 60, 1, 3, shuffle=bool(window), seed=7, shuffle_window=window)
    assert new.carry_over(old.state_dict()) == {"epoch": 0, "batch": 4, "seed": 7,
                                                "global_batch_size": 60}
    whole = ShardedReader(ds, 60, 0, 3, shuffle=True, seed=7)  # whole batches shuffled
    at = whole.carry_over(old.state_dict())
    assert (at["epoch"], at["batch"]) == (1, 0)
    old.epoch, old.batch = 0, 9  # 576 records read: past every batch of 60 that starts later
    at = new.carry_over(old.state_dict())
    assert (at["epoch"], at["batch"]) == (1, 0)
