"""Errors caused by a user's input name the argument and the value as given, in the
user's terms: never an enum's class, an internal code or a digest."""
from __future__ import annotations

import re

import numpy as np
import pytest

from neocomm.errors import CollectiveArgumentError


# -- vocabulary of the embedding layer ----------------------------------------------

def test_sparse_optimizer_kind_names_the_argument():
    from embedding.types import OptimizerConfig

    with pytest.raises(ValueError, match=r"kind: expected one of \['sgd', .*got 'adagrad'"):
        OptimizerConfig(kind="adagrad")


def test_table_name_shows_the_empty_name():
    from embedding.types import TableConfig

    with pytest.raises(ValueError, match=r"name: a table needs a non-empty name, got ''"):
        TableConfig(name="", num_rows=4, dim=2)


def test_table_pooling_names_the_table_and_value():
    from embedding.types import TableConfig

    with pytest.raises(ValueError, match=r"pooling of table 'user': expected one of "
                                         r"\['sum', 'mean', 'max'\], got 'min'"):
        TableConfig(name="user", num_rows=4, dim=2, pooling="min")


def test_plan_sharding_names_the_table_and_value():
    from embedding.types import ShardingPlan

    text = ('{"world_size": 1, "ranks_per_node": 1, "tables": [{"table": "user", '
            '"sharding": "diagonal", "shards": []}]}')
    with pytest.raises(ValueError, match=r"sharding of table 'user': expected one of "
                                         r"\[.*'table_wise'.*\], got 'diagonal'"):
        ShardingPlan.from_json(text)


def test_table_constraints_shardings_name_the_position():
    from embedding.planner.types import TableConstraints

    with pytest.raises(ValueError, match=r"shardings\[1\]: expected one of .*got 'diagonal'"):
        TableConstraints(shardings=("row_wise", "diagonal"))


def test_optimizer_kind_of_estimate_and_state_specs():
    from embedding.optim import state_specs
    from embedding.planner.estimate import optimizer_bytes

    with pytest.raises(ValueError, match=r"kind: expected one of .*got 'lamb'"):
        optimizer_bytes("lamb", 10, 4)
    with pytest.raises(ValueError, match=r"kind: expected one of .*got 'lamb'"):
        state_specs("lamb")


def test_id_policies_of_jagged_inputs():
    from embedding.jagged import KeyedJagged, apply_id_policy

    kjt = KeyedJagged.from_dict({"user": ([1, 2], [1, 1])})
    with pytest.raises(ValueError, match=r"policies\['user'\]: expected one of "
                                         r"\['error', 'modulo', 'hash'\], got 'clip'"):
        kjt.check_ids({"user": 10}, {"user": "clip"})
    with pytest.raises(ValueError, match=r"policy: expected one of .*got 'clip'"):
        apply_id_policy(np.arange(3), 10, "clip")


@pytest.fixture(scope="module")
def world():
    import neocomm

    return neocomm.init()


def _one_table_plan(rows=8, dim=4):
    from embedding.types import Shard, ShardingPlan, TableConfig, TablePlan

    table = TableConfig(name="user", num_rows=rows, dim=dim)
    plan = ShardingPlan(1, 1, (TablePlan("user", "table_wise", (Shard(0, 0, rows, 0, dim),)),))
    return table, plan


def test_collection_id_policy_names_the_value(world):
    from embedding.collection import ShardedEmbeddingCollection

    table, plan = _one_table_plan()
    with pytest.raises(ValueError, match=r"id_policy: expected one of .*got 'clip'"):
        ShardedEmbeddingCollection([table], plan, world.world, id_policy="clip")
    with pytest.raises(ValueError, match=r"id_policy\['user'\]: expected one of .*got 'clip'"):
        ShardedEmbeddingCollection([table], plan, world.world, id_policy={"user": "clip"})


# -- dense model, metrics, planner -------------------------------------------------

def test_dense_config_dtype_and_optimizer_kind():
    from embedding.dense.types import DenseConfig, DenseOptimizerConfig

    with pytest.raises(ValueError, match=r"dtype: expected float32 or float64, got 'float16'"):
        DenseConfig(num_dense=4, dtype="float16")
    with pytest.raises(ValueError, match=r"dtype: expected float32 or float64, got 'floaty'"):
        DenseConfig(num_dense=4, dtype="floaty")
    with pytest.raises(ValueError, match=r"kind: expected one of \['sgd', .*got 'lamb'"):
        DenseOptimizerConfig(kind="lamb")


def test_metrics_name_the_bad_scores_and_logits():
    from embedding.dense.metrics import auc, bce_with_logits

    with pytest.raises(ValueError, match=r"scores: expected no NaN, got 1 NaN of 3; the first "
                                         r"at index 1"):
        auc(np.array([0, 1, 1]), np.array([0.1, np.nan, 0.3]))
    with pytest.raises(ValueError, match=r"logits: expected a non-empty batch, got shape \(0,\)"):
        bce_with_logits(np.zeros(0), np.zeros(0))


