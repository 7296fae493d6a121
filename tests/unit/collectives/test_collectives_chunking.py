"""Chunk sizes, staging pool bounds, segment streams."""
from __future__ import annotations

import numpy as np
import pytest

from collectives import settings
from collectives.chunking import ChunkPolicy, StagingPool, align_chunk, check_chunk_bytes
from collectives.pipeline import Segments
from collectives.types import FabricModel, LinkCost


@pytest.fixture
def env(monkeypatch):
    """Set NEOCOMM_* variables and re-read the settings; restored afterwards."""
    def set_(**kw):
        for k, v in kw.items():
            monkeypatch.setenv(f"NEOCOMM_{k}", str(v))
        settings.reload()

    yield set_
    monkeypatch.undo()
    settings.reload()


@pytest.mark.parametrize("bad", [0, -4096])
def test_chunk_bytes_must_be_positive(bad):
    with pytest.raises(ValueError, match="chunk_bytes: expected a positive"):
        check_chunk_bytes(bad, 4)


def test_chunk_bytes_must_be_a_multiple_of_the_element_size():
    with pytest.raises(ValueError, match="multiple of the element size \\(8 bytes\\)"):
        check_chunk_bytes(4100, 8)


def test_chunk_bytes_must_be_an_integer():
    with pytest.raises(TypeError, match="chunk_bytes"):
        check_chunk_bytes(4096.0, 4)
    with pytest.raises(TypeError, match="chunk_bytes"):
        check_chunk_bytes(True, 1)


def test_alignment_to_mtu_and_element():
    assert align_chunk(1 << 20, 4) == (1 << 20) // 4
    assert align_chunk(4096 + 4, 4) == 1024  # rounded down to one MTU
    assert align_chunk(12, 4) == 3           # below one MTU: element-aligned only
    assert align_chunk(10000, 2) == 4096     # 8192 bytes


def test_policy_per_link_class_from_fabric():
    fab = FabricModel(ranks_per_node=2, nodes=2, intra=LinkCost(1e-6, 1e10, 512 << 10),
                      inter=LinkCost(3e-6, 1e10, 128 << 10), nics_per_node=4)
    pol = ChunkPolicy.resolve(fab, 4)
    assert pol.intra == (512 << 10) // 4 and pol.inter == (128 << 10) // 4
    assert pol.lanes == 4
    assert ChunkPolicy.resolve(fab, 4, 8192).intra == 2048


def test_policy_from_settings(env):
    fab = FabricModel()
    env(CHUNK_BYTES="64K", CHUNK_BYTES_INTER="8K")
    pol = ChunkPolicy.resolve(fab, 8)
    assert pol.intra == (64 << 10) // 8 and pol.inter == 1024
    env(CHUNK_BYTES="0")
    with pytest.raises(ValueError, match="NEOCOMM_CHUNK_BYTES"):
        ChunkPolicy.resolve(fab, 4)
    env(CHUNK_BYTES="6")
    with pytest.raises(ValueError, match="multiple of the element size"):
        ChunkPolicy.resolve(fab, 4)
    env(CHUNK_BYTES="-8")
    with pytest.raises(ValueError, match="positive"):
        ChunkPolicy.resolve(fab, 4)


def test_chunking_off_is_one_chunk(env):
    env(CHUNKING="0")
    pol = ChunkPolicy.resolve(FabricModel(), 4)
    assert pol.intra >= 1 << 40


def test_depth_is_capped_by_the_pool(env):
    env(PIPELINE_DEPTH="64", STAGING_BUFFERS="8")
    assert ChunkPolicy.resolve(FabricModel(), 4).depth == 3


def test_staging_pool_is_bounded_and_reused():
    pool = StagingPool(np, limit=4)
    views = [pool.take(1000, np.float32) for _ in range(4)]
    extra = pool.take(10, np.float32)  # beyond the limit: lent, not kept
    assert pool.overflows == 1
    for v in views + [extra]:
        pool.give(v)
    assert len(pool._free) == 4
    held = pool.held_bytes
    for _ in range(100):  # reuse: no growth
        v = pool.take(1000, np.float64 if _ % 2 else np.float32)
        pool.give(v)
    assert pool.held_bytes <= held * 2
    big = pool.take(50_000, np.uint8)  # a larger chunk replaces a buffer, count stays bounded
    assert big.size == 50_000 and pool.in_use() == 1
    assert len(pool._free) + len(pool._busy) <= 4
    with pytest.raises(ValueError):
        pool.give(np.empty(3))


def test_segments_gather_scatter_roundtrip():
    buf = np.arange(20)
    segs = Segments(buf, [15, 2, 8], [3, 4, 0])
    assert segs.total == 7 and segs.contiguous() is None
    out = np.empty(7, buf.dtype)
    for lo in range(0, 7, 2):
        segs.gather(lo, min(7, lo + 2), out[lo:])
    assert out.tolist() == [15, 16, 17, 2, 3, 4, 5]
    dst = np.zeros(20, buf.dtype)
    segs2 = Segments(dst, [15, 2, 8], [3, 4, 0])
    for lo in range(0, 7, 3):
        segs2.scatter(lo, min(7, lo + 3), out[lo:])
    assert dst[15:18].tolist() == [15, 16, 17] and dst[2:6].tolist() == [2, 3, 4, 5]
    adjacent = Segments(buf, [4, 6], [2, 3])
    assert adjacent.contiguous().tolist() == [4, 5, 6, 7, 8]
