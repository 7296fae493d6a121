"""Plans of repeated calls and the watchdog's open waits, in one process (a world of one
rank: the calls are real, their plans too)."""
from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import collectives as C
from collectives import api, api_v, plan as P, progress, settings
from neocomm import watchdog


@pytest.fixture(scope="module")
def world():
    import neocomm

    return neocomm.init()


@pytest.fixture
def builds(world, monkeypatch):
    """The plans this process builds (each one as built)."""
    made = []
    real = api.build

    def counted(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(api, "build", counted)
    monkeypatch.setattr(api_v, "build", counted)
    C.state_of(None).plans.clear()
    yield made
    C.state_of(None).plans.clear()


def test_one_plan_serves_the_same_buffers_new_buffers_and_async_calls(builds):
    x, y = np.arange(4.0), np.zeros(4)
    for _ in range(3):
        assert C.all_to_all(x, y) is y and np.array_equal(y, x)
    z, w = np.arange(4.0) + 1, np.zeros(4)
    assert C.all_to_all(z, w) is w and np.array_equal(w, z)
    assert C.all_to_all(x, y, async_op=True).wait() is y
    assert len(builds) == 1
    C.all_to_all(np.arange(8.0), np.zeros(8))  # another size: another layout
    C.all_to_all(x.astype(np.float32), y.astype(np.float32))  # another dtype
    assert len(builds) == 3


def test_a_call_without_recvbuf_allocates_from_its_plan(builds):
    x = np.arange(6.0).reshape(2, 3)
    first, second = C.all_to_all(x), C.all_to_all(x)
    assert first is not second and first.shape == (2, 3) and np.array_equal(second, x)
    assert len(builds) == 1


def test_plans_do_not_keep_buffers_alive(builds):
    x, y = np.arange(4.0), np.zeros(4)
    C.all_to_all(x, y)
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None and len(C.state_of(None).plans) == 1


def test_changed_settings_and_the_check_flag_make_a_new_plan(builds, monkeypatch):
    x, y = np.arange(4.0), np.zeros(4)
    C.all_reduce(x, y)
    settings.reload()  # the same values: the same plan
    C.all_reduce(x, y)
    assert len(builds) == 1
    try:
        with monkeypatch.context() as env:
            env.setenv("NEOCOMM_PIPELINE_DEPTH", str(settings.current().depth + 1))
            settings.reload()  # other values: a new plan
            C.all_reduce(x, y)
    finally:
        settings.reload()
    C.all_reduce(x, y)  # (and back)
    state = C.state_of(None)
    state.check = not state.check
    try:
        C.all_reduce(x, y)
    finally:
        state.check = not state.check
    C.all_reduce(x, y)
    assert len(builds) == 5


def test_an_outstanding_operation_is_driven_by_a_planned_call(builds):
    x, y = np.arange(4.0), np.zeros(4)
    C.all_to_all(x, y)
    steps = []

    def other():
        steps.append("started")
        yield (_Later(steps),)
        steps.append("finished")

    handle = progress.start(other(), "other", True, "other", C.state_of(None).progress)
    assert C.all_to_all(x, y) is y and steps[-1] == "finished"  # drove the other one
    assert handle.wait() == "other" and len(builds) == 1


class _Later:
    """A handle that completes the second time it is tested."""

    def __init__(self, steps):
        self.done, self.steps = False, steps

    def test(self):
        self.done = self.steps.count("tested") > 0
        self.steps.append("tested")
        return self.done

    def wait(self):
        self.done = True


def test_the_fast_call_is_an_open_wait_named_after_the_op_even_when_it_raises(builds):
    x, y = np.arange(4.0), np.zeros(4)
    C.all_to_all(x, y, algo="native")
    plan = builds[0]
    seen = []

    def fast(s, r):
        seen.extend(what for what, _ in watchdog._open_slots())
        raise RuntimeError("boom")

    plan.fast = fast
    with pytest.raises(RuntimeError, match="boom"):
        C.all_to_all(x, y, algo="native")
    assert len(seen) == 1 and seen[0].startswith("all_to_all (native) on group 'world', call #")
    assert not watchdog._open_slots()


def test_the_generic_path_lends_the_buffers_only_while_it_runs(builds, monkeypatch):
    x, y = np.arange(4.0), np.zeros(4)
    C.all_to_all(x, y, algo="pairwise")
    plan = builds[0]
    assert plan.fast is None and plan._call.sendbuf is None and plan._call.recvbuf is None
    lent = []
    real = plan._algo.run

    def run(call):
        lent.append(call.sendbuf)
        yield from real(call)

    monkeypatch.setattr(plan, "_algo", type("A", (), {"run": staticmethod(run)})())
    z = np.arange(4.0) + 5
    assert C.all_to_all(z, y, algo="pairwise") is y and np.array_equal(y, z)
    assert np.shares_memory(lent[-1], z) and plan._call.sendbuf is None


def test_an_all_to_all_v_returns_its_buffer_and_counts_from_the_plan(builds):
    x, y = np.arange(4.0), np.zeros(4)
    for _ in range(2):
        out, counts = C.all_to_all_v(x, [4], y, [4])
        assert out is y and list(counts) == [4] and np.array_equal(y, x)
    assert len(builds) == 1 and isinstance(builds[0], P.VPlan)


def test_preparing_builds_the_plan_without_running_it(builds):
    x, y = np.arange(4.0), np.full(4, -1.0)
    prep = C.prepare_all_to_all(x, y)
    assert np.all(y == -1) and prep.plan is builds[0]
    assert prep() is y and np.array_equal(y, x)
    prep.free()


def test_plans_of_several_threads_stay_apart(builds):
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(200):
            x = rng.random(8)
            y = np.empty(8)
            if not np.array_equal(C.all_reduce(x, y), x):
                errors.append(seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(C.state_of(None).plans) == 1


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
    ("", "lambda: C.all_to_all(x, y, algo='native')", "all_to_all (native) on group 'world'"),
    ("", "C.prepare_all_to_all(x, y, algo='native')", "all_to_all (native) on group 'world'"),
    (_SYMMETRIC, "lambda: C.all_reduce(x, y, algo='symmetric')",
     "all_reduce (symmetric) on group 'world'")])
def test_a_stalled_repeated_call_aborts_the_job_naming_it(tmp_path, setup, run, named):
    script = tmp_path / "job.py"
    script.write_text(_STALL_JOB.format(setup=setup, run=run))
    env = dict(os.environ, NEOCOMM_TIMEOUT="3", NEOCOMM_CHECK_ARGS="0")
    out = subprocess.run([sys.executable, "-m", "neocomm.cli", "run", "-n", "2", "--timeout",
                          "90", "--", sys.executable, str(script)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode not in (0, 124), out
    assert re.search(f"rank 0: {re.escape(named)}, call #2 has not completed after",
                     out.stderr), out.stderr