def test_partition_costs_name_the_negative_cost():
    from embedding.planner.partition import greedy_partition

    with pytest.raises(ValueError, match=r"costs: expected non-negative numbers, got -2.5 at "
                                         r"index 1"):
        greedy_partition([1.0, -2.5, 3.0], 2)


def test_fused_tables_dtype_shows_the_value():
    from embedding.kernels.fused import FusedTables
    from embedding.types import OptimizerConfig

    with pytest.raises(ValueError, match=r"dtype: expected one of .*got 'int8'"):
        FusedTables([4], [2], OptimizerConfig(), dtype="int8")


def test_default_ranks_per_node_says_where_it_came_from():
    from embedding.planner.hardware import hardware_for, load_target

    target = load_target("dgx-a100")
    with pytest.raises(ValueError, match=r"ranks_per_node: expected a divisor of world_size 12, "
                                         r"got 8, the default: the devices per host of"):
        hardware_for(target, 12)


# -- data ---------------------------------------------------------------------------

def test_vocabulary_names_the_bad_key_and_row():
    from embedding.data.criteo import Vocabulary

    with pytest.raises(ValueError, match=r"keys\[0\]: expected sorted unique keys matching "
                                         r"rows, got 3 after 5 at index 1"):
        Vocabulary([np.array([5, 3])], [np.array([1, 2])], [10])
    with pytest.raises(ValueError, match=r"keys\[0\]: .*got shape \(2,\) for rows\[0\] of "
                                         r"shape \(1,\)"):
        Vocabulary([np.array([1, 2])], [np.array([1])], [10])
    with pytest.raises(ValueError, match=r"rows\[0\]: expected rows in \[1, 10\), got 12 at "
                                         r"index 1"):
        Vocabulary([np.array([1, 2])], [np.array([1, 12])], [10])


def test_preprocessor_names_encoding_missing_and_vocabulary():
    from embedding.data.criteo import Preprocessor

    sizes = [100] * 26
    with pytest.raises(ValueError, match=r"encoding: expected one of .*got 'md5'"):
        Preprocessor(sizes, encoding="md5")
    with pytest.raises(ValueError, match=r"missing: expected one of .*got 'drop'"):
        Preprocessor(sizes, missing="drop")
    with pytest.raises(ValueError, match=r"vocabulary: the vocabulary encoding needs a "
                                         r"Vocabulary, got None"):
        Preprocessor(sizes, encoding="vocabulary")


def test_binary_verify_mode_names_the_value(tmp_path):
    from embedding.data import BinaryDataset

    with pytest.raises(ValueError, match=r"verify: expected one of \['none', 'lazy', 'full'\], "
                                         r"got 'sometimes'"):
        BinaryDataset(tmp_path / "none.bin", verify="sometimes")


def test_binary_writer_names_the_non_finite_dense_value(tmp_path):
    from embedding.data import BinaryWriter, DataFormatError

    dense = np.zeros((3, 13), np.float32)
    dense[1, 2] = np.inf
    with BinaryWriter(tmp_path / "d.bin", [10] * 26) as w:
        with pytest.raises(DataFormatError, match=r"record 1: dense features hold NaN or inf: "
                                                  r"dense\[1, 2\] is inf"):
            w.write(dense, np.zeros(3), np.zeros((3, 26), np.int64))
        w.abort()


