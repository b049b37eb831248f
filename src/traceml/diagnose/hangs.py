"""HANG: a rank has ended no step for longer than its steps allow, and where each rank is.

The collector checks every second (collector/server.py) from what each rank last said: its
steps, and, once it has gone PULSE_AFTER_S without ending one, its pulses (probe/pulse.py:
the phase open, the training thread's stack, the collective it waits in). A rank is stalled
when it has ended no step for

    max(hang_after_s, HANG_STEP_MULTIPLE x its median step)   (hang_after_s: 30 s by default)

or, before its first step ends (imports, loading, a first compilation), for FIRST_STEP_S.
Evaluation, a checkpoint save and a compilation that its stack shows are not stalls. The
finding names the rank the others wait for: the one that has issued fewer collectives than the
others on a process group where the counts differ and more on none (Counts); then one gone (no goodbye) or frozen (no pulse for SENDER_SILENT_S). It tells
the ranks waiting in a collective (DDP's all-reduce in backward, from C++, with no frame of its
own, included) from those that never came (their line, or a DataLoader wait).

RANK_LOST is the end-of-run twin for a rank that died: it ended without a goodbye (SIGKILL from
the out-of-memory killer or a scheduler, a crash in native code), named with the exit status its
launcher saw (traceml.agent) and what that status usually means.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, TypedDict

from traceml.records import (PLANNED_WORK, PULSE_AFTER_S, Beside, Evidence, Finding, FindingKind, Phase, RankPulse, Severity,
                             StrEnum)

HANG_AFTER_S = 30.0  # the least a rank goes without ending a step before it is stalled
HANG_STEP_MULTIPLE = 10.0  # ... or this many of its median steps, when longer
FIRST_STEP_S = 600.0  # before its first step ends: imports, loading the model, a first compilation
PULSE_DUE_S = PULSE_AFTER_S + 3.0  # a rank's first pulse, a little late on a busy machine
SENDER_SILENT_S = 15.0  # a stalled rank pulses every 5 s: three missed and its process is frozen


class HangState(StrEnum):
    """Where a rank is, as the hang rule places it: the one list of states (the card, the web
    page and the JSON show the value)."""

    STEPPING = "stepping"  # within its allowance
    COLLECTIVE = "collective"  # waits in a collective
    OWN_CODE = "own code"
    INPUT = "input"  # a DataLoader wait
    PLANNED = "planned"  # evaluation, a checkpoint save, a compilation (PLANNED_WORK)
    GONE = "gone"  # its connection dropped without a goodbye
    FROZEN = "frozen"  # no word from it for SENDER_SILENT_S
    ENDED = "ended"  # it said goodbye


PULSED_STATES = (HangState.COLLECTIVE, HangState.INPUT, HangState.OWN_CODE)  # where a rank's pulse places it
SILENT_STATES = (HangState.GONE, HangState.FROZEN)  # no count from them: they have not arrived


def hang_after_s_from_env() -> float:
    """`traceml run --hang-after S` (TRACEML_HANG_AFTER_S), or HANG_AFTER_S."""
    try:
        return max(1.0, float(os.environ.get("TRACEML_HANG_AFTER_S", HANG_AFTER_S)))
    except ValueError:
        return HANG_AFTER_S


@dataclass
class RankProgress:
    """What the collector last heard from one rank."""

    rank: int
    pid: int
    host: str
    steps_ended: int
    last_progress_unix_s: float  # its last step's end, or its hello before the first
    median_step_ms: Optional[float]
    last_heard_unix_s: float
    pulse: Optional[RankPulse] = None
    said_goodbye: bool = False
    gone: bool = False  # the connection dropped without a goodbye


class LoaderWorker(TypedDict):
    """The DataLoader worker a rank waits on: its index, pid and the kernel's word for its state."""

    worker: int
    pid: int
    state: str


class _RankPlaceFigures(TypedDict):
    rank: int
    pid: int
    host: str
    last_step: int
    stalled_s: float
    allowed_s: float
    phase: Optional[str]  # a Phase or a Beside, from its pulse
    waiting_in: Optional[str]
    stack: List[str]  # "file.py:12 function", innermost first
    innermost: Optional[str]
    where: Optional[str]
    stalled: bool
    state: HangState
    pulsing: bool
    collectives_issued: Optional[int]
    subgroup_collectives: Dict[str, int]
    waiting_group: Optional[str]


