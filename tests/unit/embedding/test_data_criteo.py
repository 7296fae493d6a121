"""Criteo text parsing, preprocessing, vocabularies, and the errors for malformed lines."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from embedding.data import (CategoricalEncoding, DataFormatError, MissingCategorical,
                            Preprocessor, Vocabulary, read_criteo_text)
from embedding.data.criteo import iter_raw_chunks, parse_lines, preprocess_dense

SIZES = (97,) * 26


def make_line(rng, label=None, missing=0.1) -> str:
    label = int(rng.integers(0, 2)) if label is None else label
    ints = ["" if rng.random() < missing else str(int(rng.integers(-3, 5000)))
            for _ in range(13)]
    cats = ["" if rng.random() < missing else f"{int(rng.integers(0, 2**32)):08x}"
            for _ in range(26)]
    return "\t".join([str(label)] + ints + cats)


def write_text(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def reference(line: str, sizes=SIZES):
    f = line.split("\t")
    dense = [np.log1p(max(int(x), 0)) if x else 0.0 for x in f[1:14]]
    ids = [int(x, 16) % s if x else 0 for x, s in zip(f[14:], sizes)]
    return int(f[0]), np.float32(dense), ids


def test_parse_and_hash_match_a_per_line_reference(tmp_path):
    rng = np.random.default_rng(0)
    lines = [make_line(rng) for _ in range(300)]
    lines[0] = "\t".join(["1", "-5", "0", "3"] + [""] * 10 + ["0000000A"] + ["ffffffff"] * 25)
    path = write_text(tmp_path / "day_0", lines)
    pre = Preprocessor(SIZES)
    batches = list(read_criteo_text(path, 128, pre))
    assert [b.batch_size for b in batches] == [128, 128, 44]
    for i, line in enumerate(lines):
        b = batches[i // 128]
        j = i % 128
        label, dense, ids = reference(line)
        assert b.labels[j] == label
        np.testing.assert_allclose(b.dense[j], dense, rtol=1e-6)
        assert [int(b.values[f][j]) for f in range(26)] == ids
    assert batches[0].dense[0, 0] == 0.0  # negative clamped to 0 before log1p
    assert batches[0].values[0][0] == 10 % 97  # hex is case-insensitive


def test_drop_last_and_chunks_across_files(tmp_path):
    rng = np.random.default_rng(1)
    a = write_text(tmp_path / "a", [make_line(rng) for _ in range(50)])
    b = write_text(tmp_path / "b", [make_line(rng) for _ in range(30)])
    got = list(read_criteo_text([a, b], 32, Preprocessor(SIZES), drop_last=True))
    assert [x.batch_size for x in got] == [32, 32]


def test_gzip_input(tmp_path):
    rng = np.random.default_rng(2)
    lines = [make_line(rng) for _ in range(20)]
    plain = write_text(tmp_path / "p", lines)
    gz = tmp_path / "p.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    x = next(read_criteo_text(plain, 20, Preprocessor(SIZES)))
    y = next(read_criteo_text(gz, 20, Preprocessor(SIZES)))
    np.testing.assert_array_equal(x.dense, y.dense)


def test_missing_categorical_as_empty_bag():
    line = "\t".join(["0"] + ["1"] * 13 + [""] + ["0000000f"] * 25).encode()
    raw = parse_lines([line, line])
    b = Preprocessor(SIZES, missing=MissingCategorical.EMPTY)
    dense, labels, ids = b(raw)
    assert (ids[:, 0] == -1).all() and (ids[:, 1] == 15).all()
    from embedding.data import Batch

    batch = Batch.from_ids(dense, labels, ids)
    assert batch.lengths[0].tolist() == [0, 0] and batch.values[0].size == 0
    assert batch.lengths[1].tolist() == [1, 1]


def test_preprocess_dense_clamps_and_masks():
    out = preprocess_dense(np.array([[-3, 0, 1, 100]]), np.array([[False, False, False, True]]))
    np.testing.assert_allclose(out, [[0, 0, np.log(2), 0]], rtol=1e-6)
    assert out.dtype == np.float32


def test_vocabulary_ranks_by_frequency_and_round_trips(tmp_path):
    cats = ["0000000a"] * 5 + ["0000000b"] * 3 + ["0000000c"] * 3 + ["0000000d"]
    lines = ["\t".join(["0"] + ["1"] * 13 + [c] * 26).encode() for c in cats]
    raw = parse_lines(lines)
    sizes = (3,) * 26  # rows 1, 2 for the two most frequent; ties broken by the smaller value
    vocab = Vocabulary.build([raw], sizes)
    assert vocab.encode(np.array([0xA, 0xB, 0xC, 0xD, 0x99], np.uint32), 0).tolist() == \
        [1, 2, 0, 0, 0]
    vocab.save(tmp_path / "v.npz")
    back = Vocabulary.load(tmp_path / "v.npz")
    assert back.table_sizes == sizes
    pre = Preprocessor(sizes, CategoricalEncoding.VOCABULARY, back)
    _, _, ids = pre(raw)
    assert ids[:, 3].tolist() == [1] * 5 + [2] * 3 + [0] * 4
    with pytest.raises(ValueError, match="vocabulary"):
        Preprocessor(sizes, CategoricalEncoding.VOCABULARY)
    with pytest.raises(ValueError, match="table sizes"):
        Preprocessor((4,) * 26, CategoricalEncoding.VOCABULARY, back)


def test_vocabulary_min_count_drops_rare_values():
    lines = ["\t".join(["0"] + ["1"] * 13 + [c] * 26).encode()
             for c in ["0000000a"] * 2 + ["0000000b"]]
    vocab = Vocabulary.build([parse_lines(lines)], (10,) * 26, min_count=2)
    assert vocab.encode(np.array([0xA, 0xB], np.uint32), 5).tolist() == [1, 0]


GOOD = "\t".join(["1"] + ["2"] * 13 + ["0123abcd"] * 26)


@pytest.mark.parametrize("bad, match", [
    ("\t".join(["1"] + ["2"] * 13 + ["0123abcd"] * 25), "expected 40 tab-separated fields"),
    ("\t".join(["2"] + ["2"] * 13 + ["0123abcd"] * 26), "label b'2' is not 0 or 1"),
    ("\t".join(["x"] + ["2"] * 13 + ["0123abcd"] * 26), "label"),
    ("\t".join(["1"] + ["2"] * 12 + ["1.5"] + ["0123abcd"] * 26), "I13 b'1.5' is not an integer"),
    ("\t".join(["1"] + ["nan"] + ["2"] * 12 + ["0123abcd"] * 26), "I1 b'nan'"),
    ("\t".join(["1"] + ["2"] * 13 + ["0123abcg"] + ["0123abcd"] * 25), "C1 b'0123abcg'"),
    ("\t".join(["1"] + ["2"] * 13 + ["0123abcd"] * 25 + ["123"]), "C26 b'123' is not 8 hex"),
    ("\t".join(["1"] + ["2"] * 13 + ["0123abcd"] * 2 + ["0123abcd0"] + ["0123abcd"] * 23),
     "C3"),
    ("\t".join(["1"] + ["99999999999999999999999"] + ["2"] * 12 + ["0123abcd"] * 26), "I1"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad, match):
    path = write_text(tmp_path / "bad.txt", [GOOD] * 4 + [bad] + [GOOD])
    with pytest.raises(DataFormatError, match=match) as err:
        list(read_criteo_text(path, 2, Preprocessor(SIZES)))
    assert err.value.line == 5
    assert err.value.path == str(path)
    assert "bad.txt, line 5" in str(err.value)


def test_truncated_last_line(tmp_path):
    path = tmp_path / "cut.txt"
    path.write_text(GOOD + "\n" + GOOD + "\n" + GOOD[:37])
    with pytest.raises(DataFormatError, match="truncated last line") as err:
        list(iter_raw_chunks(path))
    assert err.value.line == 3


def test_truncated_gzip_names_the_line(tmp_path):
    rng = np.random.default_rng(3)
    data = gzip.compress("".join(make_line(rng) + "\n" for _ in range(2000)).encode())
    path = tmp_path / "cut.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFormatError) as err:
        list(iter_raw_chunks(path, 100))
    assert err.value.line >= 1 and "cut.gz" in str(err.value)


def test_bad_arguments():
    with pytest.raises(ValueError, match="table_sizes"):
        Preprocessor((10,) * 25)
    with pytest.raises(ValueError, match="batch_size"):
        next(read_criteo_text("x", 0, Preprocessor(SIZES)))
