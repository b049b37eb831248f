"""Names the training thread's untimed time: its stack, sampled from another thread, tallied by
the innermost frame of the user's own code (probe/pulse.is_user_frame says which frames are).

Inside the training the sender thread samples, every round (20 ms), only while the thread is
outside the timed phases and only while that time is SAMPLE_LINE of the recent steps or more:
a clean loop costs the sender a few additions a step (note_steps) and its training thread
nothing. While a script starts under `traceml run`, a thread of its own samples it until the
first step (zero_code.py), keeping the script's top-level line each sample ran under too.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from types import CodeType, FrameType
from typing import Any, Callable, Dict, List, Optional, Tuple

from traceml.probe.pulse import is_user_frame
from traceml.probe.layout import NO_PHASE
from traceml.records import MAX_WARMUP_STEPS, CodeSample, CodeSite, StepRecord

# What is sampled: untimed time in the step (outside the timed phases), between steps (not input
# wait, evaluation or a save), and the script's start before its first step.
CODE_PARTS = ("untraced", "outside", "startup")
SAMPLE_INTERVAL_S = 0.02
# A sample stands for the time since the previous round, at most this. At startup a round comes
# late when an import holds the interpreter, and those seconds are the import's; in a step, where
# the thread was during a late round (a sender starved on a loaded machine) is not known, and one
# sample standing for half a second would swing a share its other samples hold steady.
MAX_WEIGHT_S = 5.0
MAX_STEP_WEIGHT_S = 4 * SAMPLE_INTERVAL_S
SAMPLE_LINE = 0.10  # a part at this share of the recent steps' time is sampled
RECENT_STEPS_MS = 1000.0  # the recent steps: at least this much step time, decided afresh each time
SITES_KEPT = 10
_IMPORTING = "<frozen importlib._bootstrap>"
_COMPREHENSIONS = frozenset(("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"))
# Library frames that make a sample another part's: input wait, a checkpoint save.
_TIMED_ELSEWHERE = ("/torch/utils/data/", "/torch/serialization.py")


class CodeSampler:
    """The tallies of one training thread (thread_id), part by part (CODE_PARTS).
    script: the script's path, whose top-level line a startup sample keeps; evaluating: whether
    the training thread is in an evaluation region the patches found (planned, not sampled)."""

    def __init__(self, thread_id: int, script: str = "", evaluating: Callable[[], bool] = lambda: False):
        self.thread_id, self.script, self._evaluating = thread_id, script, evaluating
        self.untraced_on = self.outside_on = False  # decided by note_steps
        self._recent = [0.0, 0.0, 0.0]  # step, untraced, outside (less planned work) ms
        # part -> {(file, function, first or top-level line, statement): [seconds, importing_s, {line: samples}]}
        self._sites: Dict[str, Dict[tuple, list]] = {part: {} for part in CODE_PARTS}
        self._samples = {part: 0 for part in CODE_PARTS}
        self._seconds = {part: 0.0 for part in CODE_PARTS}
        self._sent = dict(self._samples)
        self._round_at = time.monotonic()
        self._user: Dict[str, bool] = {}  # is_user_frame, by file

    # -- the sender thread -------------------------------------------------------------------
    def note_steps(self, steps: List[StepRecord]) -> None:
        """The steps just ended: once the recent ones add up to RECENT_STEPS_MS, whether each
        part is large enough to sample. The first steps (the probe's own set-up, warm-up) are
        not the run (records.warmup_steps)."""
        step_ms, untraced_ms, outside_ms = self._recent
        for step in steps:
            if step.step < MAX_WARMUP_STEPS:
                continue
            step_ms += step.step_ms
            untraced_ms += step.untraced_ms
            outside_ms += step.outside_ms
        if step_ms < RECENT_STEPS_MS:
            self._recent = [step_ms, untraced_ms, outside_ms]
            return
        was_on = self.untraced_on or self.outside_on
        self.untraced_on = untraced_ms >= SAMPLE_LINE * step_ms
        self.outside_on = outside_ms >= SAMPLE_LINE * step_ms
        self._recent = [0.0, 0.0, 0.0]
        if not was_on:
            self._round_at = time.monotonic()  # the first sample stands for one round

    def sample(self, probe: Any) -> None:
        """One round: a sample when the thread is in a part being sampled (not in evaluation)."""
        if not (self.untraced_on or self.outside_on):
            return
        now = time.monotonic()
        weight, self._round_at = min(now - self._round_at, MAX_STEP_WEIGHT_S), now
        if probe.in_step:
            if not self.untraced_on or probe.open_phase != NO_PHASE:
                return
            part = "untraced"
        elif self.outside_on:
            part = "outside"
        else:
            return
        if not probe.in_evaluation and not self._evaluating():
            self._take(part, sys._current_frames().get(self.thread_id), weight)

    def records(self, rank: int) -> List[CodeSample]:
        """A CodeSample of each part sampled since the last call (cumulative figures)."""
        made = []
        for part, samples in self._samples.items():
            if samples != self._sent[part]:
                self._sent[part] = samples
                made.append(CodeSample(rank=rank, part=part, samples=samples, seconds=self._seconds[part],
                                       sites=self._top(part)))
        return made

    # -- startup ----------------------------------------------------------------------------
    def sample_startup(self, stop: threading.Event) -> None:
        """Sample the script's start every SAMPLE_INTERVAL_S until `stop` is set (a thread's target)."""
        with contextlib.suppress(Exception):  # frames it cannot read: startup goes unnamed, the script runs on
            while not stop.wait(SAMPLE_INTERVAL_S):
                now = time.monotonic()
                weight, self._round_at = min(now - self._round_at, MAX_WEIGHT_S), now
                self._take("startup", sys._current_frames().get(self.thread_id), weight)

    # -- the tallies -------------------------------------------------------------------------
    def _take(self, part: str, frame: Optional[FrameType], weight: float) -> None:
        innermost: Optional[Tuple[CodeType, int]] = None
        statement = importing = 0
        while frame is not None:
            code = frame.f_code
            path = code.co_filename
            user = self._user.get(path)
            if user is None:
                user = self._user[path] = is_user_frame(path)
            if innermost is None:
                if user and code.co_name in _COMPREHENSIONS and frame.f_back is not None \
                        and frame.f_back.f_code.co_filename == path:
                    pass  # a comprehension's time is its enclosing function's (or statement's)
                elif user:
                    innermost = (code, frame.f_lineno or 0)
                    if part != "startup":
                        break
                elif part != "startup" and any(mark in path.replace("\\", "/") for mark in _TIMED_ELSEWHERE):
                    return
            if part == "startup":
                if path == _IMPORTING:
                    importing = 1
                elif path == self.script and code.co_name == "<module>":
                    statement = frame.f_lineno or 0
            frame = frame.f_back
        if innermost is None:
            return
        code, line = innermost
        top_level = code.co_name == "<module>"
        if top_level and code.co_filename == self.script and line == statement:
            statement = 0  # the site is the statement itself
        key = (code.co_filename, code.co_name, line if top_level else code.co_firstlineno, statement)
        self._samples[part] += 1
        self._seconds[part] += weight
        tally = self._sites[part].setdefault(key, [0.0, 0.0, {}])
        tally[0] += weight
        tally[1] += weight if importing else 0.0
        tally[2][line] = tally[2].get(line, 0) + 1

    def _top(self, part: str) -> List[CodeSite]:
        tallies = sorted(self._sites[part].items(), key=lambda item: -item[1][0])[:SITES_KEPT]
        return [CodeSite(file=file, line=max(lines, key=lines.__getitem__), function=function, seconds=seconds,
                         importing_s=importing_s, statement=statement)
                for (file, function, _, statement), (seconds, importing_s, lines) in tallies]


class StartupSampler:
    """zero_code's sampler of a script's start: a thread sampling the main thread until stop()."""

    def __init__(self, script: str):
        self.sampler = CodeSampler(threading.get_ident(), script)
        self.modules_before = len(sys.modules)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.sampler.sample_startup, args=(self._stop,),
                                        name="traceml-startup", daemon=True)
        self._thread.start()

    def stop(self, rank: int) -> Tuple[List[CodeSample], int]:
        """Stop sampling: the startup's CodeSample (none without a sample), and the modules
        loaded since the start."""
        self._stop.set()
        self._thread.join(timeout=1.0)
        return self.sampler.records(rank), len(sys.modules) - self.modules_before
