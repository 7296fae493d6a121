"""The binary record format: round trips, checksums, truncation and corruption."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from embedding.data import (BinaryDataset, BinaryWriter, DataFormatError, MissingCategorical,
                            Preprocessor, SyntheticConfig, SyntheticDataset, Verify, convert_text,
                            read_criteo_text, write_batches)
from embedding.data.binary import MAGIC

SIZES = (1000,) * 26


def synthetic(n=1000, sizes=SIZES):
    return SyntheticDataset(SyntheticConfig(table_sizes=sizes, seed=3), n)


def write_synthetic(path, n=1000, chunk_records=256, sizes=SIZES):
    ds = synthetic(n, sizes)
    batches = [ds.read(a, min(a + 300, n)) for a in range(0, n, 300)]
    write_batches(path, batches, sizes, chunk_records=chunk_records)
    return ds


def assert_batches_equal(a, b):
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.labels, b.labels)
    for f in range(a.num_sparse):
        np.testing.assert_array_equal(a.values[f], b.values[f])
        np.testing.assert_array_equal(a.lengths[f], b.lengths[f])


def test_round_trip_and_random_access(tmp_path):
    path = tmp_path / "d.bin"
    ds = write_synthetic(path)
    data = BinaryDataset(path)
    assert len(data) == 1000 and data.table_sizes == SIZES and data.num_dense == 13
    assert data.dtype.itemsize == 160  # 4 + 13*4 + 26*4: int32 ids
    for a, b in [(0, 1000), (5, 17), (250, 513), (999, 1000), (7, 7)]:
        assert_batches_equal(data.read(a, b), ds.read(a, b))
    assert (data.read(0, 1000).values[0].dtype == np.int64)


def test_header_layout_is_the_documented_one(tmp_path):
    path = tmp_path / "d.bin"
    write_synthetic(path, n=10, chunk_records=4)
    raw = path.read_bytes()
    magic, version, hbytes, n, nd, nf, idb, rb, chunk, flags, trailer, crc, _ = struct.unpack(
        "<8sIIQIIIIIIQII", raw[:64])
    assert (magic, version, n, nd, nf, idb, rb, chunk, flags) == (MAGIC, 1, 10, 13, 26, 4, 160,
                                                                  4, 0)
    assert hbytes % 64 == 0 and hbytes >= 64 + 8 * 26
    assert struct.unpack("<26Q", raw[64:64 + 208]) == SIZES
    assert trailer == hbytes + 10 * 160 and len(raw) == trailer + 4 * 3
    rec0 = raw[hbytes:hbytes + 160]
    label = rec0[0]
    ids = struct.unpack("<26i", rec0[56:160])
    b = BinaryDataset(path).read(0, 1)
    assert label == b.labels[0] and list(ids) == [int(v[0]) for v in b.values]


def test_large_tables_use_int64_ids(tmp_path):
    sizes = (3_000_000_000,) + (10,) * 25
    path = tmp_path / "big.bin"
    with BinaryWriter(path, sizes) as w:
        ids = np.zeros((2, 26), np.int64)
        ids[:, 0] = [2_999_999_999, 5]
        w.write(np.zeros((2, 13), np.float32), np.array([0, 1]), ids)
    data = BinaryDataset(path)
    assert data.dtype.itemsize == 264
    assert data.read(0, 2).values[0].tolist() == [2_999_999_999, 5]


def test_convert_text_matches_text_reader(tmp_path):
    rng = np.random.default_rng(4)
    lines = []
    for _ in range(123):
        f = [str(int(rng.integers(0, 2)))]
        f += ["" if rng.random() < .1 else str(int(rng.integers(-2, 900))) for _ in range(13)]
        f += ["" if rng.random() < .1 else f"{int(rng.integers(0, 2**32)):08x}" for _ in range(26)]
        lines.append("\t".join(f))
    text = tmp_path / "t.txt"
    text.write_text("\n".join(lines) + "\n")
    for missing in MissingCategorical:
        pre = Preprocessor(SIZES, missing=missing)
        out = tmp_path / f"t-{missing.value}.bin"
        assert convert_text(text, out, pre, chunk_lines=50, chunk_records=32) == 123
        data = BinaryDataset(out, verify=Verify.FULL)
        assert data.empty_bags == (missing is MissingCategorical.EMPTY)
        assert_batches_equal(data.read(0, 123), next(read_criteo_text(text, 123, pre)))


def test_corrupt_record_is_named_by_its_chunk(tmp_path):
    path = tmp_path / "d.bin"
    write_synthetic(path, chunk_records=100)
    data = BinaryDataset(path)
    raw = bytearray(path.read_bytes())
    pos = data.header_bytes + 345 * data.dtype.itemsize + 10  # inside record 345's dense part
    raw[pos] ^= 0xFF
    path.write_bytes(bytes(raw))
    data = BinaryDataset(path)  # lazy: opening does not read the records
    data.read(0, 300)           # chunks 0-2 are intact
    with pytest.raises(DataFormatError, match=r"records \[300, 400\) fail their crc32") as err:
        data.read(350, 360)
    assert err.value.record == 300 and str(path) in str(err.value)
    with pytest.raises(DataFormatError, match="crc32"):
        BinaryDataset(path, verify="full")
    BinaryDataset(path, verify=Verify.NONE).read(340, 350)  # unchecked reads are allowed


def test_corrupt_label_and_id_without_checksums_name_the_record(tmp_path):
    path = tmp_path / "d.bin"
    write_synthetic(path)
    data = BinaryDataset(path)
    raw = bytearray(path.read_bytes())
    raw[data.header_bytes + 42 * 160] = 7  # label of record 42
    struct.pack_into("<i", raw, data.header_bytes + 77 * 160 + 56 + 4 * 3, 5000)  # id, feature 3
    path.write_bytes(bytes(raw))
    data = BinaryDataset(path, verify=Verify.NONE)
    with pytest.raises(DataFormatError, match="label 7 is not 0 or 1") as err:
        data.read(40, 50)
    assert err.value.record == 42
    with pytest.raises(DataFormatError, match=r"id 5000 of feature 3 is outside \[0, 1000\)") \
            as err:
        data.read(70, 80)
    assert err.value.record == 77


def test_truncated_file_names_first_incomplete_record(tmp_path):
    path = tmp_path / "d.bin"
    write_synthetic(path)
    raw = path.read_bytes()
    hb = BinaryDataset(path).header_bytes
    path.write_bytes(raw[:hb + 600 * 160 + 33])
    with pytest.raises(DataFormatError, match="truncated.*record 600 is the first incomplete") \
            as err:
        BinaryDataset(path)
    assert err.value.record == 600
    path.write_bytes(raw[:-2])
    with pytest.raises(DataFormatError, match="checksum trailer is cut"):
        BinaryDataset(path)
    path.write_bytes(raw[:40])
    with pytest.raises(DataFormatError, match="truncated header"):
        BinaryDataset(path)
    path.write_bytes(raw + b"xx")
    with pytest.raises(DataFormatError, match="unexpected bytes"):
        BinaryDataset(path)


def test_bad_header(tmp_path):
    path = tmp_path / "d.bin"
    write_synthetic(path, n=20)
    raw = bytearray(path.read_bytes())
    bad = bytearray(raw)
    bad[:8] = b"NOTMAGIC"
    path.write_bytes(bytes(bad))
    with pytest.raises(DataFormatError, match="not a neocomm binary data file"):
        BinaryDataset(path)
    bad = bytearray(raw)
    bad[64] ^= 1  # a table size
    path.write_bytes(bytes(bad))
    with pytest.raises(DataFormatError, match="header checksum"):
        BinaryDataset(path)
    bad = bytearray(raw)
    bad[8] = 9
    path.write_bytes(bytes(bad))
    with pytest.raises(DataFormatError, match="version 9"):
        BinaryDataset(path)


def test_writer_refuses_bad_records_and_leaves_no_file(tmp_path):
    path = tmp_path / "w.bin"
    dense = np.zeros((4, 13), np.float32)
    ids = np.zeros((4, 26), np.int64)
    with pytest.raises(DataFormatError, match="label 2 is not 0 or 1") as err:
        with BinaryWriter(path, SIZES) as w:
            w.write(dense, np.array([0, 1, 1, 0]), ids)
            w.write(dense, np.array([0, 1, 2, 0]), ids)
    assert err.value.record == 6
    assert not path.exists() and not (tmp_path / "w.bin.tmp").exists()
    bad = dense.copy()
    bad[1, 3] = np.nan
    with pytest.raises(DataFormatError, match="NaN") as err:
        with BinaryWriter(path, SIZES) as w:
            w.write(bad, np.zeros(4), ids)
    assert err.value.record == 1
    with pytest.raises(DataFormatError, match="outside"):
        with BinaryWriter(path, SIZES) as w:
            w.write(dense, np.zeros(4), ids - 1)  # -1 needs empty_bags
    with pytest.raises(ValueError, match="id_bytes"):
        BinaryWriter(path, (2**33,), id_bytes=4)
    assert not path.exists()


def test_read_bounds(tmp_path):
    path = tmp_path / "d.bin"
    write_synthetic(path, n=10)
    with pytest.raises(ValueError, match="start/stop"):
        BinaryDataset(path).read(5, 11)


def test_command_line_convert(tmp_path, capsys):
    from neocomm.cli import main as neocomm_main

    def main(argv):  # the data tools, as `neocomm data ...` runs them
        return neocomm_main(["data", *argv])

    good = "\t".join(["1"] + ["3"] * 13 + ["0000abcd"] * 26)
    (tmp_path / "a.txt").write_text(good + "\n" + good + "\n")
    assert main(["convert", str(tmp_path / "a.txt"), "-o", str(tmp_path / "a.bin"),
                 "--preset", "tiny"]) == 0
    assert "wrote 2 records" in capsys.readouterr().out
    assert BinaryDataset(tmp_path / "a.bin").read(0, 2).values[0].tolist() == [0xabcd % 399] * 2
    (tmp_path / "b.txt").write_text(good + "\n" + good.replace("\t3\t", "\tx\t", 1) + "\n")
    assert main(["convert", str(tmp_path / "b.txt"), "-o", str(tmp_path / "b.bin")]) == 1
    assert "b.txt, line 2" in capsys.readouterr().err
    assert not (tmp_path / "b.bin").exists()
