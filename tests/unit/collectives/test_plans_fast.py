"""Plans of repeated calls and the watchdog's open waits, in one process (no MPI)."""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

from collectives import plans, progress, settings
from collectives.types import CollectiveOp
from neocomm import watchdog


class _Group:
    rank, size = 0, 1


class _Backend:
    check_args = False


class _Call:
    """Just what a plan reads of a Call."""

    def __init__(self, op, sendbuf, recvbuf):
        self.op, self.group, self.backend = op, _Group(), _Backend()
        self.sendbuf, self.recvbuf, self.tag = sendbuf, recvbuf, 0


class _Algo:
    name = "fake"

    def __init__(self):
        self.seen = []

    def run(self, call):
        self.seen.append((call.sendbuf, call.recvbuf))
        call.recvbuf[:] = call.sendbuf
        return
        yield  # a generator, as algorithms are


@pytest.fixture(autouse=True)
def _fresh():
    plans.clear()
    settings.current()
    yield
    plans.clear()


def _plan(key, x, y, fast=None, op=CollectiveOp.ALL_TO_ALL, algo=None):
    call = _Call(op, x.reshape(-1), y.reshape(-1))
    algo = algo or _Algo()
    if fast is not None:
        algo.fast = lambda call: fast
    plans.remember(key, (x, y), call, algo, y)
    return call, algo


def test_a_plan_replays_the_same_buffers_and_misses_others():
    ran = []
    x, y = np.arange(4.0), np.zeros(4)
    _plan("k", x, y, fast=lambda s, r: ran.append((s, r)))
    assert plans.replay("k", x, y) is y
    assert ran == [(x, y)] and plans.LAST_CHOSEN["all_to_all"] == "fake"
    assert plans.replay("k", x.copy(), y) is None  # another array with the same id-key
    assert plans.replay("k", y, x) is None
    assert plans.replay("other", x, y) is None
    assert len(ran) == 1


class _Resizable:
    """A buffer whose size can change in place (NumPy refuses that once weakly referenced)."""

    def __init__(self, size):
        self.size = size
        self.dtype = np.dtype(np.float32)

    def reshape(self, shape):
        return self


def test_a_resized_buffer_misses():
    x, y = _Resizable(4), _Resizable(4)
    _plan("k", x, y, fast=lambda s, r: None)
    assert plans.replay("k", x, y) is y
    y.size = 8
    assert plans.replay("k", x, y) is None


def test_a_buffer_whose_dtype_changed_misses():
    x, y = _Resizable(4), _Resizable(4)
    _plan("k", x, y, fast=lambda s, r: None)
    assert plans.replay("k", x, y) is y
    y.dtype = np.dtype(np.int32)  # the same bytes read as another type: a fresh call
    assert plans.replay("k", x, y) is None


def test_plans_do_not_keep_buffers_alive():
    x, y = np.arange(4.0), np.zeros(4)
    _plan("k", x, y, fast=lambda s, r: None)
    _plan("g", x, y)  # the generic path holds a Call too
    wx, wy = weakref.ref(x), weakref.ref(y)
    del x, y
    gc.collect()
    assert wx() is None and wy() is None


def test_settings_reload_check_flag_and_outstanding_ops_skip_the_plan():
    x, y = np.arange(4.0), np.zeros(4)
    call, _ = _plan("k", x, y, fast=lambda s, r: None)
    assert plans.replay("k", x, y) is y
    call.backend.check_args = True
    assert plans.replay("k", x, y) is None
    call.backend.check_args = False
    progress._ACTIVE.append(object())
    try:
        assert plans.replay("k", x, y) is None
    finally:
        progress._ACTIVE.pop()
    assert plans.replay("k", x, y) is y
    settings.reload()
    assert plans.replay("k", x, y) is None


def test_the_fast_call_is_an_open_wait_named_after_the_op_even_when_it_raises():
    seen = []

    def fast(s, r):
        seen.extend(what for what, _ in watchdog._open_slots())
        raise RuntimeError("boom")

    x, y = np.arange(4.0), np.zeros(4)
    _plan("k", x, y, fast=fast)
    with pytest.raises(RuntimeError, match="boom"):
        plans.replay("k", x, y)
    assert seen == ["all_to_all (fake)"]
    assert not watchdog._open_slots()