class RankPlace(_RankPlaceFigures, total=False):
    """Where one rank is under a hang (the summary's hang.ranks, one per rank); the keys below
    only where they are known."""

    loader_worker: LoaderWorker  # in a DataLoader wait
    alive: Optional[bool]  # gone: whether its pid still runs (None: another host)
    exit_code: Optional[int]  # how it ended, where its launcher saw it (the summary adds it)


class HangSummary(TypedDict):
    """The summary's `hang` (and the store's meta's, which also keeps the finding)."""

    summary: str
    stalled_ranks: List[int]
    culprit_rank: Optional[int]
    ranks: List[RankPlace]


class StoredHang(HangSummary):
    finding: Dict[str, object]  # the HANG Finding, as msgspec.to_builtins writes it


@dataclass
class Hang:
    """A HANG finding and, for the summary's `hang`, each rank's place."""

    finding: Finding
    ranks: List[RankPlace] = field(default_factory=list)
    stalled_ranks: List[int] = field(default_factory=list)

    def to_builtins(self) -> StoredHang:
        """The summary's `hang` (and the store's meta, where the summary reads it back)."""
        import msgspec

        return {"summary": self.finding.summary, "stalled_ranks": self.stalled_ranks,
                "culprit_rank": self.finding.rank, "ranks": self.ranks,
                "finding": msgspec.to_builtins(self.finding)}


def allowance_s(progress: RankProgress, hang_after_s: float) -> float:
    """How long this rank may go without ending a step."""
    if progress.steps_ended == 0:
        return max(FIRST_STEP_S, hang_after_s)
    median_s = (progress.median_step_ms or 0.0) / 1e3
    return max(hang_after_s, HANG_STEP_MULTIPLE * median_s)


def find_hang(ranks: List[RankProgress], now_unix_s: float, hang_after_s: float = HANG_AFTER_S) -> Optional[Hang]:
    """The HANG finding for these ranks now, or None when none is stalled."""
    places = [_place(progress, now_unix_s, hang_after_s) for progress in sorted(ranks, key=lambda p: p.rank)]
    stalled = [place for place in places if place["stalled"]]
    if not stalled or _a_first_pulse_is_due(places):
        return None
    _place_the_pulsing_ranks(places)
    silent = [place for place in places if place["state"] in SILENT_STATES]
    counts = Counts(places)
    _place_the_ranks_waiting_in_autograd(places, counts, bool(silent))
    waiting = [place for place in places if place["state"] == HangState.COLLECTIVE]
    absent = [place for place in places if place["state"] in SILENT_STATES + (HangState.INPUT, HangState.OWN_CODE)]
    # The counts decide first: a rank that has issued fewer collectives than the others, on the
    # group they wait on, has not arrived where they wait, whatever its stack shows (an absent
    # one first, where several tie).
    decided_on = counts.deciding_group([place["waiting_group"] for place in waiting])
    behind = [place for place in absent + waiting if place["rank"] in counts.fewest(decided_on)]
    culprit = (behind + silent + absent + [None])[0]
    longest_s = max(place["stalled_s"] for place in stalled)
    parts = [_told(place) for place in [culprit, *(p for p in absent + waiting if p is not culprit)] if place]
    fewer = counts.told(decided_on)
    if fewer:
        parts.append(fewer)
    elif waiting and not absent:
        parts.append("every stalled rank waits in a collective: they called different ones, or one "
                     "called it fewer times")
    rank = culprit["rank"] if culprit else None
    summary = (f"no step has ended for {longest_s:.0f} s on {_ranks_text([p['rank'] for p in stalled])}: "
               + "; ".join(parts))
    action = _action(culprit)
    finding = Finding(kind=FindingKind.HANG, severity=Severity.CRIT, summary=summary, action=action, rank=rank,
                      evidence={"stalled_s": round(longest_s, 1), "stalled_ranks": len(stalled),
                                "waiting_ranks": len(waiting), "culprit_rank": rank,
                                "where": (culprit or waiting[0])["where"], **_figures(places),
                                **counts.evidence(decided_on)})
    return Hang(finding=finding, ranks=places, stalled_ranks=[place["rank"] for place in stalled])


