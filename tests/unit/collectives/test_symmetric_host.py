"""Symmetric memory on this host, without MPI."""
from __future__ import annotations


def test_symmetric_memory_availability(tmp_path, monkeypatch):
    from collectives import symmetric

    monkeypatch.setattr(symmetric, "_SHM_DIR", str(tmp_path))
    ok, where = symmetric.availability()
    assert ok and where.startswith(str(tmp_path)) and "GiB free" in where
    missing = str(tmp_path / "nowhere")
    monkeypatch.setattr(symmetric, "_SHM_DIR", missing)
    ok, why = symmetric.availability()
    assert not ok and missing in why
