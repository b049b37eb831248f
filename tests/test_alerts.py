"""--on-alert's command: bounded while the run goes on, and never left running after it ends."""
import threading
import time
from types import SimpleNamespace

import psutil

from traceml.records import Finding, FindingKind, Severity
from traceml.views.alerts import AlertCommand

HANG = Finding(kind=FindingKind.HANG, severity=Severity.CRIT, summary="rank 1 stalled", action="look", rank=1)


def _commands_running():
    return [child for child in psutil.Process().children(recursive=True)
            if child.status() != psutil.STATUS_ZOMBIE and "sleep" in " ".join(child.cmdline())]


def _wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_command_under_way_when_the_run_ends_keeps_its_time_then_is_stopped():
    alerts = AlertCommand("sleep 60", lambda: SimpleNamespace(findings=[HANG]), "train.py",
                          timeout_s=1.5, check_s=0.05)
    alerts.start()
    assert _wait_for(lambda: bool(_commands_running()))
    started = time.monotonic()
    alerts.stop()
    assert 0.5 < time.monotonic() - started < 5.0  # the rest of its 1.5 s, not its 60
    assert _wait_for(lambda: not _commands_running(), timeout_s=2.0)
    assert alerts.sent == {("HANG", 1)}


def test_no_command_starts_once_the_run_has_ended():
    # The live findings come slowly (a busy machine reading the store), after stop() gave up
    # waiting for them: the hang they hold is not sent by a run that has ended.
    release = threading.Event()

    def slow_live_state():
        release.wait(10)
        return SimpleNamespace(findings=[HANG])

    alerts = AlertCommand("sleep 60", slow_live_state, "train.py", timeout_s=0.2, check_s=0.05)
    alerts.start()
    time.sleep(0.2)  # the thread is inside slow_live_state()
    alerts.stop()
    release.set()
    time.sleep(0.5)
    assert not _commands_running() and alerts.sent == set()
