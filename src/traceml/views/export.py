"""`traceml export RUN --format chrome|jsonl|csv [--steps A:B]`: a run's records in the tools users
already have.

chrome: a Trace Event Format file that Perfetto (ui.perfetto.dev) and chrome://tracing load.
One process per rank; on its "steps" track each step is a slice with its phases nested inside,
laid out in a fixed order from the step's real start (the probe measures how long each phase
took, not when inside the step); GC pauses (summed per step) on a track of their own; each
user span name on its own track at its real start; memory as counter tracks.
jsonl: one JSON object a line: every step, span and scalar record, with its type.
csv: the steps table, one row per rank and step.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Tuple

from traceml.records import TIMELINE_ORDER
from traceml.report.queries import MEMORY_COLUMNS
from traceml.report.stored_records import STEP_FIELDS, StoredRecords

FORMATS = ("chrome", "jsonl", "csv")
SUFFIX = {"chrome": "trace.json", "jsonl": "records.jsonl", "csv": "steps.csv"}
STEPS_TID, GC_TID, FIRST_SPAN_TID = 1, 2, 10


def parse_steps(text: Optional[str]) -> Tuple[int, int]:
    """"A:B" (either side may be empty) as an inclusive step range; raises ValueError."""
    if not text:
        return 0, 2 ** 62
    low, sep, high = text.partition(":")
    if not sep:
        raise ValueError(f"--steps takes A:B, not {text!r}")
    first = int(low) if low.strip() else 0
    last = int(high) if high.strip() else 2 ** 62
    if first < 0 or last < first:
        raise ValueError(f"--steps {text}: the range is empty or negative")
    return first, last


def export_run(run_dir: Path, fmt: str, steps: Optional[str], out: Optional[str]) -> Tuple[int, str]:
    """`traceml export`: write the run's records (steps "A:B" only, when given) to `out` ("-":
    stdout; None: a file in the run dir); (how many step records, where). Raises ValueError or
    OSError with the one line to say what is wrong."""
    first, last = parse_steps(steps)
    records = StoredRecords.open(run_dir)
    target = out or os.fspath(run_dir / SUFFIX[fmt])
    try:
        if target == "-":
            return export(records, fmt, first, last, sys.stdout), target
        with open(target, "w", newline="") as stream:
            return export(records, fmt, first, last, stream), target
    except OSError as exc:
        raise OSError(f"cannot write {target}: {exc.strerror or exc}") from None
    finally:
        records.close()


def export(records: StoredRecords, fmt: str, first: int, last: int, out: IO[str]) -> int:
    """Write the run's records between steps first and last; returns how many steps went out."""
    count = 0
    if fmt == "csv":
        writer = csv.writer(out)
        writer.writerow(STEP_FIELDS)
        for count, step in enumerate(records.steps(first, last), 1):
            writer.writerow([step[name] for name in STEP_FIELDS])
        return count
    if fmt == "jsonl":
        for count, step in enumerate(records.steps(first, last), 1):
            out.write(json.dumps({"type": "step", **step}) + "\n")
        for span in records.spans(first, last):
            out.write(json.dumps({"type": "span", **span}) + "\n")
        for scalar in records.scalars(first, last):
            out.write(json.dumps({"type": "scalar", **scalar}) + "\n")
        return count
    if fmt == "chrome":
        events, count = chrome_events(records, first, last)
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, out)
        return count
    raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")


def chrome_events(records: StoredRecords, first: int, last: int) -> Tuple[List[Dict[str, Any]], int]:
    events: List[Dict[str, Any]] = []
    ranks = set()
    count = 0
    origin: Optional[float] = None  # microseconds: times start at the first step shown
    previous_end: Dict[int, int] = {}
    name: str  # a phase's, then a span's
    for step in records.steps(first, last):
        rank = step["rank"]
        start_us = round(step["start_unix_s"] * 1e6)
        origin = start_us if origin is None else min(origin, start_us)
        # Slices on one track must not overlap: a step starts no earlier than the last ended.
        start_us = max(start_us, previous_end.get(rank, start_us))
        duration_us = max(1, round(step["step_ms"] * 1000))
        end_us = start_us + duration_us
        previous_end[rank] = end_us
        ranks.add(rank)
        count += 1
        events.append({"name": f"step {step['step']}", "cat": "step", "ph": "X", "pid": rank,
                       "tid": STEPS_TID, "ts": start_us, "dur": duration_us,
                       "args": {"step": step["step"], "step_ms": step["step_ms"],
                                "samples": step["samples"], "forward_calls": step["forward_calls"]}})
        # Inside the step slice: the step's own phases, then the time after it until the next step.
        at = start_us
        for name in TIMELINE_ORDER:
            phase_us = min(round(step[f"{name}_ms"] * 1000), end_us - at)
            if phase_us <= 0:
                continue
            events.append({"name": name, "cat": "phase", "ph": "X", "pid": rank, "tid": STEPS_TID,
                           "ts": at, "dur": phase_us, "args": {"ms": step[f"{name}_ms"]}})
            at += phase_us
        if step["gc_ms"] > 0:
            events.append({"name": "gc pauses", "cat": "gc", "ph": "X", "pid": rank, "tid": GC_TID,
                           "ts": start_us, "dur": min(duration_us, max(1, round(step["gc_ms"] * 1000))),
                           "args": {"ms": step["gc_ms"], "collections": step["gc_collections"],
                                    "longest_pause_ms": step["gc_max_pause_ms"],
                                    "note": "summed over the step; their positions are not recorded"}})
        counters = {name: step[name] / 2 ** 20 for name in MEMORY_COLUMNS if step[name] is not None}
        if counters:
            events.append({"name": "memory MiB", "ph": "C", "pid": rank, "ts": start_us,
                           "args": {name.replace("_bytes", ""): round(value, 3)
                                    for name, value in counters.items()}})
    span_tids: Dict[Tuple[int, str], int] = {}
    span_end: Dict[Tuple[int, str], int] = {}
    for span in records.spans(first, last):
        key = (span["rank"], span["name"])
        if key not in span_tids:
            span_tids[key] = FIRST_SPAN_TID + len([k for k in span_tids if k[0] == span["rank"]])
        ranks.add(span["rank"])
        start_us = round(span["start_unix_s"] * 1e6)
        start_us = max(start_us, span_end.get(key, start_us))  # summed calls may run long
        duration_us = max(1, round(span["duration_ms"] * 1000))
        span_end[key] = start_us + duration_us
        events.append({"name": span["name"], "cat": "span", "ph": "X", "pid": span["rank"],
                       "tid": span_tids[key], "ts": start_us, "dur": duration_us,
                       "args": {"step": span["step"], "calls": span["count"],
                                "note": "calls summed, from the first call's start"}})
    for rank in sorted(ranks):
        events += [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
                   {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
                   {"name": "thread_name", "ph": "M", "pid": rank, "tid": STEPS_TID, "args": {"name": "steps"}},
                   {"name": "thread_name", "ph": "M", "pid": rank, "tid": GC_TID, "args": {"name": "gc"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": f"span: {name}"}}
               for (rank, name), tid in span_tids.items()]
    if origin is not None:  # relative times read better than microseconds since 1970
        for event in events:
            if "ts" in event:
                event["ts"] -= origin
    return events, count