def test_binary_checksum_error_shows_no_digest(tmp_path):
    from embedding.data import (BinaryDataset, DataFormatError, SyntheticConfig,
                                SyntheticDataset, write_batches)

    sizes = (1000,) * 26
    path = tmp_path / "d.bin"
    write_batches(path, [SyntheticDataset(SyntheticConfig(table_sizes=sizes, seed=3), 200)
                         .read(0, 200)], sizes, chunk_records=100)
    data = BinaryDataset(path)
    raw = bytearray(path.read_bytes())
    raw[data.header_bytes + 150 * data.dtype.itemsize + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(DataFormatError, match=r"records \[100, 200\) fail their crc32") as err:
        BinaryDataset(path).read(150, 160)
    assert not re.search(r"0x[0-9a-f]{8}", str(err.value)), str(err.value)


def test_data_cli_records_names_the_flag(capsys):
    from neocomm.cli import main as neocomm_main

    def main(argv):  # the data tools, as `neocomm data ...` runs them
        return neocomm_main(["data", *argv])

    with pytest.raises(SystemExit) as info:
        main(["planted-auc", "--records", "0"])
    assert info.value.code == 2
    assert "argument --records: expected a positive int, got '0'" in capsys.readouterr().err


# -- runtime core and topology ------------------------------------------------------

def test_dtype_code_shows_the_dtype_as_given():
    from neocomm.types import dtype_code

    with pytest.raises(TypeError, match=r"dtype: expected one of .*got 'complex64'"):
        dtype_code("complex64")
    with pytest.raises(TypeError, match=r"dtype: expected one of .*got 'no-such-type'"):
        dtype_code("no-such-type")


def test_host_lookups_show_the_value_and_what_exists():
    import warnings

    from topology import discover_host, fixture

    fx = fixture("dgx-a100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = discover_host(root=fx.root, nvidia_smi_topo=fx.nvidia_smi_topo,
                          nvidia_smi_query=fx.nvidia_smi_query, live=False)
    with pytest.raises(KeyError, match=r"GPU 8 not on host '.*' \(its GPUs: \[0, 1, "):
        h.gpu(8)
    with pytest.raises(KeyError, match=r"GPU '3' not on host"):
        h.gpu("3")
    with pytest.raises(KeyError, match=r"NIC 'mlx5_99' not on host '.*' \(its NICs: \['mlx5_0'"):
        h.nic("mlx5_99")


def test_spec_gpu_model_without_gpus_shows_the_model():
    from topology import SpecError
    from topology.spec import parse_spec

    text = ('[fabric]\nname = "t"\n[cluster]\nnodes = 1\n[node]\ngpus = 0\n'
            'gpu_model = "A100"\n')
    with pytest.raises(SpecError, match=r"names a GPU model, 'A100', but \[node\] gpus = 0"):
        parse_spec(text, "t.toml")


def test_snapshot_errors_show_the_line_and_path(tmp_path):
    from topology.snapshot import materialize, parse_tree

    with pytest.raises(ValueError, match=r"<tree>:1: content outside a @file entry: "
                                         r"'stray text'"):
        parse_tree("stray text\n")
    with pytest.raises(ValueError, match=r"<tree>: 'a' is defined twice"):
        materialize("@file a\nx\n@link a -> b\n", tmp_path)


# -- collectives: messages in the user's words, never codes or digests ---------------

class _TwoRanks:
    """A communicator whose other rank's call differs from this rank's in signature slot
    ``slot`` (agreement prepends the operation's own number: slot 0)."""

    def __init__(self, slot: int):
        self.slot = slot

    def Allreduce(self, vec, out, op=None):  # noqa: N802 - mpi4py's name
        if isinstance(vec, list):  # [buffer, datatype]
            vec, out = vec[0], out[0]
        out[:] = vec
        out[1] += 1  # the other rank's number of its call is larger: the calls differ

    def allgather(self, mine):
        problem, names, sig, call = mine
        other = list(sig)
        other[self.slot] += 1
        return [mine, (problem, names, other, call)]


def _differing(monkeypatch, slot: int) -> None:
    """Every agreement from now on meets a rank whose call differs in ``slot``."""
    from neocomm.agree import Agreement

    real = Agreement.run
    monkeypatch.setattr(Agreement, "run",
                        lambda self, comm, *a, **kw: real(self, _TwoRanks(slot), *a, **kw))


def test_one_to_many_that_differs_shows_the_calls_as_given(world, monkeypatch):
    import collectives as C
    C.one_to_many(np.ones(4, np.float32), root=0, ranks=[0], counts=[4])  # its first call
    _differing(monkeypatch, 4)  # op id, op, root, ranks, counts
    with pytest.raises(CollectiveArgumentError) as err:
        C.one_to_many(np.ones(4, np.float32), root=0, ranks=[0], counts=[4])
    msg = str(err.value)
    assert "one_to_many: counts differs across ranks" in msg, msg
    assert "rank 0: one_to_many(root=0, ranks=[0], counts=[4])" in msg, msg


def test_symmetric_empty_that_differs_shows_the_calls_as_given(world, monkeypatch):
    from collectives import symmetric

    _differing(monkeypatch, 3)  # op id, op, dtype, shape
    with pytest.raises(CollectiveArgumentError) as err:
        symmetric.empty((4,), "float32", group=world.world)
    msg = str(err.value)
    assert "shape differs across ranks" in msg, msg
    assert "rank 0: symmetric.empty((4,), dtype='float32')" in msg, msg


def test_agreement_never_shows_a_digest():
    from neocomm.agree import agree

    with pytest.raises(CollectiveArgumentError) as err:
        agree(_TwoRanks(1), "sharding plan", None, [("plan", 123456789)])
    msg = str(err.value)
    assert "plan differs across ranks" in msg and "123456789" not in msg, msg


def test_one_to_many_dtype_mismatch_names_dtypes_not_codes(world, monkeypatch):
    import collectives as C
    from collectives import api_sparse

    # With one rank the root is the only receiver, so its dtypes are compared before the
    # payload's travels; skip that check to reach the receivers' one.
    monkeypatch.setattr(api_sparse, "check_same_dtype", lambda *a: None)
    with pytest.raises(CollectiveArgumentError,
                       match=r"recvbuf: dtype int32 differs from the root's payload "
                             r"\(float32\)"):
        C.one_to_many(np.ones(4, np.float32), np.zeros(4, np.int32), root=0, ranks=[0])
