"""Goodput: where each rank's wall time went, from its process's start to its exit: startup,
training, evaluation, checkpoint and other. The collector tallies it as records arrive; a run
read back from its store is tallied the same way; the summary, the card, the live views and
/metrics all read the one Goodput this gives.

A rank's time splits as follows (every figure comes from the records; nothing is guessed):
- startup: process start to its first step's window, plus that step's input wait (the first
  batch) and the first compilation of each function torch.compile compiled within the steps;
- evaluation and checkpoint: the steps' eval_ms and checkpoint_ms (beside their step_ms, never
  in it), and the goodbye's tail figures (a final evaluation or save after the last step);
- other: the rest of the time between steps (outside_ms), and after the last step (teardown),
  and whatever no record covers;
- training: the steps' time less all of the above that fell inside them.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple, TypedDict, cast

import msgspec

from traceml.records import CompileRecord, RankEnd, RankHello, StepRecord, window_end_unix_s

PARTS = ("startup", "training", "evaluation", "checkpoint", "other")
FIRST_COMPILE_TRIGGERS = ("dynamo", "lazy_backward")


def is_first_compilation(record: CompileRecord) -> bool:
    """A frame's first compilation (torch's compile id "frame/0"), forward or its backward."""
    return record.trigger in FIRST_COMPILE_TRIGGERS and not record.recompiled


class RankTime(msgspec.Struct):
    """One rank's running totals, in ms unless named otherwise."""

    rank: int
    started_unix_s: Optional[float] = None  # the process's start, from its hello
    ended_unix_s: Optional[float] = None  # from its goodbye
    imports_ms: Optional[float] = None
    slowest_import: str = ""
    modules_imported: int = 0
    first_step: Optional[int] = None
    first_step_unix_s: Optional[float] = None  # where the first step's window starts
    first_input_wait_ms: float = 0.0
    last_end_unix_s: Optional[float] = None  # where the latest step's window ends
    step_ms: float = 0.0
    eval_ms: float = 0.0
    checkpoint_ms: float = 0.0
    between_other_ms: float = 0.0  # outside_ms: between steps, neither evaluation nor a save
    first_compile_in_steps_ms: float = 0.0
    first_compile_ms: float = 0.0  # every first compilation, before the steps too
    tail_eval_ms: float = 0.0  # from the goodbye: a final evaluation or save after the last step
    tail_checkpoint_ms: float = 0.0
    tail_evaluations: int = 0  # how many: each evaluation (a save) after the last step
    tail_saves: int = 0

    def add_step(self, record: StepRecord) -> None:
        self.step_ms += record.step_ms
        self.eval_ms += record.eval_ms
        self.checkpoint_ms += record.checkpoint_ms
        self.between_other_ms += record.outside_ms
        if self.first_step is None or record.step < self.first_step:
            self.first_step, self.first_step_unix_s = record.step, record.start_unix_s
            self.first_input_wait_ms = record.input_wait_ms
        end_unix_s = window_end_unix_s(record)
        if self.last_end_unix_s is None or end_unix_s > self.last_end_unix_s:
            self.last_end_unix_s = end_unix_s

    def add_compile(self, record: CompileRecord) -> None:
        if is_first_compilation(record):
            self.first_compile_ms += record.duration_ms
            if record.step >= 0:
                self.first_compile_in_steps_ms += record.duration_ms

    def parts_ms(self, now_unix_s: Optional[float]) -> Dict[str, float]:
        """The rank's wall time, split into PARTS (they add up to it): until now_unix_s for a
        rank still running, or, for a finished run (None), until its goodbye (a rank that died
        without one: its last step's end)."""
        started = self.started_unix_s
        if started is None:
            return {}
        ended = self.ended_unix_s or now_unix_s or self.last_end_unix_s or started
        wall_ms = max(0.0, (ended - started) * 1e3)
        if self.first_step_unix_s is None:  # no step yet: all of it is startup
            return {"startup": wall_ms, "training": 0.0, "evaluation": 0.0, "checkpoint": 0.0, "other": 0.0}
        before_ms = max(0.0, (self.first_step_unix_s - started) * 1e3)
        startup = min(wall_ms, before_ms + self.first_input_wait_ms + self.first_compile_in_steps_ms)
        evaluation = self.eval_ms + self.tail_eval_ms
        checkpoint = self.checkpoint_ms + self.tail_checkpoint_ms
        training = max(0.0, self.step_ms - self.between_other_ms - self.first_input_wait_ms
                       - self.first_compile_in_steps_ms)
        other = max(0.0, wall_ms - startup - training - evaluation - checkpoint)
        return {"startup": startup, "training": training, "evaluation": evaluation,
                "checkpoint": checkpoint, "other": other}


class PartTime(TypedDict):
    seconds: float  # the mean over ranks
    share: float  # of all ranks' time


class _StartupParts(TypedDict):
    imports_s: Optional[float]  # None: no rank timed its imports
    first_compilation_s: float
    first_batch_s: float
    setup_s: float
    slowest_import: str