def test_the_generic_path_lends_the_buffers_only_while_it_runs():
    x, y = np.arange(4.0), np.zeros(4)
    call, algo = _plan("k", x, y)
    plan = plans._PLANS["k"]
    assert plan.call.sendbuf is None and plan.call.recvbuf is None
    assert plans.replay("k", x, y) is y and np.array_equal(y, x)
    assert np.shares_memory(algo.seen[-1][0], x) and plan.call.sendbuf is None
    assert call.sendbuf is not None  # the first call's own Call keeps its buffers


def test_a_result_made_of_a_buffer_and_counts():
    x, y = np.arange(4.0), np.zeros(4)
    counts = np.array([4])
    call = _Call(CollectiveOp.ALL_TO_ALL_V, x, y)
    plans.remember("v", (x, y), call, _Algo(), (y, counts))
    out = plans.replay("v", x, y)
    assert out[0] is y and out[1] is counts
    plans.remember("bad", (x, y), call, _Algo(), np.zeros(1))  # not made of the buffers
    assert "bad" not in plans._PLANS


def test_capture_hands_the_call_over_without_running_or_planning():
    x, y = np.arange(4.0), np.zeros(4)
    algo = _Algo()

    def api_call(s, r, *, group=None):
        plans.remember("c", (s, r), _Call(CollectiveOp.ALL_TO_ALL, s, r), algo, r)
        raise AssertionError("the call went on")

    bufs, call, got, result = plans.capture(api_call, x, y)
    assert bufs == (x, y) and got is algo and result is y and not algo.seen
    assert "c" not in plans._PLANS
    with pytest.raises(RuntimeError, match="ran instead of being prepared"):
        plans.capture(lambda: None)


def test_a_guard_opens_and_closes_one_wait_and_reconfiguring_keeps_open_waits():
    before = watchdog._ACTIVE
    try:
        watchdog.configure(60, rank=0)
        with watchdog.guard("first"):
            assert [s.what for s in watchdog.OPEN] == ["first"]
            wd = watchdog.configure(60, rank=0)
            assert wd._open is watchdog.OPEN and len(watchdog.OPEN) == 1
        assert not watchdog.OPEN
    finally:
        if watchdog._ACTIVE is not None:
            watchdog._ACTIVE.stop()
        watchdog._ACTIVE = before


def test_the_watchdog_names_a_stalled_slot_and_forgets_dead_ones():
    fired = threading.Event()
    messages = []
    wd = watchdog.Watchdog(0.2, rank=1, abort=lambda m: (messages.append(m), fired.set()),
                           open_waits=watchdog.OPEN)
    slot = watchdog.Slot("all_to_all (native)")
    gone = watchdog.Slot("gone")
    key = id(gone)
    del gone
    assert key not in watchdog._SLOTS
    wd.start()
    slot.since = time.monotonic()
    try:
        assert fired.wait(5)
    finally:
        wd.stop()
        slot.since = 0.0
    assert "rank 1: all_to_all (native) has not completed" in messages[0]


_STALL_JOB = """
import time
import numpy as np
import neocomm, collectives as C
w = neocomm.init()
x = np.ones(4 * w.size, np.float32); y = np.empty_like(x)
{setup}
run = {run}
run(); run()  # the second call replays the plan / reruns the prepared call
if w.rank == 1:
    time.sleep(600)  # never arrives
run()
"""


_SYMMETRIC = ("from collectives import symmetric\n"
              "x = symmetric.empty(1024, np.float32); y = symmetric.empty(1024, np.float32)")


@pytest.mark.parametrize("setup, run, named", [
    ("", "lambda: C.all_to_all(x, y, algo='native')", "all_to_all (native)"),
    ("", "C.prepare_all_to_all(x, y, algo='native')", "all_to_all (native, prepared)"),
    (_SYMMETRIC, "lambda: C.all_reduce(x, y, algo='symmetric')", "all_reduce (symmetric)")])
def test_a_stalled_repeated_call_aborts_the_job_naming_it(tmp_path, setup, run, named):
    script = tmp_path / "job.py"
    script.write_text(_STALL_JOB.format(setup=setup, run=run))
    env = dict(os.environ, NEOCOMM_TIMEOUT="3", NEOCOMM_CHECK_ARGS="0")
    out = subprocess.run([sys.executable, "-m", "neocomm.cli", "run", "-n", "2", "--timeout",
                          "90", "--", sys.executable, str(script)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode not in (0, 124), out
    assert f"rank 0: {named} has not completed after" in out.stderr, out.stderr
