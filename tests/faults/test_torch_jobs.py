"""neocomm's embeddings and torch.distributed's DDP in the same processes of one job.

Collected only where torch is installed (tests/conftest.py says so when it is not).
"""
from __future__ import annotations

import re

from _jobs import python_job

JOB_TIMEOUT = 180


def test_ddp_over_gloo_beside_neocomm_embeddings(tmp_path):
    """`neocomm run` starts the job; embedding.torch.init_process_group starts gloo on the
    same ranks; a DLRM-like step: neocomm's sharded tables, a DDP MLP, one loss."""
    out = python_job(tmp_path, """
import numpy as np
import torch
import torch.distributed as dist

import collectives as C
import neocomm
from embedding.torch import ShardedEmbeddingBagCollection, init_process_group
from embedding.types import OptimizerConfig, TableConfig

w = neocomm.init()
init_process_group("gloo")
assert (dist.get_rank(), dist.get_world_size()) == (w.rank, w.size)
torch.manual_seed(0)
opt = OptimizerConfig("rowwise_adagrad", lr=0.2)
tables = [TableConfig("item", 1000, 8, "sum", ("item",), optimizer=opt),
          TableConfig("user", 500, 8, "mean", ("user",), optimizer=opt)]
ebc = ShardedEmbeddingBagCollection(tables)
mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
dense = torch.nn.parallel.DistributedDataParallel(mlp)
sgd = torch.optim.SGD(dense.parameters(), lr=0.2)
rng = np.random.default_rng(100 + w.rank)
losses = []
for step in range(40):
    item, user = rng.integers(0, 1000, 64), rng.integers(0, 500, 64)
    label = torch.from_numpy((item % 2).astype(np.float32))   # learnable from the item alone
    pooled = ebc({"item": (item, np.ones(64, np.int64)), "user": (user, np.ones(64, np.int64))})
    loss = torch.nn.functional.binary_cross_entropy_with_logits(dense(pooled).squeeze(1), label)
    sgd.zero_grad()
    loss.backward()           # DDP's gloo AllReduce and neocomm's embedding backward
    sgd.step()
    losses.append(loss.item())
flat = torch.cat([p.detach().reshape(-1) for p in dense.parameters()])
every = C.all_gather(flat)    # neocomm's collective on a torch tensor
same = all(torch.equal(every[0], every[r]) for r in range(w.size))
gathered = [torch.zeros_like(flat) for _ in range(w.size)]
dist.all_gather(gathered, flat)
agree = all(torch.equal(g, every[r]) for r, g in enumerate(gathered))
print(f"OK rank {w.rank} same {same} agree {agree} first {np.mean(losses[:5]):.4f} "
      f"last {np.mean(losses[-5:]):.4f}", flush=True)
# the DDP module holds the gloo group: free it first, so that destroying the group joins
# gloo's threads now (left to interpreter exit, one may abort the process: a torch issue)
del dense
import gc; gc.collect()
dist.destroy_process_group()
""", n=2, timeout=JOB_TIMEOUT).check_clean()
    assert out.returncode == 0, out.output
    found = re.findall(r"OK rank (\d) same (\w+) agree (\w+) first ([\d.]+) last ([\d.]+)",
                       out.stdout)
    assert sorted(r for r, *_ in found) == ["0", "1"], out.output
    for rank, same, agree, first, last in found:
        assert same == "True" and agree == "True", out.stdout
        assert float(last) < float(first) - 0.05, out.stdout


def test_the_torch_dlrm_example_matches_neocomms_trainer(tmp_path):
    """scripts/torch_dlrm.py: plain PyTorch DLRM with the sharded module, on the built-in
    data for the default 500 steps, against neocomm's trainer on the same: AUC within 0.003."""
    import sys
    from pathlib import Path

    from _jobs import run_job

    script = Path(__file__).resolve().parents[2] / "scripts" / "torch_dlrm.py"
    out = run_job([sys.executable, str(script), "--compare"], n=2, cwd=tmp_path,
                  timeout=JOB_TIMEOUT).check_clean()
    assert out.returncode == 0, out.output
    mine = re.search(r"neocomm embeddings: 500 steps .* held-out AUC (0\.\d+)", out.stdout)
    theirs = re.search(r"neocomm's trainer: held-out AUC (0\.\d+)", out.stdout)
    assert mine and theirs, out.output
    assert float(mine[1]) > 0.74 and abs(float(mine[1]) - float(theirs[1])) <= 0.003, \
        out.stdout
    assert not (tmp_path / "neocomm-out").exists()  # the comparison writes nothing


