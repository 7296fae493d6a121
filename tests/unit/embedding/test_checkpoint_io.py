"""Checkpoint writes: atomicity, latest resolution, checksums, model checks and the CLI."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from embedding.checkpoint import (Checkpoint, CheckpointError, CheckpointMismatchError,
                                  CheckpointWriter, ChecksumError, Manifest, TensorSlice,
                                  latest_checkpoint, list_checkpoints, load_checkpoint, prune,
                                  save_checkpoint)
from embedding.checkpoint.types import MANIFEST, MARKER
from embedding.types import TableConfig
from neocomm.cli import main as cli

TABLES = [TableConfig("users", 6, 4)]


def arrays(step=1):
    w = np.arange(24, dtype=np.float32).reshape(6, 4) + step
    return ({"emb/users/weight": w, "dense/params": np.full(9, step, np.float64),
             "opt/steps": np.asarray(step, np.int64)},
            {"emb/users/weight": TensorSlice("users", "weight", (0, 0), (6, 4))})


def save(root, step, **kw):
    a, s = arrays(step)
    return save_checkpoint(root, step, a, s, tables=TABLES,
                           state={"data": {"epoch": 0, "batch": step}}, **kw)


def test_round_trip_and_manifest(tmp_path):
    path = save(tmp_path, 3)
    assert path.name == "step-000000000003"
    ckpt = Checkpoint(path)
    m = ckpt.manifest
    assert (m.step, m.world_size, m.state, m.tables) == (3, 1, {"data": {"epoch": 0, "batch": 3}},
                                                         tuple(TABLES))
    assert {f.name for f in m.files} == {"emb/users/weight", "dense/params", "opt/steps"}
    assert all(f.checksum.startswith("crc32:") and f.bytes > 0 for f in m.files)
    np.testing.assert_array_equal(ckpt.read_array("emb/users/weight"),
                                  arrays(3)[0]["emb/users/weight"])
    steps = ckpt.read_array("opt/steps")
    assert steps.shape == () and steps == 3  # 0-d arrays keep their shape
    assert all(s.status == "ok" for s in ckpt.verify())
    assert Manifest.from_json(m.to_json()) == m
    text = (path / MANIFEST).read_text()
    assert "allow_pickle" not in text and json.loads(text)["format"] == "neocomm-checkpoint"
    for f in m.files:  # plain .npy files that NumPy reads without pickle
        np.load(path / f.path, allow_pickle=False)


def test_rng_and_data_position_round_trip_through_the_manifest(tmp_path):
    rng = np.random.default_rng(123)
    rng.random(5)
    a, s = arrays()
    save_checkpoint(tmp_path, 9, a, s, state={"rng": rng.bit_generator.state,
                                              "data": {"epoch": 2, "batch": 31}})
    expect = rng.random(4)
    state = load_checkpoint(tmp_path).state
    again = np.random.default_rng()
    again.bit_generator.state = state["rng"]
    np.testing.assert_array_equal(again.random(4), expect)
    assert state["data"] == {"epoch": 2, "batch": 31}


def test_sha256_option(tmp_path):
    path = save(tmp_path, 1, checksum="sha256")
    ckpt = Checkpoint(path)
    assert all(f.checksum.startswith("sha256:") and len(f.checksum) == 7 + 64
               for f in ckpt.manifest.files)
    assert all(s.status == "ok" for s in ckpt.verify())


def test_killed_mid_checkpoint_leaves_the_previous_one_loading(tmp_path):
    save(tmp_path, 10)
    # step 20: two ranks wrote their files, the job died before rank 0 committed
    for r in range(2):
        a, s = arrays(20)
        CheckpointWriter(tmp_path, 20, r, 2).write(a, s)
    # half of rank 0's last file is what a kill during the write leaves behind
    tmp = tmp_path / ".tmp-step-000000000020"
    victim = sorted(tmp.glob("rank-00000/*.npy"))[0]
    victim.write_bytes(victim.read_bytes()[:40])
    assert latest_checkpoint(tmp_path).name == "step-000000000010"
    assert load_checkpoint(tmp_path).step == 10
    # step 30: published without a marker (a copy or a crash between rename and marker)
    save(tmp_path, 30)
    (tmp_path / "step-000000000030" / MARKER).unlink()
    # step 40: manifest edited after the marker was written
    save(tmp_path, 40)
    m = tmp_path / "step-000000000040" / MANIFEST
    m.write_text(m.read_text().replace('"step": 40', '"step": 41'))
    infos = {i.step: i for i in list_checkpoints(tmp_path)}
    assert infos[10].complete and not infos[30].complete and not infos[40].complete
    assert "no COMPLETE marker" in infos[30].why and "does not match" in infos[40].why
    assert load_checkpoint(tmp_path).step == 10
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        Checkpoint(tmp_path / "step-000000000030")
    # the interrupted step is retried and now publishes; the stale temp dir is gone
    for r in range(2):
        a, s = arrays(20)
        CheckpointWriter(tmp_path, 20, r, 2).write(a, s)
    CheckpointWriter(tmp_path, 20, 0, 2).commit(tables=TABLES)
    assert not tmp.exists()
    assert Checkpoint(tmp_path / "step-000000000020").verify()[0].status == "ok"


def test_commit_refuses_missing_rank_parts(tmp_path):
    a, s = arrays()
    CheckpointWriter(tmp_path, 5, 0, 3).write(a, s)
    CheckpointWriter(tmp_path, 5, 2, 3).write(a, s)
    with pytest.raises(CheckpointError, match="rank 1 has not written its part"):
        CheckpointWriter(tmp_path, 5, 0, 3).commit()
    with pytest.raises(RuntimeError, match="only rank 0"):
        CheckpointWriter(tmp_path, 5, 2, 3).commit()
    assert latest_checkpoint(tmp_path) is None


def test_save_checkpoint_with_a_barrier_across_threads(tmp_path):
    barrier = threading.Barrier(2)
    errors = []

    def rank(r):
        try:
            a = {"part": np.full(3, r, np.int32)}
            s = {"part": TensorSlice("t", "weight", (3 * r,), (6,))}
            save_checkpoint(tmp_path, 7, a, s, rank=r, world_size=2, barrier=barrier.wait)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.manifest.world_size == 2
    from embedding.checkpoint import read_box

    assert read_box(ckpt, "t", "weight", (0,), (6,)).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="barrier"):
        save_checkpoint(tmp_path, 8, {}, rank=0, world_size=2)


def corrupt(path, name):
    rec = next(f for f in Checkpoint(path).manifest.files if f.name == name)
    raw = bytearray((path / rec.path).read_bytes())
    raw[-3] ^= 0x40
    (path / rec.path).write_bytes(bytes(raw))
    return rec


def test_bad_checksum_is_refused_with_the_file_named(tmp_path):
    path = save(tmp_path, 2)
    rec = corrupt(path, "dense/params")
    ckpt = load_checkpoint(tmp_path)
    np.testing.assert_array_equal(ckpt.read_array("emb/users/weight"),
                                  arrays(2)[0]["emb/users/weight"])
    with pytest.raises(ChecksumError, match=f"file {rec.path} .*'dense/params' of rank 0.* has "
                                            f"checksum crc32:.*refusing") as e:
        ckpt.read_array("dense/params")
    assert e.value.file == rec.path
    with pytest.raises(ChecksumError):
        ckpt.verify_or_raise()
    assert {s.record.name: s.status for s in ckpt.verify()}["dense/params"] == "bad-checksum"
    unchecked = Checkpoint(path, verify=False)  # explicit opt-out reads the bytes as they are
    assert unchecked.read_array("dense/params").shape == (9,)


def test_truncated_and_missing_files(tmp_path):
    path = save(tmp_path, 2)
    ckpt = Checkpoint(path)
    recs = {f.name: f for f in ckpt.manifest.files}
    p = path / recs["dense/params"].path
    p.write_bytes(p.read_bytes()[:-8])
    (path / recs["opt/steps"].path).unlink()
    status = {s.record.name: s.status for s in ckpt.verify()}
    assert status == {"emb/users/weight": "ok", "dense/params": "bad-size", "opt/steps": "missing"}
    with pytest.raises(ChecksumError, match="is missing"):
        ckpt.read_array("opt/steps")
    with pytest.raises(ChecksumError, match="bytes, the manifest records"):
        ckpt.read_array("dense/params")


def test_manifest_that_does_not_match_the_model_is_refused(tmp_path):
    ckpt = Checkpoint(save(tmp_path, 2))
    ckpt.check_compatible(TABLES, {"dense/params": ((9,), np.float64)})
    with pytest.raises(CheckpointMismatchError, match="table 'users': num_rows is 6 in the "
                                                      "checkpoint, 8 in the model") as e:
        ckpt.check_compatible([TableConfig("users", 8, 4)])
    assert e.value.field == "users.num_rows"
    with pytest.raises(CheckpointMismatchError, match="dim is 4 in the checkpoint, 16"):
        ckpt.check_compatible([TableConfig("users", 6, 16)])
    with pytest.raises(CheckpointMismatchError, match=r"lacks \['items'\]"):
        ckpt.check_compatible(TABLES + [TableConfig("items", 3, 4)])
    with pytest.raises(CheckpointMismatchError, match=r"float64 \(9,\) in the checkpoint, the "
                                                      r"model expects float64 \(10,\)"):
        ckpt.check_compatible(arrays={"dense/params": ((10,), "float64")})
    with pytest.raises(CheckpointMismatchError, match="'top/params' of the model is not in"):
        ckpt.check_compatible(arrays={"top/params": ((10,), "float64")})


def test_malformed_manifest(tmp_path):
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Manifest.from_json("{", "x")
    with pytest.raises(CheckpointError, match="format"):
        Manifest.from_json('{"format": "other"}')
    with pytest.raises(CheckpointError, match="version 9"):
        Manifest.from_json('{"format": "neocomm-checkpoint", "version": 9}')
    with pytest.raises(CheckpointError, match="malformed"):
        Manifest.from_json('{"format": "neocomm-checkpoint", "version": 1, "step": 1}')


def test_writer_validates_its_input(tmp_path):
    w = CheckpointWriter(tmp_path, 1)
    with pytest.raises(ValueError, match="name"):
        w.write({"../evil": np.zeros(2)})
    with pytest.raises(TypeError, match="numeric"):
        w.write({"objs": np.array([object()])})
    with pytest.raises(ValueError, match="does not fit"):
        w.write({"a": np.zeros((3, 4))}, {"a": TensorSlice("t", "weight", (5, 0), (6, 4))})
    with pytest.raises(ValueError, match="not in arrays"):
        w.write({}, {"a": TensorSlice("t", "weight", (0,), (6,))})
    with pytest.raises(ValueError, match="checksum"):
        CheckpointWriter(tmp_path, 1, checksum="md5")
    with pytest.raises(TypeError, match="JSON"):
        w.write({"a": np.zeros(1)})
        w.commit(state={"rng": object()})


def test_resave_same_step_and_prune(tmp_path):
    for step in (1, 2, 3, 3):
        save(tmp_path, step)
    assert [i.step for i in list_checkpoints(tmp_path)] == [1, 2, 3]
    CheckpointWriter(tmp_path, 2, 0, 1).write(*arrays())  # a stale temp dir of an old step
    removed = prune(tmp_path, keep_last=1)
    assert [i.step for i in list_checkpoints(tmp_path)] == [3]
    assert len(removed) == 3 and not (tmp_path / ".tmp-step-000000000002").exists()


def test_cli_inspect(tmp_path, capsys):
    path = save(tmp_path, 4)
    assert cli(["checkpoint", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step 4, world size 1" in out and "users" in out and "6 x 4 float32" in out
    assert out.count(" OK ") == 3 and "all files verified" in out
    assert cli(["checkpoint", "inspect", str(tmp_path)]) == 0  # a root: the newest complete
    capsys.readouterr()
    corrupt(path, "emb/users/weight")
    assert cli(["checkpoint", "inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert "BAD-CHECKSUM" in captured.out and "1 file(s) failed" in captured.err
    assert cli(["checkpoint", "inspect", "--json", str(path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["step"] == 4
    assert cli(["checkpoint", "inspect", "--no-verify", str(path)]) == 0  # sizes still match
    capsys.readouterr()
    assert cli(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 2


@pytest.mark.parametrize("what", ["shard", "directory", "manifest"])
def test_symlinks_in_a_checkpoint_are_refused_naming_the_file(tmp_path, capsys, what):
    """A shard, a directory on its way, or the manifest that is a symbolic link (here to a
    copy of itself outside the checkpoint, so checksums would pass) is refused by
    loading, by resuming and by ``checkpoint inspect``, naming the file."""
    import shutil

    path = save(tmp_path / "run", 3)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    rec = Checkpoint(path).manifest.files[0]
    if what == "shard":
        name = rec.path
    elif what == "directory":
        name = str(__import__("pathlib").Path(rec.path).parent)
        assert name != "."
    else:
        name = MANIFEST
    target = outside / "copy"
    src = path / name
    (shutil.copytree if src.is_dir() else shutil.copy)(src, target)
    shutil.rmtree(src) if src.is_dir() else src.unlink()
    src.symlink_to(target)
    with pytest.raises(CheckpointError, match=f"{name}.*symbolic link"):
        load_checkpoint(path)  # what train --resume opens
    with pytest.raises(CheckpointError, match="symbolic link"):
        load_checkpoint(tmp_path / "run")  # the newest under a root, as --resume finds it
    assert cli(["checkpoint", "inspect", str(path)]) != 0
    assert "symbolic link" in capsys.readouterr().err
