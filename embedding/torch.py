"""Sharded embedding bags as a ``torch.nn.Module``, the optimizer fused into the backward.

:class:`ShardedEmbeddingBagCollection` is neocomm's sharded collection
(:class:`~embedding.collection.ShardedEmbeddingCollection`) seen from
PyTorch: the same table configs and plan, a forward on a jagged batch that
returns a dense ``[B, sum of feature dims]`` tensor taking part in autograd,
and the tables' sparse optimizer applied during ``loss.backward()``, as
TorchRec's fused ``EmbeddingBagCollection`` does. Dense parameters stay with
the user's own optimizer (and DDP)::

    from embedding.torch import ShardedEmbeddingBagCollection
    ebc = ShardedEmbeddingBagCollection(tables, plan)     # every rank, same args
    pooled = ebc(features)                # torch.Tensor [B, out_dim], requires grad
    loss = model(dense, pooled, labels)
    loss.backward()                       # reverse dists + fused update of the tables
    dense_opt.step()

``features`` is a :class:`~embedding.jagged.KeyedJagged`, a TorchRec
``KeyedJaggedTensor`` (anything with ``keys()``, ``values()``, ``lengths()``
and ``weights_or_none()``) or ``{feature: (values, lengths[, weights])}``
of tensors or arrays. Every rank calls forward and backward in the same
order (they are collective steps); in ``torch.no_grad()`` or after
``loss.backward()`` is skipped, nothing is updated and nothing waits.

The pooled tensor shares memory with the collection's output (CPU: NumPy,
CUDA: CuPy through DLPack) and a contiguous gradient is read in place: no
copy on the way in or out. ``state_dict()`` holds each table whole, under
``embedding_bags.<table>.weight`` (TorchRec's key), gathered from the
shards; ``load_state_dict()`` takes whole tables, so a state saved at one
world size or plan loads at any other. Both are collective calls.

This module imports torch; nothing else in neocomm does.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from collectives.arrays import Refused, native, to_torch
from embedding.collection import ShardedEmbeddingCollection
from embedding.jagged import KeyedJagged
from embedding.types import IdPolicy, ShardingPlan, TableConfig

__all__ = ["ShardedEmbeddingBagCollection", "as_keyed_jagged", "init_process_group",
           "plan_for_group"]

_PREFIX = "embedding_bags."


def _host(x, what: str) -> np.ndarray:
    """A NumPy view of a CPU tensor or array (ids and lengths travel on the host)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            x = x.cpu()  # ids go to the host for the input dist in any case
        return x.detach().numpy()
    try:
        return np.asarray(x)
    except Exception as exc:
        raise TypeError(f"{what}: expected a tensor or an array, got {type(x).__name__}"
                        ) from exc


def as_keyed_jagged(features) -> KeyedJagged:
    """``features`` (see module doc) as neocomm's :class:`~embedding.jagged.KeyedJagged`."""
    if isinstance(features, KeyedJagged):
        return features
    if all(hasattr(features, a) for a in ("keys", "values", "lengths", "weights_or_none")):
        weights = features.weights_or_none()
        return KeyedJagged(list(features.keys()), _host(features.values(), "values"),
                           _host(features.lengths(), "lengths"),
                           None if weights is None else _host(weights, "weights"))
    if isinstance(features, Mapping):
        items = {}
        for key, item in features.items():
            if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
                raise TypeError(f"features[{key!r}]: expected (values, lengths[, weights]), "
                                f"got {type(item).__name__}")
            items[key] = tuple(_host(v, f"features[{key!r}]") for v in item)
        return KeyedJagged.from_dict(items)
    raise TypeError(f"features: expected a KeyedJagged, a KeyedJaggedTensor or {{feature: "
                    f"(values, lengths[, weights])}}, got {type(features).__name__}")


class _Pool(torch.autograd.Function):
    """Forward: lookup + output dist. Backward: reverse dists + fused optimizer."""

    @staticmethod
    def forward(ctx, anchor, module, batch):
        pooled, state = module.collection.forward_with_context(batch)
        ctx.module, ctx.state = module, state
        return to_torch(pooled)

    @staticmethod
    def backward(ctx, grad):
        module, state = ctx.module, ctx.state
        ctx.state = None
        module.collection.backward(module._from_torch(grad, "grad"), state)
        return grad.new_zeros(0), None, None