def _figures(places: List[RankPlace]) -> Evidence:
    """Each rank's figures that the finding's words name, flat ("rank_1_stalled_s"), as evidence."""
    figures: Evidence = {}
    for place in places:
        worker = place.get("loader_worker")
        told: Evidence = {"stalled_s": place["stalled_s"], "pid": place["pid"], "host": place["host"],
                          "where": place["where"], "collectives_issued": place["collectives_issued"],
                          "worker": worker["worker"] if worker else None,
                          "worker_pid": worker["pid"] if worker else None}
        figures.update({f"rank_{place['rank']}_{key}": value for key, value in told.items() if value is not None})
    return figures


def _place(progress: RankProgress, now_unix_s: float, hang_after_s: float) -> RankPlace:
    """Where one rank is: its HangState, its line and how long it has gone without a step."""
    pulse = progress.pulse
    # A pulse from before the rank's latest step is stale. An inferred step is sent a step late:
    # a pulse that counted fewer steps but was taken after the latest one ended (both on the
    # rank's own clock) still says where the rank is.
    if pulse is not None and not (pulse.steps_ended >= progress.steps_ended
                                  or pulse.unix_s >= progress.last_progress_unix_s):
        pulse = None
    fresh = pulse is not None
    if pulse is not None:  # its own clock: no skew between nodes
        stalled_s = pulse.since_progress_s + max(0.0, now_unix_s - pulse.unix_s)
    else:
        stalled_s = max(0.0, now_unix_s - progress.last_progress_unix_s)
    place: RankPlace = {
        "rank": progress.rank, "pid": progress.pid, "host": progress.host, "last_step": progress.steps_ended - 1,
        "stalled_s": round(stalled_s, 1), "allowed_s": round(allowance_s(progress, hang_after_s), 1),
        "phase": pulse.phase if pulse else None, "waiting_in": (pulse.waiting_in or None) if pulse else None,
        "stack": [f"{f}:{line} {function}" for f, line, function in pulse.stack] if pulse else [],
        "innermost": pulse.innermost if pulse else None,
        "where": _where(pulse) if pulse else None, "stalled": False, "state": HangState.STEPPING,
        "pulsing": fresh,  # it has said where it is since its last step: PULSE_AFTER_S without one
        "collectives_issued": pulse.collectives_issued if pulse and pulse.collectives_issued >= 0 else None,
        "subgroup_collectives": dict(pulse.subgroup_collectives) if pulse else {},
        "waiting_group": (pulse.waiting_group or None) if pulse else None}
    if pulse is not None and pulse.loader_worker >= 0:
        place["loader_worker"] = {"worker": pulse.loader_worker, "pid": pulse.loader_worker_pid,
                                  "state": pulse.loader_worker_state}
    if progress.said_goodbye:
        place["state"] = HangState.ENDED
        return place
    if progress.gone:
        place["state"], place["stalled"] = HangState.GONE, stalled_s > place["allowed_s"]
        place["alive"] = _alive(progress.pid, progress.host)
        return place
    if stalled_s <= place["allowed_s"]:
        return place
    if pulse is not None and pulse.phase in PLANNED_WORK:
        place["state"] = HangState.PLANNED
        return place
    silent = now_unix_s - progress.last_heard_unix_s > SENDER_SILENT_S
    if not fresh and not silent:  # its pulse, saying where it is, is on its way: wait for it
        return place
    place["stalled"] = True
    place["state"] = HangState.FROZEN if silent else _pulsed_state(pulse.waiting_in if pulse else "")
    return place


def _pulsed_state(waiting_in: str) -> HangState:
    """Where a pulse places its rank (one of PULSED_STATES), from what it waits in."""
    if waiting_in == "DataLoader":
        return HangState.INPUT
    return HangState.COLLECTIVE if waiting_in else HangState.OWN_CODE


def _a_first_pulse_is_due(places: List[RankPlace]) -> bool:
    """Whether a rank that has ended no step for about PULSE_AFTER_S has yet to say where it is.
    With --hang-after near PULSE_AFTER_S, the rank the others wait for stops a moment after them
    and pulses a moment after they are past their allowance: the hang waits for that pulse (at
    most PULSE_DUE_S after the rank's last step) rather than be told without the rank it is about."""
    return any(place["state"] == HangState.STEPPING and not place["pulsing"]
               and PULSE_AFTER_S - 1.0 <= place["stalled_s"] < PULSE_DUE_S for place in places)


