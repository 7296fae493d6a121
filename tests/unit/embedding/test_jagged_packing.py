"""The input dist's jagged packing: what one rank packs for each destination, and what a
destination unpacks from the blocks every source sent it."""
from __future__ import annotations

import numpy as np
import pytest

from embedding.sharding.base import pack_jagged, unpack_jagged


def _slots(rng, n_slots, batch, empty=False):
    out = []
    for _ in range(n_slots):
        ln = np.zeros(batch, np.int64) if empty else rng.integers(0, 5, batch)
        out.append((ln, rng.integers(0, 1 << 40, int(ln.sum()))))
    return out


@pytest.mark.parametrize("sources", [1, 2, 3])
@pytest.mark.parametrize("shape", ["varied", "no ids", "no slots"])
def test_a_destination_unpacks_what_every_source_packed_for_it(sources, shape):
    rng = np.random.default_rng(sources)
    batch = 7
    n_slots = 0 if shape == "no slots" else 3
    # what each source sends this destination (its block of pack_jagged's buffer for it)
    sent = [_slots(rng, n_slots, batch, empty=shape == "no ids") for _ in range(sources)]
    blocks, counts = [], []
    for slots in sent:
        buf, cnt = pack_jagged([slots, _slots(rng, 2, batch)])   # and another destination's
        blocks.append(buf[:cnt[0]])
        counts.append(int(cnt[0]))
    assert sum(counts) == sum(len(ln) + len(v) for slots in sent for ln, v in slots)
    recv = np.concatenate(blocks) if blocks else np.zeros(0, np.int64)
    lengths, values = unpack_jagged(recv, counts, [n_slots * batch] * sources)
    want_lengths = [ln for slots in sent for ln, _ in slots]
    want_values = [v for slots in sent for _, v in slots]
    assert lengths.dtype == values.dtype == np.int64
    assert np.array_equal(lengths, np.concatenate(want_lengths) if want_lengths
                          else np.zeros(0, np.int64))
    assert np.array_equal(values, np.concatenate(want_values) if want_values
                          else np.zeros(0, np.int64))
    recv[:] = -1   # what was unpacked is its own, not a view of the receive buffer
    assert not (lengths == -1).any() and not (values == -1).any()
