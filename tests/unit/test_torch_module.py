"""embedding.torch on one rank: autograd, the fused update, zero-copy tensors, state dicts.

Collected only where torch is installed (tests/conftest.py says so when it is not).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from embedding.collection import ShardedEmbeddingCollection
from embedding.jagged import KeyedJagged
from embedding.torch import ShardedEmbeddingBagCollection, as_keyed_jagged
from embedding.types import (OptimizerConfig, OptimizerKind, Shard, ShardingPlan, ShardingType,
                             TableConfig, TablePlan)

B = 6


def _tables(kind=OptimizerKind.ROWWISE_ADAGRAD):
    opt = OptimizerConfig(kind, lr=0.1)
    return [TableConfig("users", 50, 8, "sum", ("user",), optimizer=opt),
            TableConfig("genres", 12, 4, "mean", ("genre", "liked"), optimizer=opt),
            TableConfig("tags", 20, 8, "max", ("tag",), optimizer=opt)]


def _plan(tables, sharding=ShardingType.TABLE_WISE) -> ShardingPlan:
    if sharding is ShardingType.COLUMN_WISE:
        return ShardingPlan(1, 1, tuple(TablePlan(t.name, sharding, (
            Shard(0, 0, t.num_rows, 0, t.dim // 2),
            Shard(0, 0, t.num_rows, t.dim // 2, t.dim - t.dim // 2))) for t in tables))
    return ShardingPlan(1, 1, tuple(TablePlan(t.name, sharding, (Shard(0, 0, t.num_rows, 0,
                                                                       t.dim),))
                                    for t in tables))


def _batch(rng, tables, weighted=False) -> KeyedJagged:
    lists = {}
    for t in tables:
        for f in t.features:
            lists[f] = [rng.integers(0, t.num_rows, rng.integers(0, 4)).tolist()
                        for _ in range(B)]
    weights = ({f: [rng.uniform(0.5, 1.5, len(b)).tolist() for b in bags]
                for f, bags in lists.items()} if weighted else None)
    return KeyedJagged.from_lists(lists, weights)


def test_training_through_autograd_equals_the_collection():
    """loss = sum(pooled * G): the module's tables after the steps are the collection's when
    it is given G directly; the output is in autograd and the anchor is no parameter."""
    tables = _tables()
    mod = ShardedEmbeddingBagCollection(tables, _plan(tables), seed=3)
    coll = ShardedEmbeddingCollection(tables, _plan(tables), seed=3)
    assert list(mod.parameters()) == []
    rng = np.random.default_rng(0)
    for step in range(3):
        kjt = _batch(rng, tables, weighted=step == 1)
        g = rng.standard_normal((B, coll.out_dim)).astype(np.float32)
        pooled = mod(kjt)
        assert isinstance(pooled, torch.Tensor) and pooled.requires_grad
        want = coll.forward(kjt)
        np.testing.assert_array_equal(pooled.detach().numpy(), want)
        (pooled * torch.from_numpy(g)).sum().backward()
        coll.backward(g)
    for t in tables:
        np.testing.assert_array_equal(mod.full_table(t.name).numpy(),
                                      coll.gather_table(t.name))


def test_no_copy_in_or_out(monkeypatch):
    tables = _tables()
    mod = ShardedEmbeddingBagCollection(tables, _plan(tables))
    seen = {}
    fwd, bwd = mod.collection.forward_with_context, mod.collection.backward

    def forward(batch, **kw):
        out = fwd(batch, **kw)
        seen["out"] = out[0]
        return out

    def backward(grad, ctx=None, **kw):
        seen["grad"] = grad
        return bwd(grad, ctx, **kw)

    monkeypatch.setattr(mod.collection, "forward_with_context", forward)
    monkeypatch.setattr(mod.collection, "backward", backward)
    pooled = mod(_batch(np.random.default_rng(1), tables))
    assert pooled.data_ptr() == seen["out"].ctypes.data
    grad = torch.randn(B, mod.out_dim)
    pooled.backward(grad)
    assert seen["grad"].ctypes.data == grad.data_ptr()


def test_no_grad_updates_nothing():
    tables = _tables()
    mod = ShardedEmbeddingBagCollection(tables, _plan(tables))
    before = {t.name: mod.full_table(t.name).clone() for t in tables}
    with torch.no_grad():
        out = mod(_batch(np.random.default_rng(2), tables))
    assert not out.requires_grad
    for t in tables:
        assert torch.equal(mod.full_table(t.name), before[t.name])


class _FakeKJT:
    """What the module reads of a TorchRec KeyedJaggedTensor."""

    def __init__(self, kjt: KeyedJagged):
        self._k = kjt

    def keys(self):
        return list(self._k.keys)

    def values(self):
        return torch.from_numpy(self._k.values)

    def lengths(self):
        return torch.from_numpy(self._k.lengths)

    def weights_or_none(self):
        return None if self._k.weights is None else torch.from_numpy(self._k.weights)


def test_inputs_of_every_kind_give_the_same_output():
    tables = _tables()
    mod = ShardedEmbeddingBagCollection(tables, _plan(tables))
    kjt = _batch(np.random.default_rng(3), tables, weighted=True)
    as_dict = {k: (torch.from_numpy(kjt.feature(k).values), torch.from_numpy(
        kjt.feature(k).lengths), torch.from_numpy(kjt.feature(k).weights)) for k in kjt.keys}
    with torch.no_grad():
        want = mod(kjt)
        for other in (_FakeKJT(kjt), as_dict):
            assert torch.equal(mod(other), want)
    with pytest.raises(TypeError, match=r"features: expected a KeyedJagged, a "
                                        r"KeyedJaggedTensor .* got list"):
        as_keyed_jagged([1, 2])
    with pytest.raises(TypeError, match=r"features\['user'\]: expected \(values, lengths"):
        as_keyed_jagged({"user": torch.zeros(3)})


@pytest.mark.parametrize("sharding", [ShardingType.COLUMN_WISE, ShardingType.DATA_PARALLEL])
def test_state_dict_holds_whole_tables_and_loads_into_another_plan(sharding):
    tables = _tables()
    a = ShardedEmbeddingBagCollection(tables, _plan(tables), seed=5)
    rng = np.random.default_rng(4)
    pooled = a(_batch(rng, tables))
    pooled.sum().backward()
    sd = a.state_dict()
    assert list(sd) == [f"embedding_bags.{t.name}.weight" for t in tables]
    assert all(sd[f"embedding_bags.{t.name}.weight"].shape == (t.num_rows, t.dim)
               for t in tables)
    b = ShardedEmbeddingBagCollection(tables, _plan(tables, sharding), seed=9)
    b.load_state_dict(sd)
    kjt = _batch(rng, tables)
    with torch.no_grad():
        assert torch.equal(a(kjt), b(kjt))
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: "
                                           r"\"embedding_bags.tags.weight\""):
        b.load_state_dict({k: v for k, v in sd.items() if "tags" not in k})
    bad = dict(sd)
    bad["embedding_bags.users.weight"] = torch.zeros(3, 8)
    with pytest.raises(RuntimeError, match=r"embedding_bags.users.weight: weights of table "
                                           r"'users': expected shape \(50, 8\), got \(3, 8\)"):
        b.load_state_dict(bad)


def test_the_planner_plans_when_no_plan_is_given():
    tables = _tables()
    mod = ShardedEmbeddingBagCollection(tables)
    assert {p.table for p in mod.plan.tables} == {t.name for t in tables}
    assert "shardings=" in repr(mod)


def test_a_gradient_on_the_wrong_device_or_type_names_it():
    tables = _tables()
    mod = ShardedEmbeddingBagCollection(tables, _plan(tables))
    with pytest.raises(TypeError, match="grad: expected a torch.Tensor, got ndarray"):
        mod._from_torch(np.zeros(3), "grad")
    with pytest.raises(ValueError, match="device: expected 'cpu' or 'cuda', got 'mps'"):
        ShardedEmbeddingBagCollection(tables, _plan(tables), device="mps")