def _place_the_pulsing_ranks(places: List[RankPlace]) -> None:
    """Once one rank is stalled, where the ranks still within their own allowance but pulsing
    (no step for PULSE_AFTER_S) are: in a collective, a DataLoader wait or their own code. Ranks
    stop a second or two apart on a busy machine, and the first word of a hang must name the
    rank it is about and those waiting for it, not only those already past their allowance."""
    for place in places:
        if place["pulsing"] and place["state"] == HangState.STEPPING and place["phase"] not in PLANNED_WORK:
            place["state"] = _pulsed_state(place["waiting_in"] or "")


def _place_the_ranks_waiting_in_autograd(places: List[RankPlace], counts: "Counts", silent: bool) -> None:
    """A rank in backward with a library's frame innermost (the autograd engine's) waits in the
    gradient all-reduce DDP's reducer issued from C++, where no frame shows it, when it is ahead
    of another rank on the counts of some group or, the counts agreeing, a rank is gone or frozen."""
    for place in places:
        ahead = place["rank"] in counts.ahead if counts.differ else silent
        in_autograd = place["phase"] == Phase.BACKWARD and place["innermost"] != place["where"]
        if ahead and in_autograd and place["state"] == HangState.OWN_CODE:
            place["state"], place["waiting_in"] = HangState.COLLECTIVE, "DDP's all_reduce"


def _where(pulse: RankPulse) -> Optional[str]:
    """"train.py:88 load_shard": the innermost of the user's frames (or of all, when none is)."""
    if not pulse.stack:
        return pulse.innermost or None
    filename, line, function = pulse.stack[0]
    return f"{os.path.basename(filename)}:{line} {function}"


def _told(place: RankPlace) -> str:
    rank, state, where = place["rank"], place["state"], place["where"]
    at = f" at {where}" if where else ""
    if state == HangState.COLLECTIVE:
        phase = f" from {place['phase']}" if place["phase"] not in (None, Beside.IN_STEP, Phase.OUTSIDE) else ""
        return f"rank {rank} waits in {place['waiting_in']}{phase}{at} for {place['stalled_s']:.0f} s"
    if state == HangState.INPUT:
        worker = place.get("loader_worker")
        owed = ""
        if worker:
            status = ", ".join(filter(None, (f"pid {worker['pid']}" if worker["pid"] else "", worker["state"])))
            owed = (f": its worker {worker['worker']}{f' ({status})' if status else ''} has not handed "
                    f"over the batch it owes for {place['stalled_s']:.0f} s")
        return f"rank {rank} is in a DataLoader wait{at}{owed}"
    if state == HangState.GONE:
        alive = place.get("alive")
        status = "" if alive is None else (", its process still runs" if alive else ", its process is gone")
        return f"rank {rank} is gone (pid {place['pid']}: its connection dropped without a goodbye{status})"
    if state == HangState.FROZEN:
        return (f"rank {rank} no longer answers (pid {place['pid']} on {place['host']}: no word from it for "
                f"{place['stalled_s']:.0f} s; frozen, or stopped)")
    if state == HangState.OWN_CODE:
        return f"rank {rank} is in its own code{at}" + (f" ({place['phase']})" if place["phase"] else "")
    return f"rank {rank} is {state}"


WORLD = "world"  # the default group's label in a pulse's waiting_group