def test_an_exception_after_torch_distributed_starts_is_still_shown(tmp_path):
    """torch.distributed puts its own excepthook in front of neocomm's and points stderr at a
    buffer while ours runs; ours aborts the job, so it writes to the file descriptor itself."""
    out = python_job(tmp_path, """
import neocomm
from embedding.torch import init_process_group

w = neocomm.init()
init_process_group("gloo")
if w.rank == 1:
    raise RuntimeError("rank one is broken")
import collectives, numpy as np
collectives.all_reduce(np.ones(4))
""", n=2, timeout=JOB_TIMEOUT).check_clean()
    assert out.returncode not in (0, 124), out.output
    assert "rank 1 failed with an unhandled exception" in out.stderr, out.output
    assert "RuntimeError: rank one is broken" in out.stderr, out.output


def test_the_torchrec_benchmark_runs_and_says_what_it_compared(tmp_path):
    """scripts/bench_torchrec.py on a small model; TorchRec's column says why it is empty
    where torchrec is not installed (CI) or cannot run the sharding (row-wise on CPU)."""
    import sys
    from pathlib import Path

    from _jobs import run_job

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_torchrec.py"
    out = run_job([sys.executable, str(script), "--tables", "3", "--rows", "1000", "--batch",
                   "64", "--steps", "2", "--repeat", "1"], n=2, cwd=tmp_path,
                  timeout=JOB_TIMEOUT).check_clean()
    assert out.returncode == 0, out.output
    rows = {m[2]: m[3] for m in re.finditer(r"^\s*(\d+) (\w+)\s+([\d,]+) ", out.stdout, re.M)}
    assert set(rows) == {"table_wise", "row_wise", "column_wise", "data_parallel"}, out.stdout
    assert all(int(v.replace(",", "")) > 0 for v in rows.values()), out.stdout
    assert re.search(r"^\s*1 row_wise .*(not available on CPU|torchrec not installed)",
                     out.stdout, re.M)
    assert "fused sgd, 1 Zipf ids per bag" in out.stdout, out.stdout
    # every timing ran the compiled kernels: the warm-up waited out the first second of the
    # process's embedding work, when the NumPy kernels serve
    assert "neocomm's CPU kernels: compiled\n" in out.stdout, out.stdout
    # each side's page faults per step, before the cut (TorchRec's after a slash when it ran)
    faults = {m[1]: m[2] for m in re.finditer(r"^\s*1 (\w+)\s.*?([\d,]+(?: / [\d,]+)?)  \d+ x ",
                                              out.stdout, re.M)}
    assert set(faults) == set(rows) and "faults/step" in out.stdout, out.stdout
    # how a table was cut, for each sharding (and TorchRec's cut where it differs): column-wise
    # splits the 16 columns over both ranks on both sides
    cuts = {m[1]: m[2] for m in re.finditer(r"^\s*1 (\w+)\s.*  (\d.*)$", out.stdout, re.M)}
    assert cuts == {"table_wise": "1 x 1000x16", "row_wise": "2 x 500x16",
                    "column_wise": "2 x 1000x8", "data_parallel": "2 x 1000x16 replicas"}, \
        out.stdout


def test_the_trainer_benchmark_times_the_compiled_kernels_on_every_rank(tmp_path):
    """scripts/bench_train.py on a small model: every rank loads the compiled kernels before
    the warm-up (not after its first second of embedding work), and the header says so for
    all of them."""
    import sys
    from pathlib import Path

    from _jobs import run_job

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_train.py"
    out = run_job([sys.executable, str(script), "--tables", "3", "--rows", "1000", "--dim", "8",
                   "--local-batch", "64", "--steps", "2", "--rounds", "1", "--warmup", "1"],
                  n=2, cwd=tmp_path, timeout=JOB_TIMEOUT).check_clean()
    assert out.returncode == 0, out.output
    assert re.search(r"^bench_train: 2 rank\(s\), 3 tables .* compiled kernels, ", out.stdout,
                     re.M), out.stdout
    rates = re.findall(r"^(overlap_on|overlap_off|embedding_only)\s+([\d,]+) ", out.stdout, re.M)
    assert [k for k, _ in rates] == ["overlap_on", "overlap_off", "embedding_only"], out.stdout
    assert all(int(v.replace(",", "")) > 0 for _, v in rates), out.stdout
