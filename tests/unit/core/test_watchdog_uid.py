"""The stall watchdog and NCCL unique-id forms."""
from __future__ import annotations

import threading
import time

import pytest

from neocomm.backends.nccl import normalize_unique_id
from neocomm.watchdog import Watchdog


def test_watchdog_fires_on_a_stalled_guard_and_names_it(capsys):
    fired = threading.Event()
    messages = []
    wd = Watchdog(0.2, rank=3, abort=lambda msg: (messages.append(msg), fired.set()))
    wd.start()
    with wd.guard("all_reduce on group world"):
        assert fired.wait(5)
    wd.stop()
    assert "rank 3: all_reduce on group world has not completed" in messages[0]


def test_watchdog_stays_quiet_for_short_waits():
    fired = []
    wd = Watchdog(1.0, rank=0, abort=fired.append)
    wd.start()
    for _ in range(5):
        with wd.guard("quick"):
            time.sleep(0.01)
    time.sleep(1.3)
    wd.stop()
    assert fired == []


def test_unique_id_round_trips_between_cupy_forms():
    raw = bytes(range(128))
    as_tuple = normalize_unique_id(raw, want_bytes=False)
    assert isinstance(as_tuple, tuple) and min(as_tuple) >= -128 and max(as_tuple) <= 127
    assert normalize_unique_id(as_tuple, want_bytes=True) == raw
    signed = tuple(-1 for _ in range(128))
    assert normalize_unique_id(signed, want_bytes=True) == b"\xff" * 128
    with pytest.raises(ValueError, match="128 bytes"):
        normalize_unique_id(b"short", want_bytes=True)