class Counts:
    """The collectives each live rank has issued, per process group (the default group,
    "world", and each DeviceMesh dimension's or new_group's it belongs to), and who is behind.

    In a group whose counts differ, the ranks short of its most have not arrived where its
    others wait. Groups chain: on a 2x2 mesh, a rank waiting on its TP peer may itself be ahead on
    its DP group, where the one stuck rank is behind. The rank behind in some group and ahead in
    none is where the chain ends."""

    def __init__(self, places: List[RankPlace]):
        self.by_group: Dict[str, Dict[int, int]] = {}
        for place in places:
            if place["collectives_issued"] is None or place["state"] in (HangState.GONE, HangState.ENDED):
                continue
            issued = {WORLD: place["collectives_issued"], **place["subgroup_collectives"]}
            for group, count in issued.items():
                self.by_group.setdefault(group, {})[place["rank"]] = count
        self.uneven = [group for group, counts in self.by_group.items() if len(set(counts.values())) > 1]
        self.differ = bool(self.uneven)
        self.behind = {rank for group in self.uneven for rank in self._short_of_most(group)}
        self.ahead = {rank for group in self.uneven for rank, count in self.by_group[group].items()
                      if count == max(self.by_group[group].values())}

    def _short_of_most(self, group: str) -> List[int]:
        counts = self.by_group[group]
        return [rank for rank, count in counts.items() if count < max(counts.values())]

    def deciding_group(self, waited_on: List[Optional[str]]) -> Optional[str]:
        """The group whose counts name the culprit: one where a rank at the end of the chain is
        behind, the group the waiting ranks wait on first; without such a rank (each behind is
        ahead elsewhere: mismatched calls), the group most of them wait on, then the default."""
        waited = [group for group in waited_on if group in self.uneven]
        ordered = sorted(self.uneven, key=lambda group: (-waited.count(group), group != WORLD))
        ends = self.behind - self.ahead
        for group in ordered:
            if ends & set(self._short_of_most(group)):
                return group
        return ordered[0] if ordered else None

    def fewest(self, group: Optional[str]) -> List[int]:
        """The ranks with the fewest on this group: those at the chain's end first, where any are."""
        if group is None:
            return []
        counts = self.by_group[group]
        short = [rank for rank in self._short_of_most(group) if rank not in self.ahead]
        return short or [rank for rank, count in counts.items() if count == min(counts.values())]

    def told(self, group: Optional[str]) -> str:
        """"rank 1 has issued 1 collective fewer than rank 0 (40 against 41)" on the default group,
        or "... on ranks 0, 1's group ..." on another; "" where the counts agree or are unknown."""
        if group is None:
            return ""
        counts = self.by_group[group]
        most = max(counts.values())
        ahead = _ranks_text([rank for rank, count in counts.items() if count == most])
        on = "" if group == WORLD else f" on the group of {group}"
        told = []
        for rank, count in counts.items():
            if count < most:
                fewer = most - count
                told.append(f"rank {rank} has issued {fewer} collective{'s' if fewer > 1 else ''} fewer than "
                            f"{ahead}{on} ({count} against {most})")
        return "; ".join(told)

    def evidence(self, group: Optional[str]) -> Evidence:
        """The deciding group and each rank's count on it, when it is not the default group (whose
        counts are each rank's collectives_issued)."""
        if group is None or group == WORLD:
            return {}
        return {"decided_on_group": group,
                **{f"rank_{rank}_issued_on_group": count for rank, count in self.by_group[group].items()}}


def _action(culprit: Optional[RankPlace]) -> str:
    if culprit and culprit["state"] == HangState.INPUT:
        worker = culprit.get("loader_worker")
        worker_pid = (worker["pid"] if worker else 0) or "<its worker's pid>"
        return (f"Look at rank {culprit['rank']}'s Dataset: a worker that hands nothing over is stuck in "
                "__getitem__ or collate (a file or socket that never answers, a lock taken before "
                f"the fork). `py-spy dump --pid {worker_pid}` shows where; the DataLoader's "
                "`timeout=` turns such a wait into an error.")
    look = culprit and f"rank {culprit['rank']}" + (f"'s {culprit['where']}" if culprit["where"] else "")
    if culprit and culprit["state"] != HangState.COLLECTIVE:
        return (f"Look at {look}: the other ranks wait for it in a collective it has not reached. "
                f"`py-spy dump --pid {culprit['pid']}` shows every thread's stack; a rank that died needs its "
                "own log (its exit status is in the launcher's output).")
    # Behind on the counts yet waiting itself, it skipped a collective the others called.
    return ((f"Look at {look}: it has issued fewer collectives than the ranks waiting for it" if culprit else
             "The ranks wait in collectives that do not match") + ": look for a collective called under a "
            "condition that differs across ranks (a rank-dependent branch, an uneven last batch, "
            "a metric gathered on rank 0 only). TORCH_DISTRIBUTED_DEBUG=DETAIL names the mismatch.")