class ShardedEmbeddingBagCollection(torch.nn.Module):
    """Embedding tables sharded over a neocomm group, as a module (see module doc).

    ``tables`` and ``plan`` are those of
    :class:`~embedding.collection.ShardedEmbeddingCollection` (``plan=None``:
    the planner's plan for ``group``, every rank computing the same one).
    ``device``: ``"cpu"`` or ``"cuda"`` (the rank's current GPU; tensors in
    and out are CUDA tensors). The other keyword arguments pass through.
    """

    def __init__(self, tables: Sequence[TableConfig], plan: ShardingPlan | None = None,
                 group=None, *, device: str | torch.device = "cpu", dtype: str | None = None,
                 dedup: bool = False, threads: int = 1,
                 id_policy: IdPolicy | Mapping[str, IdPolicy] = IdPolicy.ERROR, seed: int = 0,
                 batch_size: int = 1024):
        super().__init__()
        from neocomm.world import group_or_world

        group = group_or_world(group)
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
        if plan is None:
            plan = plan_for_group(tables, group, batch_size)
        self.collection = ShardedEmbeddingCollection(
            tables, plan, group, device=kind, dtype=dtype, threads=threads, dedup=dedup,
            id_policy=id_policy, seed=seed)
        self.plan = plan
        self.tables = self.collection.tables
        self._device = torch.device(kind)
        # autograd calls a Function's backward only when an input requires grad: an empty
        # leaf tensor (not a parameter: no dense optimizer or DDP sees it)
        self._anchor = torch.zeros(0, device=self._device, requires_grad=True)

    @property
    def out_dim(self) -> int:
        return self.collection.out_dim

    def columns(self) -> dict[str, tuple[int, int]]:
        """``{feature: (first column, dim)}`` of the pooled output."""
        return self.collection.columns()

    def extra_repr(self) -> str:
        kinds = sorted({p.sharding.value for p in self.plan.tables})
        return (f"tables={[t.name for t in self.tables]}, out_dim={self.out_dim}, "
                f"shardings={kinds}, device={self._device.type}")

    def forward(self, features) -> torch.Tensor:
        """Pooled embeddings of this rank's batch, ``[B, out_dim]`` (collective)."""
        batch = features if hasattr(features, "pending") else as_keyed_jagged(features)
        if not torch.is_grad_enabled():
            return to_torch(self.collection.forward_with_context(batch, grad=False)[0])
        return _Pool.apply(self._anchor, self, batch)

    def split(self, pooled: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{feature: pooled[:, its columns]}`` (views)."""
        return {f: pooled[:, c:c + d] for f, (c, d) in self.columns().items()}

    # -- tensors in and out -------------------------------------------------------------
    def _from_torch(self, t: torch.Tensor, what: str):
        """A NumPy or CuPy view of ``t`` (contiguous, on this module's device and dtype)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type != self._device.type:
            raise ValueError(f"{what}: a tensor on {t.device}, the tables are on "
                             f"{self._device.type}")
        t = t.detach()
        want = getattr(torch, self.collection.env.dtype.name)
        if t.dtype != want:
            t = t.to(want)
        view, _ = native(t.contiguous(), what)
        if isinstance(view, Refused):  # another GPU than this rank's
            raise ValueError(view.message)
        return view

    # -- whole tables in the state dict ---------------------------------------------------
    def full_table(self, name: str) -> torch.Tensor:
        """Table ``name``'s whole ``[num_rows, dim]`` weights on every rank (collective)."""
        return torch.from_numpy(self.collection.gather_table(name))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for t in self.tables:
            destination[f"{prefix}{_PREFIX}{t.name}.weight"] = self.full_table(t.name)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        names = {f"{prefix}{_PREFIX}{t.name}.weight": t for t in self.tables}
        for key, table in names.items():
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            try:
                self.collection.load_table(table.name, _host(value, key))
            except (ValueError, TypeError) as exc:
                error_msgs.append(f"{key}: {exc}")
        for key in state_dict:
            if key.startswith(prefix + _PREFIX) and key not in names:
                unexpected_keys.append(key)


def plan_for_group(tables: Sequence[TableConfig], group, batch_size: int = 1024
                   ) -> ShardingPlan:
    """The planner's plan of ``tables`` for ``group``: its size and node layout, this
    host's memory over its ranks, ``batch_size`` samples per rank."""
    from embedding.planner import Hardware, Workload, plan_sharding
    from embedding.train.setup import host_memory, ranks_per_node_of

    rpn = ranks_per_node_of(group)
    hw = Hardware(group.size, rpn, max(1, host_memory() // rpn))
    return plan_sharding(tables, hw, Workload(batch_size=batch_size)).plan


def init_process_group(backend: str = "gloo", world=None, **kw):
    """Start ``torch.distributed`` on the ranks of a neocomm world (every rank calls it).

    For the dense, data-parallel part of a model (DDP) beside neocomm's
    embeddings in the same processes, launched by ``neocomm run``: rank and
    world size are the world's, and rank 0's host and a free port on it,
    sent to every rank over MPI, are the rendezvous (``MASTER_ADDR``,
    ``MASTER_PORT`` as given in the environment win). ``backend`` is
    ``"gloo"`` (CPU) or ``"nccl"`` (GPU); ``kw`` goes to
    ``torch.distributed.init_process_group``. Returns the world.
    """
    import os
    import socket

    import torch.distributed as dist

    from neocomm.world import current_world

    world = world if world is not None else current_world()
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    mine = None
    if world.rank == 0 and (addr is None or port is None):
        with socket.socket() as sock:  # a port free now; torch binds it right after
            sock.bind(("", 0))
            mine = (addr or socket.gethostname(), port or str(sock.getsockname()[1]))
    chosen = world.world.comm.bcast(mine, root=0)
    if chosen is not None:
        addr, port = chosen
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=world.rank,
                            world_size=world.size, **kw)
    return world
