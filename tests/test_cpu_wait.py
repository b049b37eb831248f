"""The training thread's wait for a CPU, per step: read from Linux's run-queue time, checked on a
loop that shares its one core with a busy neighbour."""
import sys
import threading
import time
from pathlib import Path

import pytest

from traceml.probe.cpu_wait import CpuWait

SHARED_CORE = Path(__file__).parent / "scripts" / "shared_core.py"
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's schedstat")


@linux_only
def test_a_step_sharing_its_core_with_a_busy_process_waits_about_half_of_it(traceml_run):
    # Two runnable threads on one core: the scheduler gives each about half of it, so the
    # training thread waits about half of each step (other processes on the core: more).
    run = traceml_run("--neighbour", script=SHARED_CORE)
    assert run.returncode == 0, run.stderr
    rows = [row for row in run.step_rows() if row["step"] > 0]  # step 0 began before the probe
    assert len(rows) == 149 and all(row["cpu_wait_ms"] is not None for row in rows)
    share = sum(row["cpu_wait_ms"] for row in rows) / sum(row["step_ms"] for row in rows)
    assert 0.3 <= share <= 0.9, share
    assert all(0.0 <= row["cpu_wait_ms"] <= row["step_ms"] * 1.05 for row in rows)


@linux_only
def test_the_wait_between_two_moments_is_known_only_within_the_readings():
    waits = CpuWait(threading.get_native_id())
    first_s = time.time()
    time.sleep(0.01)
    waits.refresh()
    last_s = time.time()
    assert waits.wait_ms(first_s, first_s) == 0.0
    assert waits.wait_ms(first_s - 1.0, first_s) is None  # before the first reading
    assert waits.wait_ms(first_s, last_s + 1.0) is None  # after the last
    assert 0.0 <= waits.wait_ms(first_s, last_s - 0.001) <= 11.0


def test_without_schedstat_every_wait_is_unknown():
    waits = CpuWait(-1)  # no such thread: what a machine without /proc sees
    assert not waits.known
    waits.refresh()
    assert waits.wait_ms(0.0, time.time()) is None