def _alive(pid: int, host: str) -> Optional[bool]:
    """Whether the pid still runs, when it is on this machine (None: another host)."""
    import socket

    if not pid or host not in (socket.gethostname(), "localhost", "127.0.0.1"):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _ranks_text(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# What a rank's end without a goodbye usually means, by the signal that ended it.
_CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")
_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


class RankExit(TypedDict, total=False):
    """How a rank's process ended, as its launcher saw it (the store's meta's rank_exits)."""

    exit_code: int  # negative: the signal that killed it
    pid: int


class _MissingRankFigures(TypedDict):
    rank: int
    from_step: int  # the first step it did not report


class MissingRank(_MissingRankFigures, RankExit):
    """A rank that stopped reporting without a goodbye (the summary's missing_ranks)."""


def rank_lost(missing: List[MissingRank], exits: Dict[int, RankExit],
              world_size: int) -> Optional[Finding]:
    """RANK_LOST for the ranks that ended without a goodbye (summary's missing_ranks, each with
    the exit status its launcher saw where one did); exits: every failed rank's status, to tell
    the ranks the launcher stopped after the first one died. None when no rank went missing."""
    if not missing:
        return None
    first = missing[0]
    who = f"rank {first['rank']}" if world_size > 1 else "the training process"
    exit_code = first.get("exit_code")
    signal = signal_name(exit_code)
    last_step = first["from_step"] - 1
    # Its last ~100 ms of records were still in its sender when it died: "after", not "at".
    after = f"some time after step {last_step} (the last it reported)" if last_step >= 0 else \
        "before it reported a step"
    how = (f"killed by {signal} (exit status {exit_code})" if signal else
           f"exit status {exit_code}" if exit_code is not None else "its exit status was not seen here")
    summary = f"{who} ended without a goodbye {after}: {how}"
    others = [entry["rank"] for entry in missing[1:]]
    if others:
        summary += f"; {_ranks_text(others)} too"
    gone = {entry["rank"] for entry in missing}
    stopped = sorted(rank for rank, status in exits.items()
                     if rank not in gone and signal_name(status.get("exit_code")) in _STOP_SIGNALS)
    if stopped:
        summary += f"; {_ranks_text(stopped)} then stopped by the launcher"
    if signal == "SIGKILL":
        action = ("Nothing in a process can catch SIGKILL: on Linux it comes from the kernel's out-of-memory "
                  "killer (`dmesg -T | grep -i 'killed process'` on its host says so) or from a scheduler "
                  "past a memory or time limit (its log says so). Compare the host RSS above with the "
                  "node's memory, and each DataLoader worker's share of it.")
    elif signal in _CRASH_SIGNALS:
        action = (f"{signal} is a crash in native code (an extension, a kernel launch, a library the "
                  "DataLoader's workers use): run with PYTHONFAULTHANDLER=1 to get the Python stack "
                  "at the crash, or under `gdb -ex run --args python ...` for the native one.")
    elif signal is not None:
        action = (f"{signal} came from outside the process: a scheduler's preemption or time limit, or a "
                  "user. Its log says which; save checkpoints often enough to lose little to it.")
    elif exit_code is not None:
        action = ("It exited without running Python's exit handlers: os._exit(), or a library that "
                  "calls exit() in C. Its own output, above the card, says why.")
    else:
        action = ("Its node's launcher output has its exit status (torch.distributed.run prints every "
                  "failed rank's); a SIGKILL there is most often the out-of-memory killer.")
    return Finding(kind=FindingKind.RANK_LOST, severity=Severity.CRIT, summary=summary, action=action,
                   rank=first["rank"],
                   evidence={"rank": first["rank"], "last_step": last_step, "exit_code": exit_code,
                             "signal": signal, "pid": first.get("pid"),
                             "ranks_lost": len(missing), "ranks_stopped_after": len(stopped),
                             "other_ranks_lost": others, "ranks_stopped": stopped})


def signal_name(exit_code: Optional[int]) -> Optional[str]:
    """"SIGKILL" for a process killed by signal 9 (exit status -9); None for a plain exit."""
    if exit_code is None or exit_code >= 0:
        return None
    import signal

    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"
