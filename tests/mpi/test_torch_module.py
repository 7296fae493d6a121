"""embedding.torch at every world size: every sharding type through autograd, state dicts
across world sizes, the planner's plans.

    neocomm run -n 2 -- python -m pytest --with-mpi tests/mpi/test_torch_module.py

Collected only where torch is installed (tests/conftest.py says so when it is not).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from embedding.torch import ShardedEmbeddingBagCollection
from embedding.types import OptimizerKind

from test_sharding import (BATCH, MAX_POOLS, MIXES, POOLS, Reference, global_batch,
                           local_kjt, make_plan, make_tables, skip_if_uneven, tiered_plan)
from test_train import own_group

pytestmark = pytest.mark.training


def _train(world, all_ranks, mix, kind, pools=POOLS, steps=2, cache=None):
    """The module against the float64 dense reference (loss = sum(pooled * G)); ``cache``:
    the tables in host memory (see ``tiered_plan``)."""
    group = world.world
    tables = make_tables(kind, pools)
    plan = make_plan(tables, mix, group)
    if cache is not None:
        plan = tiered_plan(plan, tables, cache)
    mod = ShardedEmbeddingBagCollection(tables, plan, group)
    rng = np.random.default_rng(77)
    ref = Reference(tables, rng)
    mod.load_state_dict({f"embedding_bags.{t.name}.weight": torch.from_numpy(ref.w[t.name])
                         for t in tables})
    sl = slice(group.rank * BATCH, (group.rank + 1) * BATCH)
    for i in range(steps):
        bags, weights = global_batch(rng, tables, group.size, weighted=i == 1)
        g = rng.standard_normal((BATCH * group.size, mod.out_dim))
        pooled = mod(local_kjt(bags, weights, group.rank))
        want = ref.forward(bags, weights)[sl]
        err = float(np.max(np.abs(pooled.detach().numpy() - want) / (1 + np.abs(want)),
                           initial=0))
        all_ranks(err < 1e-10, f"{mix}/{kind.value} step {i}: forward differs by {err}")
        if cache is not None:  # evaluation, and a forward nobody takes the gradient of
            with torch.no_grad():
                mod(local_kjt(bags, weights, group.rank))
            mod(local_kjt(bags, weights, group.rank))
        (pooled * torch.from_numpy(g[sl])).sum().backward()
        ref.step(bags, weights, g)
    sd = mod.state_dict()
    worst = max(float(np.max(np.abs(sd[f"embedding_bags.{t.name}.weight"].numpy() -
                                    ref.w[t.name]))) for t in tables)
    all_ranks(worst < 1e-10, f"{mix}/{kind.value}: tables differ from the reference by {worst}")
    return tables, sd


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda k: k.value)
@pytest.mark.parametrize("mix", list(MIXES))
def test_every_sharding_trains_through_autograd(world, all_ranks, mix, kind):
    skip_if_uneven(mix, world)
    # float64 tables: the module's tensors are float64 too
    _train(world, all_ranks, mix, kind)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mix", ["tw", "rw", "mixed"])
def test_host_resident_tables_through_autograd(world, all_ranks, mix):
    """Cached and host tables train through autograd; a no_grad forward between steps and a
    forward whose backward is skipped leave no step open."""
    _train(world, all_ranks, mix, OptimizerKind.ADAM, steps=3, cache=2)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mix", ["tw", "cw", "dp", "twcw", "mixed"])
def test_max_pooling_through_autograd(world, all_ranks, mix):
    _train(world, all_ranks, mix, OptimizerKind.ADAM, MAX_POOLS, steps=3)


@pytest.mark.mpi(min_size=1)
def test_a_state_dict_loads_at_another_world_size(world, all_ranks):
    """Saved from a mixed plan over the world, loaded into one rank's planner-made module."""
    tables, sd = _train(world, all_ranks, "mixed", OptimizerKind.SGD)
    alone = ShardedEmbeddingBagCollection(tables, group=own_group(world))
    alone.load_state_dict(sd)
    back = alone.state_dict()
    all_ranks(all(torch.equal(back[k], v) for k, v in sd.items()), "state dict changed")
    rng = np.random.default_rng(5)
    bags, weights = global_batch(rng, tables, world.size, weighted=False)
    mod = ShardedEmbeddingBagCollection(tables, make_plan(tables, "mixed", world.world),
                                        world.world)
    mod.load_state_dict(sd)
    with torch.no_grad():
        mine = mod(local_kjt(bags, weights, world.rank))
        one = alone(local_kjt(bags, weights, world.rank))
    all_ranks(torch.allclose(mine, one, rtol=1e-12, atol=1e-12), "outputs differ")


@pytest.mark.mpi(min_size=1)
def test_the_planners_plan_for_the_group(world, all_ranks):
    tables = make_tables(OptimizerKind.ROWWISE_ADAGRAD, MAX_POOLS)
    mod = ShardedEmbeddingBagCollection(tables, group=world.world)
    kinds = {p.table: p.sharding.value for p in mod.plan.tables}
    all_ranks(mod.plan.world_size == world.size and "row_wise" not in kinds["t0"], f"{kinds}")
    pooled = mod(local_kjt(*global_batch(np.random.default_rng(6), tables, world.size, False),
                           world.rank))
    pooled.sum().backward()
    all_ranks(pooled.shape == (BATCH, mod.out_dim), f"{pooled.shape}")
