"""DLRM in plain PyTorch, neocomm's sharded embeddings inside: your loop, the trainer's data.

    neocomm run -n 2 -- python scripts/torch_dlrm.py                 # built-in data, 500 steps
    neocomm run -n 2 -- python scripts/torch_dlrm.py --config TRAIN.toml --steps 200
    neocomm run -n 2 -- python scripts/torch_dlrm.py --compare       # and neocomm's trainer

A PyTorch user's DLRM: a bottom MLP, the dot interaction, a top MLP and the
loss in torch, the dense part under DistributedDataParallel over gloo with a
torch optimizer, and the embedding tables in
:class:`embedding.torch.ShardedEmbeddingBagCollection` (sharded by neocomm's
planner, their optimizer fused into ``loss.backward()``). The batches are the
trainer's (:func:`embedding.train.batches`): the built-in Criteo-shaped data,
or a config's own (Parquet, Criteo text, binary). Prints the held-out AUC;
``--compare`` then trains neocomm's own trainer on the same config and steps
and prints both AUCs and their difference.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch
import torch.nn.functional as F

import neocomm
from collectives import all_gather, all_reduce
from embedding.dense.metrics import auc
from embedding.torch import ShardedEmbeddingBagCollection, init_process_group
from embedding.train import Trainer, load_config
from embedding.train.data import batches, open_data
from embedding.train.setup import tables_of
from embedding.train.types import TrainConfig


def mlp(sizes, relu_last: bool) -> torch.nn.Sequential:
    """Linear layers with ReLU between (and after the last when ``relu_last``), initialised
    as in the DLRM reference: weights N(0, 2 / (fan_in + fan_out)), biases N(0, 1 / fan_out)."""
    layers = []
    for k, (i, o) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = torch.nn.Linear(i, o)
        with torch.no_grad():
            lin.weight.normal_(0.0, (2.0 / (i + o)) ** 0.5)
            lin.bias.normal_(0.0, (1.0 / o) ** 0.5)
        layers.append(lin)
        if relu_last or k < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


class DLRM(torch.nn.Module):
    """The dense part: bottom MLP, dot interaction of [x, e_1 .. e_F], top MLP -> logit."""

    def __init__(self, num_dense: int, num_sparse: int, dim: int, bottom, top):
        super().__init__()
        self.num_sparse, self.dim = num_sparse, dim
        self.bottom = mlp([num_dense, *bottom], relu_last=True)
        n = num_sparse + 1
        self.register_buffer("pairs", torch.tril_indices(n, n, offset=-1), persistent=False)
        self.top = mlp([dim + n * (n - 1) // 2, *top], relu_last=False)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        t = torch.cat([x[:, None], pooled.view(-1, self.num_sparse, self.dim)], dim=1)
        z = torch.bmm(t, t.transpose(1, 2))
        i, j = self.pairs
        return self.top(torch.cat([x, z[:, i, j]], dim=1)).squeeze(1)


def held_out_auc(world, cfg, data, ebc, model) -> float:
    """AUC over every record of the first evaluation set (each rank scores its part)."""
    name = data.evaluation_sets[0][0]
    scores, labels = [], []
    with torch.no_grad():
        for batch in batches(cfg, name, rank=world.rank, world_size=world.size, data=data):
            b = len(batch.labels)
            # every rank must pool the same batch size: the last batch may differ by one
            most = int(all_reduce(np.array([b]), op="max")[0])
            pad = np.concatenate([np.arange(b), np.zeros(most - b, np.int64)])
            part = batch.take(pad) if most > b else batch
            logit = model(torch.from_numpy(part.dense), ebc(part.to_jagged()))
            scores.append(logit[:b].numpy())
            labels.append(batch.labels)
    mine = np.stack([np.concatenate(scores), np.concatenate(labels)]).astype(np.float64)
    n = int(all_reduce(np.array([mine.shape[1]]), op="max")[0])
    padded = np.full((3, n), np.nan)
    padded[:2, :mine.shape[1]], padded[2, :mine.shape[1]] = mine, 1
    every = all_gather(padded.reshape(-1)).reshape(world.size, 3, n)
    keep = every[:, 2].reshape(-1) == 1
    return float(auc(every[:, 1].reshape(-1)[keep], every[:, 0].reshape(-1)[keep]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a training config (default: the built-in defaults)")
    ap.add_argument("--steps", type=int, help="training steps (default: the config's)")
    ap.add_argument("--compare", action="store_true",
                    help="then train neocomm's own trainer on the same config and steps")
    args = ap.parse_args(argv)
    world = neocomm.init()
    init_process_group("gloo")
    torch.manual_seed(0)
    cfg = load_config(args.config) if args.config else TrainConfig()
    if args.steps:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=args.steps))
    from embedding.train.batching import resolve_batches

    cfg = resolve_batches(cfg, world.size)  # the default batch, fitted to the ranks
    data = open_data(cfg, world.world)
    tables = tables_of(cfg, data)
    m = cfg.model
    ebc = ShardedEmbeddingBagCollection(tables, group=world.world, seed=cfg.train.seed,
                                        batch_size=cfg.train.batch_size // world.size)
    model = torch.nn.parallel.DistributedDataParallel(
        DLRM(data.num_dense, len(data.feature_names), m.embedding_dim, m.bottom_mlp,
             m.top_mlp))
    d = cfg.dense_optimizer
    opt = torch.optim.Adam(model.parameters(), lr=d.lr, betas=(d.beta1, d.beta2), eps=d.eps)
    t0 = time.perf_counter()
    stream = batches(cfg, "train", rank=world.rank, world_size=world.size, epochs=None,
                     data=data)
    for step, batch in zip(range(1, cfg.train.steps + 1), stream):
        pooled = ebc(batch.to_jagged())
        # DDP averages the dense gradients over ranks; the tables' gradient gets the same
        # mean: the gradient of the global batch's mean loss
        pooled.register_hook(lambda g: g / world.size)
        loss = F.binary_cross_entropy_with_logits(
            model(torch.from_numpy(batch.dense), pooled), torch.from_numpy(batch.labels))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if world.rank == 0 and (step % 100 == 0 or step == cfg.train.steps):
            print(f"step {step}/{cfg.train.steps}  loss {loss.item():.4f}", flush=True)
    seconds = time.perf_counter() - t0
    mine = held_out_auc(world, cfg, data, ebc, model.module)
    samples = cfg.train.steps * cfg.train.batch_size
    if world.rank == 0:
        print(f"torch DLRM with neocomm embeddings: {cfg.train.steps} steps in {seconds:.1f} s "
              f"({samples / seconds:,.0f} samples/s) on {world.size} rank(s); held-out AUC "
              f"{mine:.4f}", flush=True)
    if args.compare:
        trainer = Trainer(cfg, world.world, data=data, outputs=False)
        trainer.train()
        trainer.close()
        theirs = float(trainer.last_eval["auc"])
        if world.rank == 0:
            print(f"neocomm's trainer: held-out AUC {theirs:.4f}; difference "
                  f"{mine - theirs:+.4f}", flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
