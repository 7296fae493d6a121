"""KeyedJagged: structure, access, and every bad-input error."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.jagged import KeyedJagged, apply_id_policy, hash_ids
from embedding.types import IdPolicy


def _kjt():
    return KeyedJagged(("user", "item"), [3, 4, 5, 6, 7, 8], [2, 0, 1, 3])


def test_structure_and_access():
    kjt = _kjt()
    assert kjt.batch_size == 2
    assert kjt.offsets.tolist() == [0, 2, 2, 3, 6]
    assert kjt.feature("user").bags() == [[3, 4], []]
    assert kjt.feature("item").bags() == [[5], [6, 7, 8]]
    assert kjt.value_range("item") == (2, 6)
    sub = kjt.select(["item"])
    assert sub.keys == ("item",) and sub.values.tolist() == [5, 6, 7, 8]
    assert "user" in kjt and len(kjt) == 2


def test_from_lists_and_from_dict_agree():
    a = KeyedJagged.from_lists({"f": [[1, 2], [3]], "g": [[], [4]]},
                               weights={"f": [[0.5, 1.0], [2.0]], "g": [[], [3.0]]})
    b = KeyedJagged.from_dict({"f": ([1, 2, 3], [2, 1], [0.5, 1.0, 2.0]),
                               "g": ([4], [0, 1], [3.0])})
    assert a.keys == b.keys
    np.testing.assert_array_equal(a.values, b.values)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.weights, b.weights)


@pytest.mark.parametrize("args, match", [
    ((("f",), [1, 2, 3], [1, 1]), "sum to 2 ids but values holds 3"),
    ((("f",), [1, 2], [3, -1]), "lengths of feature 'f': expected >= 0, got -1 for sample 1"),
    ((("f", "g"), [1, 2, 3], [1, 1, 1]), "multiple of 2"),
    ((("f", "f"), [1, 2], [1, 1]), "duplicates"),
    ((("f",), [[1, 2]], [2]), "1-D"),
    ((("f",), [1.5], [1]), "integer ids"),
])
def test_structure_errors(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KeyedJagged(*args)


def test_weights_errors():
    with pytest.raises(ValueError, match="one weight per id"):
        KeyedJagged(("f",), [1, 2], [2], weights=[1.0])
    with pytest.raises(TypeError, match="floating"):
        KeyedJagged(("f",), [1, 2], [2], weights=[1, 2])
    with pytest.raises(ValueError, match="given for some features"):
        KeyedJagged.from_dict({"f": ([1], [1], [1.0]), "g": ([2], [1])})


def test_check_features_names_missing_and_unknown():
    with pytest.raises(ValueError, match=r"missing features \['other'\].*unknown features "
                                         r"\['item'\]"):
        _kjt().check_features(["user", "other"])


@pytest.mark.parametrize("values, bad, sample", [([3, 4, 5, 6, 10, 8], 10, 1),
                                                 ([3, 4, -2, 6, 7, 8], -2, 0)])
def test_check_ids_names_feature_value_and_sample(values, bad, sample):
    kjt = KeyedJagged(("user", "item"), values, [2, 0, 1, 3])
    with pytest.raises(ValueError, match=rf"feature 'item': id {bad} \(sample {sample}\) is "
                                         rf"outside \[0, 10\)"):
        kjt.check_ids({"user": 10, "item": 10})


def test_check_ids_rejects_unknown_feature():
    with pytest.raises(ValueError, match="unknown features"):
        _kjt().check_ids({"user": 10})


def test_policies_map_into_range_and_leave_others():
    kjt = KeyedJagged(("user", "item"), [3, 4, 5, -6, 7 * 10**12, 8], [2, 0, 1, 3])
    out = kjt.check_ids({"user": 10, "item": 10},
                        {"item": IdPolicy.MODULO})
    assert out.values[:2].tolist() == [3, 4]
    assert out.values[2:].tolist() == [5, 4, 0, 8]  # floored modulo
    hashed = kjt.check_ids({"user": 10, "item": 7}, {"item": IdPolicy.HASH})
    assert np.all((hashed.values[2:] >= 0) & (hashed.values[2:] < 7))
    assert hashed.values[:2].tolist() == [3, 4]
    # in range and unchanged: the same object comes back
    ok = _kjt()
    assert ok.check_ids({"user": 10, "item": 10}) is ok


def test_hash_is_a_fixed_function():
    ids = np.array([0, 1, 2, -1, 2**62], np.int64)
    h = hash_ids(ids)
    assert h.dtype == np.uint64
    np.testing.assert_array_equal(h, hash_ids(ids.copy()))
    assert len(set(h.tolist())) == ids.size
    # splitmix64 finaliser of 1 (a published constant of the mixer)
    assert int(hash_ids(np.array([1]))[0]) == 0x5692161D100B05E5
    mapped = apply_id_policy(ids, 1000, IdPolicy.HASH)
    assert mapped.min() >= 0 and mapped.max() < 1000