class Startup(_StartupParts, total=False):
    """What startup was made of (the mean over ranks, in seconds; see _startup_parts)."""

    modules_imported: int  # not in the summaries of runs before it was counted


class Goodput(msgspec.Struct):
    """The run's wall time by part: seconds (the mean over ranks) and shares (of all ranks'
    time), and what startup was made of."""

    wall_s: float
    parts: Dict[str, PartTime]
    startup: Startup
    # Of evaluation and checkpoint, what came after the last step (a final evaluation or save,
    # which no step's window holds): ms (the mean over ranks) and how many (the most of a rank).
    after_last_step: Dict[str, Dict[str, float]] = {}

    def share(self, part: str) -> float:
        return self.parts[part]["share"] if self.parts else 0.0

    def seconds(self, part: str) -> float:
        return self.parts[part]["seconds"] if self.parts else 0.0


class RunTime:
    """Every rank's RankTime, fed record by record."""

    def __init__(self) -> None:
        self.ranks: Dict[int, RankTime] = {}

    def _rank(self, rank: int) -> RankTime:
        tally = self.ranks.get(rank)
        if tally is None:
            tally = self.ranks[rank] = RankTime(rank=rank)
        return tally

    def add(self, record: object) -> None:
        """Tally one record; records of other types are left alone."""
        if isinstance(record, StepRecord):
            self._rank(record.rank).add_step(record)
        elif isinstance(record, CompileRecord):
            self._rank(record.rank).add_compile(record)
        elif isinstance(record, RankHello):
            tally = self._rank(record.rank)
            tally.started_unix_s = record.started_at_unix_s
            tally.imports_ms, tally.slowest_import = record.imports_ms, record.slowest_import
            tally.modules_imported = record.modules_imported
        elif isinstance(record, RankEnd):
            tally = self._rank(record.rank)
            tally.ended_unix_s = record.ended_unix_s
            tally.tail_eval_ms = record.tail_eval_ms
            tally.tail_checkpoint_ms = record.tail_checkpoint_ms
            tally.tail_evaluations, tally.tail_saves = record.tail_evaluations, record.tail_saves

    @classmethod
    def of(cls, records: Iterable[object]) -> "RunTime":
        run_time = cls()
        for record in records:
            run_time.add(record)
        return run_time

    def to_builtins(self) -> List[Dict[str, object]]:
        """The tallies as the store's meta keeps them (from_builtins reads them back)."""
        return cast(List[Dict[str, object]], msgspec.to_builtins(list(self.ranks.values())))

    @classmethod
    def from_builtins(cls, tallies: List[Dict[str, object]]) -> "RunTime":
        run_time = cls()
        for tally in msgspec.convert(tallies, List[RankTime]):
            run_time.ranks[tally.rank] = tally
        return run_time

    def goodput(self, now_unix_s: Optional[float]) -> Optional[Goodput]:
        """The run's goodput until now_unix_s (None: a finished run, see RankTime.parts_ms);
        None before any rank said hello."""
        split = [(tally, tally.parts_ms(now_unix_s)) for tally in list(self.ranks.values())]
        split = [(tally, parts) for tally, parts in split if parts]
        if not split:
            return None
        total_ms = sum(sum(parts.values()) for _, parts in split)
        count = len(split)
        parts: Dict[str, PartTime] = {part: {"seconds": sum(p[part] for _, p in split) / count / 1e3,
                        "share": sum(p[part] for _, p in split) / total_ms if total_ms else 0.0}
                 for part in PARTS}
        tallies = [tally for tally, _ in split]
        after = {part: {"ms": sum(getattr(t, f"tail_{name}_ms") for t in tallies) / count,
                        "count": max(getattr(t, f"tail_{many}") for t in tallies)}
                 for part, name, many in (("evaluation", "eval", "evaluations"), ("checkpoint", "checkpoint", "saves"))}
        return Goodput(wall_s=total_ms / count / 1e3, parts=parts, startup=_startup_parts(split), after_last_step=after)


def _startup_parts(split: List[Tuple[RankTime, Dict[str, float]]]) -> Startup:
    """What startup was made of, as far as it can be told (the mean over ranks, in seconds):
    the script's imports (every module it loaded, wherever), the first compilation, the first batch, and the rest (building the
    model, the data, the process group; the interpreter and TraceML's own start)."""
    count = len(split)
    imports = [t.imports_ms for t, _ in split if t.imports_ms is not None]
    imports_s = sum(imports) / len(imports) / 1e3 if imports else None
    compile_s = sum(t.first_compile_ms for t, _ in split) / count / 1e3
    batch_s = sum(t.first_input_wait_ms for t, _ in split if t.first_step is not None) / count / 1e3
    startup_s = sum(p["startup"] for _, p in split) / count / 1e3
    setup_s = max(0.0, startup_s - (imports_s or 0.0) - compile_s - batch_s)
    slowest = next((t.slowest_import for t, _ in split if t.slowest_import), "")
    return {"imports_s": imports_s, "first_compilation_s": compile_s, "first_batch_s": batch_s,
            "setup_s": setup_s, "slowest_import": slowest,
            "modules_imported": round(sum(t.modules_imported for t, _ in split) / count)}
