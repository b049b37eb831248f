"""`traceml run --on-alert CMD`: each new warn or crit finding of a live run, as one JSON document on
CMD's standard input (a chat webhook through curl, a pager, a script of the user's).

A thread reads the live findings every ALERT_CHECK_S and runs CMD through the shell once for each
finding kind and rank not sent before, one at a time. CMD gets ALERT_TIMEOUT_S: one that runs
longer is killed with its process group, and one that fails is logged with its last words;
neither touches the run. When the run ends, no new CMD starts, the one under way keeps the rest of
its time, and none outlives `traceml run`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
from typing import TYPE_CHECKING, Callable, Dict, Optional, Set, Tuple

import msgspec

from traceml.records import ALERT_SEVERITIES, FindingKind

if TYPE_CHECKING:
    from traceml.records import Finding
    from traceml.report.live import LiveState

log = logging.getLogger("traceml")

ALERT_CHECK_S = 2.0
ALERT_TIMEOUT_S = 10.0
# UNTRACED_WORK waits up to this many checks for the code it is sampled in (the probe samples
# once the share is large, and sends about once a second), so that its document names it.
UNNAMED_CHECKS = 3


class AlertCommand:
    """Runs `command` for each new warn or crit finding that `live_state()` shows."""

    def __init__(self, command: str, live_state: Callable[[], LiveState], script: str,
                 timeout_s: float = ALERT_TIMEOUT_S, check_s: float = ALERT_CHECK_S):
        self.command, self.live_state, self.script = command, live_state, script
        self.timeout_s, self.check_s = timeout_s, check_s
        self.sent: Set[Tuple[str, Optional[int]]] = set()
        self._unnamed: Dict[Tuple[str, Optional[int]], int] = {}  # checks that saw it without its code
        self._running: Optional[subprocess.Popen] = None  # the command under way, if any
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traceml-alerts", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 2.0)
        # The thread may still be inside a slow live_state() or a command's last moments; a
        # command left running would outlive the run by its own length (it has a session of its own).
        running = self._running
        if running is not None and running.poll() is None:
            _kill_group(running)

    def _run(self) -> None:
        while not self._stop.wait(self.check_s):
            try:
                findings = list(self.live_state().findings)
            except Exception:  # no live state this time: the next check tries again
                log.debug("traceml: no live findings for --on-alert", exc_info=True)
                continue
            for finding in findings:
                key = (finding.kind, finding.rank)
                if self._stop.is_set():
                    return
                if finding.severity in ALERT_SEVERITIES and key not in self.sent:
                    if finding.kind == FindingKind.UNTRACED_WORK and "code_1" not in finding.evidence:
                        self._unnamed[key] = self._unnamed.get(key, 0) + 1
                        if self._unnamed[key] <= UNNAMED_CHECKS:
                            continue
                    self.sent.add(key)
                    self.send(finding)

    def send(self, finding: Finding) -> None:
        """Run the command once with the finding on its standard input; bounded, never raising."""
        document = json.dumps({"script": self.script, **msgspec.to_builtins(finding)}) + "\n"
        try:
            process = subprocess.Popen(self.command, shell=True, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            log.warning("traceml: --on-alert could not start %r: %s", self.command, exc)
            return
        self._running = process
        try:
            _, stderr = process.communicate(document.encode(), timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            log.warning("traceml: --on-alert %r ran past %g s for %s and was stopped", self.command,
                        self.timeout_s, finding.kind)
            return
        except OSError as exc:  # it closed its input early
            _kill_group(process)
            log.warning("traceml: --on-alert %r: %s", self.command, exc)
            return
        if process.returncode != 0:
            said = stderr.decode(errors="replace").strip().splitlines()[-1:] if stderr else []
            log.warning("traceml: --on-alert %r exited %s for %s%s", self.command, process.returncode,
                        finding.kind, f": {said[0]}" if said else "")


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
