"""The GPU check: measures TraceML's CUDA claims on this machine and writes one table, a row per
claim with the figure measured, its threshold and pass/fail (scripts/gpu_check.sh runs it).

    python scripts/gpu_check.py [--out FILE] [--dry-run] [--only GROUP ...] [--impossible ROW ...]

Each group of rows runs its own training scripts (scripts/gpu_check/) in subprocesses with their
own timeout, inside a try, so one failure never loses the table; the table file is rewritten
after every group, so a check cut short still leaves what it measured. The exit status is 1 if
any row fails. Without CUDA (or with --dry-run) every group runs its CPU part where it has one:
the scripts, the parsing and the judging all run, but a CUDA claim's row says "skipped: no CUDA"
(the CPU figure beside it), never "pass"; only rows whose claim holds on any device (a FLOP count)
are judged there.
"""
from __future__ import annotations

import argparse
import bisect
import datetime
import json
import math
import os
import platform
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
LOOPS = ROOT / "scripts" / "gpu_check"
SKIPPED_NO_CUDA = "skipped: no CUDA"
DEFAULT_BUDGET_S = 450.0  # the 8 minutes on the H200, less room for start-up and the wheels


# -- thresholds ------------------------------------------------------------------------------------
@dataclass
class Threshold:
    """What a measured figure must satisfy: within a relative or absolute distance of a
    reference, at most or at least a bound. `impossible()` makes it one nothing can meet (the
    check of the check: --impossible)."""

    kind: str  # within_rel | within_abs | at_most | at_least
    bound: float
    unit: str = ""

    def holds(self, value: float, reference: float = 0.0) -> bool:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return False
        if self.kind == "within_rel":
            return reference != 0 and abs(value - reference) <= self.bound * abs(reference)
        if self.kind == "within_abs":
            return abs(value - reference) <= self.bound
        if self.kind == "at_most":
            return value <= self.bound
        return value >= self.bound

    def text(self) -> str:
        if math.isinf(self.bound) or (self.kind.startswith("within") and self.bound < 0):
            return "impossible (--impossible)"
        if self.kind == "within_rel":
            return f"within ±{self.bound:.0%}"
        if self.kind == "within_abs":
            return f"within ±{self.bound:g}{self.unit}"
        return f"{'≤' if self.kind == 'at_most' else '≥'} {self.bound:g}{self.unit}"

    def impossible(self) -> "Threshold":
        bound = {"within_rel": -1.0, "within_abs": -1.0, "at_most": -math.inf, "at_least": math.inf}[self.kind]
        return Threshold(self.kind, bound, self.unit)


IDLE_STALL_MS = 5.0  # the deliberate host stall between steps in the idle-gap row
THRESHOLDS: Dict[str, Threshold] = {
    "phase.forward": Threshold("within_rel", 0.10),
    "phase.backward": Threshold("within_rel", 0.10),
    "phase.optimizer": Threshold("within_rel", 0.10),
    "h2d.pinned": Threshold("within_rel", 0.10),
    "h2d.pageable": Threshold("within_rel", 0.10),
    "overhead.added_pct": Threshold("at_most", 0.5, " %"),
    "memory.allocated": Threshold("within_rel", 0.01),
    "memory.peak": Threshold("within_rel", 0.01),
    "memory.reserved": Threshold("within_rel", 0.01),
    "mfu.flops_per_step": Threshold("within_rel", 0.01),
    "mfu.mfu": Threshold("within_rel", 0.10),
    # The idle gap holds the stall, less a tenth for clock granularity.
    "idle.gpu_idle_ms": Threshold("at_least", 0.9 * IDLE_STALL_MS, " ms"),
    "host_sync.calls_per_step": Threshold("within_abs", 0.1),
}


# -- rows and groups -------------------------------------------------------------------------------
@dataclass
class Row:
    id: str
    claim: str
    measured: str = ""
    threshold: str = ""
    status: str = ""  # pass | fail | skipped: why
    figures: dict = field(default_factory=dict)  # the raw numbers, for gpu_check.json


class Check:
    """One run of the check: the device, the rows so far, a scratch folder and the time left."""

    def __init__(self, on_cuda: bool, workdir: Path, budget_s: float, impossible: Sequence[str]):
        self.on_cuda = on_cuda
        self.device = "cuda" if on_cuda else "cpu"
        self.device_name = ""  # torch's name for it ("NVIDIA H200"), for its peak FLOP/s
        self.workdir = workdir
        self.deadline = time.monotonic() + budget_s
        self.rows: Dict[str, Row] = {}
        self.thresholds = dict(THRESHOLDS)
        for row_id in impossible:
            self.thresholds[row_id] = self.thresholds[row_id].impossible()

    def row(self, row_id: str, claim: str) -> Row:
        return self.rows.setdefault(row_id, Row(row_id, claim))

    def judge(self, row: Row, value: float, reference: float = 0.0, cuda_only: bool = True) -> bool:
        """Decide a row against its threshold (a CUDA claim on the CPU: skipped, never pass)."""
        threshold = self.thresholds[row.id]
        row.threshold = threshold.text()
        return self.decide(row, threshold.holds(value, reference), cuda_only)

    def decide(self, row: Row, ok: bool, cuda_only: bool = True) -> bool:
        if cuda_only and not self.on_cuda:
            row.status = SKIPPED_NO_CUDA
        else:
            row.status = "pass" if ok else "fail"
        return ok

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()

    def child_env(self, run_dir: Optional[Path] = None) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
        for name in ("TRACEML_COLLECTOR", "TRACEML_RUN_DIR", "TRACEML_DEEP", "TRACEML_DEEP_EVERY"):
            env.pop(name, None)
        if run_dir is not None:  # a plain-python run's directory
            env["TRACEML_RUN_DIR"] = str(run_dir)
        return env

    def run(self, command: List[str], timeout_s: float, run_dir: Optional[Path] = None,
            cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
        """A child in its own process group (traceml run starts a collector and the script):
        on timeout the whole group is killed, and the row says so."""
        timeout_s = min(timeout_s, self.seconds_left())
        if timeout_s <= 5:
            raise RowError("not run: the check's time budget is spent")
        process = subprocess.Popen([str(part) for part in command], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=cwd or self.workdir,
                                   env=self.child_env(run_dir), start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise RowError(f"timed out after {timeout_s:.0f} s: {' '.join(map(str, command[-6:]))}")
        return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)

    def traceml_run(self, run_dir: Path, script: Path, args: Sequence, timeout_s: float,
                    traceml_args: Sequence[str] = ()) -> subprocess.CompletedProcess:
        return self.run([sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir", run_dir,
                         *traceml_args, script, *args], timeout_s)


class RowError(Exception):
    """A group could not measure: the message goes into its unfilled rows."""


@dataclass
class Group:
    name: str
    claims: Dict[str, str]  # row id -> the claim, in table order
    measure: Callable[[Check, Dict[str, Row]], None]  # fills the rows; each child it runs has its own timeout


def _require_ok(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        raise RowError(f"{what} exited {result.returncode}: {_first_error_line(result.stderr)}")


def _first_error_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return (errors[-1] if errors else (lines[-1] if lines else "no output"))[:200]


def _step_rows(run_dir: Path) -> List[dict]:
    with sqlite3.connect(f"file:{run_dir / 'telemetry.sqlite'}?mode=ro", uri=True) as db:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute("SELECT * FROM steps WHERE rank = 0 ORDER BY step")]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "final_summary.json").read_text())


def _json_line(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RowError("the loop printed no JSON line")
    return json.loads(lines[-1])


def _pct(value: float, reference: float) -> str:
    return f"{(value - reference) / reference * 100:+.1f}%" if reference else "n/a"


# -- phases against torch.profiler ----------------------------------------------------------------
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def profiler_times(trace: dict, names: Sequence[str]) -> Dict[str, dict]:
    """Per record_function range: how often it ran, its host time, and the device time of the
    work launched inside it (kernels, copies, memsets).

    Work is tied to a range by the host time of the runtime call that launched it (kernel and
    launch share a correlation id), not by the profiler's parent links: backward's kernels are
    launched from autograd's own thread, outside the range's thread, but within its time.
    kernel_ms sums the work's durations; span_ms runs from the first one's start to the last
    one's end, gaps included, per occurrence.
    """
    events = trace.get("traceEvents", [])
    ranges = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                     and e.get("name") in names), key=lambda e: e["ts"])
    starts = [e["ts"] for e in ranges]
    launched_at = {e["args"]["correlation"]: e["ts"] for e in events
                   if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    work = [[0.0, math.inf, -math.inf] for _ in ranges]  # kernel µs, first start, last end
    unattributed_us = 0.0
    for event in events:
        if event.get("cat") not in DEVICE_CATEGORIES:
            continue
        host_ts = launched_at.get(event.get("args", {}).get("correlation"))
        index = bisect.bisect_right(starts, host_ts) - 1 if host_ts is not None else -1
        if index < 0 or host_ts > ranges[index]["ts"] + ranges[index]["dur"]:
            unattributed_us += event.get("dur", 0.0)
            continue
        work[index][0] += event["dur"]
        work[index][1] = min(work[index][1], event["ts"])
        work[index][2] = max(work[index][2], event["ts"] + event["dur"])
    figures = {name: {"count": 0, "host_ms": 0.0, "kernel_ms": 0.0, "span_ms": 0.0} for name in names}
    for event, (kernel_us, first, last) in zip(ranges, work):
        figure = figures[event["name"]]
        figure["count"] += 1
        figure["host_ms"] += event["dur"] / 1e3
        figure["kernel_ms"] += kernel_us / 1e3
        figure["span_ms"] += (last - first) / 1e3 if last > first else 0.0
    figures["_unattributed_ms"] = unattributed_us / 1e3
    return figures


def _profiled_run(check: Check, name: str, pageable: bool, timeout_s: float) -> tuple:
    out, run_dir = check.workdir / f"prof-{name}", check.workdir / f"run-prof-{name}"
    sizes = ([] if check.on_cuda else  # the CPU's part: the same loop, small enough to take seconds
             ["--batch", 128, "--width", 256, "--layers", 2, "--steps", 12, "--profile-from", 4, "--profile-steps", 4])
    result = check.run([sys.executable, LOOPS / "profiled_loop.py", "--device", check.device, "--out", out,
                        *(["--pageable"] if pageable else []), *sizes], timeout_s, run_dir=run_dir)
    _require_ok(result, "profiled_loop.py")
    meta = json.loads((out / "profiled.json").read_text())
    trace = json.loads((out / "trace.json").read_text())
    profiled = profiler_times(trace, meta["ranges"])
    steps = [row for row in _step_rows(run_dir)
             if meta["first_step"] <= row["step"] < meta["first_step"] + meta["steps"]]
    if len(steps) != meta["steps"]:
        raise RowError(f"TraceML recorded {len(steps)} of the {meta['steps']} profiled steps")
    return meta, profiled, steps


def _compare_phase(check: Check, row: Row, phase: str, meta: dict, profiled: dict, steps: List[dict]) -> None:
    traceml_ms = sum(step[f"{phase}_ms"] for step in steps) / len(steps)
    figure = profiled["gpu_check." + phase]
    # On CUDA the profiler's device time of the work in the range; on the CPU (no device
    # events) the range's host time, which is what TraceML times there.
    reference_key = "kernel_ms" if check.on_cuda else "host_ms"
    per_step = {key: figure[key] / max(figure["count"], 1) for key in ("kernel_ms", "span_ms", "host_ms")}
    reference_ms = per_step[reference_key]
    timed = "device" if all(step["device_timed"] for step in steps) else "host"
    row.figures = {"traceml_ms": traceml_ms, "profiler_per_step": per_step, "occurrences": figure["count"],
                   "steps": len(steps), "traceml_timed_on": timed, "batch_bytes": meta["batch_bytes"]}
    label = "kernel" if check.on_cuda else "host range"
    row.measured = (f"TraceML {traceml_ms:.3f} ms ({timed}-timed) vs profiler {label} {reference_ms:.3f} ms "
                    f"({_pct(traceml_ms, reference_ms)}; span {per_step['span_ms']:.3f} ms), "
                    f"mean of {len(steps)} steps")
    check.judge(row, traceml_ms, reference_ms)
    # On CUDA a host-timed figure, or a profile that saw the range another number of times than
    # the steps compared, is no comparison of the same work.
    if check.on_cuda and timed != "device":
        row.status, row.measured = "fail", row.measured + "; not device-timed"
    elif check.on_cuda and figure["count"] != len(steps):
        row.status, row.measured = "fail", row.measured + f"; range ran {figure['count']} times in {len(steps)} steps"


def measure_phases(check: Check, rows: Dict[str, Row]) -> None:
    meta, profiled, steps = _profiled_run(check, "pinned", pageable=False, timeout_s=90)
    for phase in ("forward", "backward", "optimizer"):
        _compare_phase(check, rows[f"phase.{phase}"], phase, meta, profiled, steps)
    _compare_phase(check, rows["h2d.pinned"], "h2d", meta, profiled, steps)


def measure_pageable(check: Check, rows: Dict[str, Row]) -> None:
    row = rows["h2d.pageable"]
    if not check.on_cuda:  # a CPU tensor's .to("cpu") copies nothing: no CPU part
        row.status, row.measured = SKIPPED_NO_CUDA, "no host→device copy without a device"
        return
    meta, profiled, steps = _profiled_run(check, "pageable", pageable=True, timeout_s=90)
    _compare_phase(check, row, "h2d", meta, profiled, steps)


# -- overhead ------------------------------------------------------------------------------------------
def measure_overhead(check: Check, rows: Dict[str, Row]) -> None:
    row = rows["overhead.added_pct"]
    sizes = ([] if check.on_cuda else
             ["--target-ms", 3, "--blocks", 4, "--block-steps", 5, "--width", 64, "--layers", 2, "--seq", 32])
    result = check.run([sys.executable, LOOPS / "overhead_loop.py", "--device", check.device, *sizes], 150,
                       run_dir=check.workdir / "run-overhead")
    _require_ok(result, "overhead_loop.py")
    figures = _json_line(result.stdout)
    row.figures = figures
    row.measured = (f"added {figures['added_pct']:+.2f}%: traced {figures['traced_step_ms']:.3f} ms vs untraced "
                    f"{figures['untraced_step_ms']:.3f} ms a step (medians of {len(figures['traced_blocks_ms'])} "
                    f"interleaved blocks each; batch {figures['batch']}×{figures['seq']} tokens)")
    check.judge(row, figures["added_pct"])


# -- device memory -------------------------------------------------------------------------------------
def measure_memory(check: Check, rows: Dict[str, Row]) -> None:
    run_dir, facts_path = check.workdir / "run-memory", check.workdir / "memory-facts.json"
    sizes = ["--batch", 4096, "--width", 4096] if check.on_cuda else ["--batch", 64, "--width", 128]
    result = check.run([sys.executable, LOOPS / "mlp_loop.py", "--device", check.device, "--steps", 20,
                        "--facts", facts_path, *sizes], 90, run_dir=run_dir)
    _require_ok(result, "mlp_loop.py (memory)")
    facts, last = json.loads(facts_path.read_text()), _step_rows(run_dir)[-1]
    pairs = {"memory.allocated": ("device_allocated_bytes", "memory_allocated"),
             "memory.peak": ("device_peak_bytes", "max_memory_allocated"),
             "memory.reserved": ("device_reserved_bytes", "memory_reserved")}
    for row_id, (recorded_field, torch_name) in pairs.items():
        row = rows[row_id]
        recorded, truth = last.get(recorded_field, "no such field"), facts.get(torch_name)
        row.figures = {"step": last["step"], recorded_field: recorded, torch_name: truth}
        if not check.on_cuda:
            row.status = SKIPPED_NO_CUDA
            row.measured = f"CPU run: last step's {recorded_field} = {recorded} (no device memory)"
            continue
        if not isinstance(recorded, int):
            row.measured = f"{recorded_field} not recorded ({recorded!r}); torch.cuda.{torch_name}() = {truth:,}"
            row.threshold, row.status = check.thresholds[row_id].text(), "fail"
            continue
        row.measured = (f"last step's {recorded_field} {recorded:,} B vs torch.cuda.{torch_name}() {truth:,} B "
                        f"after the run ({_pct(recorded, truth)})")
        check.judge(row, recorded, truth)


# -- out of memory -------------------------------------------------------------------------------------
OOM_LAYER = "blocks.1.blow_up"  # oom_loop.py's module that asks for twice the device's memory
OOM_PHASE = "forward"
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')


def traceback_of(stderr: str) -> dict:
    """The last traceback in a process's stderr: its frames (file, line, function) and its
    final line with the figures masked (free memory differs from run to run)."""
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return {"frames": [], "exception": ""}
    frames, exception = [], ""
    for line in lines[starts[-1] + 1:]:
        match = _FRAME.match(line)
        if match:
            frames.append(f"{match['file']}:{match['line']} in {match['function']}")
        elif line and not line.startswith(" "):
            exception = line
            break
    return {"frames": frames, "exception": exception,
            "exception_masked": re.sub(r"\d+(\.\d+)?", "N", exception)}


def measure_oom(check: Check, rows: Dict[str, Row]) -> None:
    post_mortem, unchanged = rows["oom.post_mortem"], rows["oom.unchanged"]
    script, args = LOOPS / "oom_loop.py", ["--device", check.device]
    runs = {
        "python3, no TraceML": check.run([sys.executable, script, *args, "--without-traceml"], 60),
        "python3 + trace_step": check.run([sys.executable, script, *args], 60, run_dir=check.workdir / "run-oom-plain"),
        "traceml run": check.traceml_run(check.workdir / "run-oom", script, args, 90),
    }
    summary = _summary(check.workdir / "run-oom")
    evidence = summary["primary_diagnosis"]["evidence"] if summary.get("primary_diagnosis") else {}
    post_mortem.figures = {"primary": summary.get("primary_diagnosis")}
    post_mortem.measured = (f"primary {summary['primary_diagnosis']['kind'] if evidence else None}: oom="
                            f"{evidence.get('oom')}, phase={evidence.get('phase')!r}, layer={evidence.get('layer')!r}")
    post_mortem.threshold = f"oom, phase {OOM_PHASE!r}, layer {OOM_LAYER!r}"
    check.decide(post_mortem, evidence.get("oom") is True and evidence.get("phase") == OOM_PHASE
                 and evidence.get("layer") == OOM_LAYER)

    baseline_name = "python3, no TraceML"
    baseline = traceback_of(runs[baseline_name].stderr)
    differences, codes = [], {}
    for name, result in runs.items():
        codes[name] = result.returncode
        if name == baseline_name:
            continue
        seen = traceback_of(result.stderr)
        extra = [frame for frame in seen["frames"] if frame not in baseline["frames"]]
        missing = [frame for frame in baseline["frames"] if frame not in seen["frames"]]
        other_line = seen["exception_masked"] != baseline["exception_masked"]
        if extra or missing or other_line:
            differences.append(f"{name}: " + "; ".join(
                [f"+{len(extra)} frame(s) {', '.join(_short(f) for f in extra)}"] * bool(extra)
                + [f"-{len(missing)} frame(s)"] * bool(missing)
                + [f"last line {seen['exception'][:80]!r}"] * other_line))
    unchanged.figures = {"exit_codes": codes, "baseline": baseline, "differences": differences}
    same_codes = len(set(codes.values())) == 1 and codes[baseline_name] != 0
    unchanged.measured = (", ".join(f"{name} exit {code}" for name, code in codes.items())
                          + f"; baseline {len(baseline['frames'])} frames, "
                          + (f"'{baseline['exception'][:60]}…'" if baseline["exception"] else "no traceback")
                          + ("; " + " | ".join(differences) if differences else "; tracebacks identical"))
    unchanged.threshold = "same exit code, same frames, same last line (figures masked)"
    check.decide(unchanged, same_codes and not differences and bool(baseline["frames"]))


def _short(frame: str) -> str:
    path, _, rest = frame.partition(":")
    parts = Path(path).parts
    return "/".join(parts[-3:]) + ":" + rest


# -- MFU ---------------------------------------------------------------------------------------------------
def hand_counted_flops(batch: int, width: int, layers: int) -> int:
    """One step of mlp_loop.py's bias-free MLP, counted by hand as TraceML counts
    (matrix products only, 2 FLOPs a multiply-add): forward 2·B·W² a layer; backward the weight
    gradient of every layer and the input gradient of all but the first (its input needs none)."""
    per_product = 2 * batch * width * width
    return per_product * (layers + layers + (layers - 1))


def measure_mfu(check: Check, rows: Dict[str, Row]) -> None:
    flops_row, mfu_row = rows["mfu.flops_per_step"], rows["mfu.mfu"]
    batch, width, layers = (8192, 8192, 4) if check.on_cuda else (64, 128, 3)
    facts_path, run_dir = check.workdir / "mfu-facts.json", check.workdir / "run-mfu"
    result = check.traceml_run(run_dir, LOOPS / "mlp_loop.py",
                               ["--device", check.device, "--steps", 40, "--batch", batch, "--width", width,
                                "--layers", layers, "--bf16", "--rate-from", 10, "--facts", facts_path], 120,
                               traceml_args=("--deep",))
    _require_ok(result, "traceml run --deep mlp_loop.py")
    throughput, facts = _summary(run_dir)["throughput"], json.loads(facts_path.read_text())
    hand = hand_counted_flops(batch, width, layers)
    counted = throughput.get("flops_per_step")
    flops_row.figures = {"flops_per_step": counted, "hand_counted": hand, "batch": batch, "width": width,
                         "layers": layers}
    flops_row.measured = (f"TraceML {_count(counted)} FLOPs a step vs {hand:,} by hand "
                          f"(2·{batch}·{width}²·(3·{layers}−1)); {_pct(counted, hand) if counted else 'n/a'}")
    # A FLOP count is the same on any device: judged on the CPU too.
    check.judge(flops_row, counted if counted else float("nan"), hand, cuda_only=False)

    from traceml.analysis.hardware import device_peak_tflops

    # The device's dense bf16 peak from the datasheet figures TraceML keeps (the one constant
    # here): what is checked is the FLOPs and the rate TraceML puts over it.
    peak = device_peak_tflops(check.device_name) if check.on_cuda else None
    steps_per_s = facts.get("steps_per_s")
    hand_mfu = hand * steps_per_s / (peak * 1e12) if peak and steps_per_s else None
    reported = throughput.get("mfu")
    mfu_row.figures = {"mfu": reported, "hand_mfu": hand_mfu, "peak_tflops": peak, "script_steps_per_s": steps_per_s,
                       "traceml_steps_per_s": throughput.get("steps_per_s"),
                       "traceml_peak_tflops": throughput.get("device_peak_tflops")}
    mfu_row.measured = (f"TraceML MFU {_fmt_share(reported)} vs by hand {_fmt_share(hand_mfu)} "
                        f"(hand FLOPs × the script's own {steps_per_s or 0:.2f} steps/s ÷ peak "
                        f"{f'{peak:g} TFLOP/s' if peak else 'unknown'}; TraceML's rate "
                        f"{throughput.get('steps_per_s') or 0:.2f} steps/s)")
    check.judge(mfu_row, reported if reported is not None else float("nan"), hand_mfu or 0.0)


def _count(value: Optional[int]) -> str:
    return f"{value:,}" if value is not None else "no"


def _fmt_share(value: Optional[float]) -> str:
    return f"{value:.1%}" if value is not None else "none"


# -- the idle gap --------------------------------------------------------------------------------------
def measure_idle(check: Check, rows: Dict[str, Row]) -> None:
    row = rows["idle.gpu_idle_ms"]
    run_dir = check.workdir / "run-idle"
    result = check.run([sys.executable, LOOPS / "mlp_loop.py", "--device", check.device, "--steps", 40,
                        "--batch", 64, "--width", 256, "--stall-ms", IDLE_STALL_MS], 60, run_dir=run_dir)
    _require_ok(result, "mlp_loop.py (idle)")
    # After the warm-up, and not the last step (nothing follows it: no gap).
    idle = [step["gpu_idle_ms"] for step in _step_rows(run_dir)[5:-1]]
    present = [value for value in idle if value is not None]
    row.figures = {"gpu_idle_ms": idle, "stall_ms": IDLE_STALL_MS}
    if not present:
        row.measured = f"gpu_idle_ms not recorded on {len(idle)} steps"
        row.threshold = check.thresholds[row.id].text()
        check.decide(row, False)
        return
    median = statistics.median(present)
    row.measured = (f"median gpu_idle_ms {median:.2f} ms (min {min(present):.2f}, max {max(present):.2f}) "
                    f"over {len(present)} steps, host sleeping {IDLE_STALL_MS:g} ms between steps")
    check.judge(row, median)


# -- NVML on the card and on /metrics ------------------------------------------------------------------
NVML_FIELDS = {"utilisation": r"util", "memory": r"mem", "temperature": r"temp|°C|celsius",
               "power": r"power|watt|\d\s*W\b"}


def nvml_fields_in(text: str) -> List[str]:
    return [name for name, pattern in NVML_FIELDS.items() if re.search(pattern, text, re.IGNORECASE)]


def _card_gpu_text(card: str) -> str:
    """The card's System section (where the NVML figures go) and any section named for a GPU,
    from the first GPU mention on, box drawing and wrapping taken out."""
    sections: List[str] = []
    keep = False
    for line in card.splitlines():
        body = line.strip().strip("│").rstrip()
        label = body[:11].strip()  # the card's label column ("System", "Memory"), blank when wrapped
        if label:
            keep = label == "System" or "GPU" in label
        if keep:
            sections.append(body)
    flat = re.sub(r"\s+", " ", " ".join(sections))
    at = flat.find("GPU")
    return flat[at:] if at >= 0 else ""


def metrics_gpu_lines(body: str) -> List[str]:
    return [line for line in body.splitlines() if line and not line.startswith("#") and "gpu" in line.lower()]


def _nvml_now() -> dict:
    """The card's own NVML readings, taken by the check beside TraceML's."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {"utilisation_pct": pynvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                "memory_used_bytes": pynvml.nvmlDeviceGetMemoryInfo(handle).used,
                "temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0}
    finally:
        pynvml.nvmlShutdown()


def measure_nvml(check: Check, rows: Dict[str, Row]) -> None:
    card_row, metrics_row = rows["nvml.card"], rows["nvml.metrics"]
    run_dir, stderr_path = check.workdir / "run-nvml", check.workdir / "nvml-stderr.txt"
    seconds = 15 if check.on_cuda else 2  # on the CPU: long enough to scrape a live run
    sizes = ["--batch", 8192, "--width", 8192] if check.on_cuda else ["--batch", 64, "--width", 128]
    command = [sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir", run_dir,
               "--metrics-port", "0", LOOPS / "mlp_loop.py", "--device", check.device, "--steps", 1,
               "--seconds", seconds, "--bf16", *sizes]
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen([str(part) for part in command], stdout=subprocess.PIPE, stderr=stderr,
                                   text=True, cwd=check.workdir, env=check.child_env(), start_new_session=True)
    try:
        body, nvml_then = _scrape_while_training(check, process, stderr_path, seconds)
        stdout, _ = process.communicate(timeout=max(5.0, min(60.0, check.seconds_left())))
    except (subprocess.TimeoutExpired, RowError) as exc:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise RowError(str(exc) if isinstance(exc, RowError) else "traceml run with --metrics-port timed out")
    if process.returncode != 0:
        raise RowError(f"traceml run exited {process.returncode}: {_first_error_line(stderr_path.read_text())}")

    card = (run_dir / "final_summary.txt").read_text()
    gpu_text = _card_gpu_text(card)
    on_card = nvml_fields_in(gpu_text)
    card_row.figures = {"card_gpu_text": gpu_text[:400], "fields": on_card,
                        "summary_gpus": _summary(run_dir)["system"]["gpus"], "nvml_at_scrape": nvml_then}
    card_row.measured = (f"on the card: {', '.join(on_card) or 'none'} "
                         f"({gpu_text[:90]!r})" if gpu_text else "the card names no GPU")
    card_row.threshold = "utilisation, memory, temperature and power all shown"
    check.decide(card_row, set(on_card) == set(NVML_FIELDS))

    lines = metrics_gpu_lines(body)
    found = {name: [line for line in lines if re.search(pattern, line.split(" ")[0], re.IGNORECASE)]
             for name, pattern in NVML_FIELDS.items() if name != "power"}
    found["power"] = [line for line in lines if re.search(r"power|watt", line.split(" ")[0], re.IGNORECASE)]
    present = [name for name, hits in found.items() if hits]
    metrics_row.figures = {"gpu_lines": lines[:20], "samples": len(body.splitlines()), "nvml_at_scrape": nvml_then}
    off = _metrics_against_nvml(found, nvml_then) if nvml_then else []
    metrics_row.measured = (f"/metrics ({len(body.splitlines())} lines): GPU figures {', '.join(present) or 'none'}"
                            + (f"; against NVML read at the scrape: {'; '.join(off)}" if off else ""))
    metrics_row.threshold = "all four present; memory ±10%, temperature ±5 °C of NVML's own reading"
    check.decide(metrics_row, len(present) == len(NVML_FIELDS) and not any("OFF" in item for item in off))


def _scrape_while_training(check: Check, process: subprocess.Popen, stderr_path: Path, seconds: float) -> tuple:
    """Find the /metrics address in traceml's stderr, then scrape it once the run has trained a
    while (GPU samples need the sampler's first interval); NVML read right beside the scrape."""
    deadline = time.monotonic() + min(seconds + 60, check.seconds_left())
    url = None
    while url is None:
        match = re.search(r"Prometheus metrics at (http://\S+/metrics)", stderr_path.read_text())
        url = match.group(1) if match else None
        if url is None and (process.poll() is not None or time.monotonic() > deadline):
            raise RowError("traceml run never said where /metrics is: " + _first_error_line(stderr_path.read_text()))
        time.sleep(0.2)
    time.sleep(seconds * 0.5)
    body = ""
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body = response.read().decode()
        except OSError:  # not serving yet, or already closing: ask again while the run lasts
            time.sleep(0.5)
            continue
        nvml_then = _nvml_now() if check.on_cuda else {}
        if metrics_gpu_lines(body) or not check.on_cuda:
            return body, nvml_then
        time.sleep(1.0)
    if not body:
        raise RowError("the run ended before /metrics answered")
    return body, (_nvml_now() if check.on_cuda else {})


def _metrics_against_nvml(found: Dict[str, List[str]], nvml: dict) -> List[str]:
    def value(lines: List[str]) -> Optional[float]:
        try:
            return float(lines[0].rsplit(" ", 1)[1]) if lines else None
        except ValueError:
            return None

    notes = []
    used = [line for line in found["memory"] if "used" in line.lower()] or found["memory"]
    memory, temperature = value(used), value(found["temperature"])
    if memory is not None:
        ok = abs(memory - nvml["memory_used_bytes"]) <= 0.10 * nvml["memory_used_bytes"]
        notes.append(f"memory {memory:,.0f} vs {nvml['memory_used_bytes']:,} B {'ok' if ok else 'OFF'}")
    if temperature is not None:
        ok = abs(temperature - nvml["temperature_c"]) <= 5
        notes.append(f"temperature {temperature:g} vs {nvml['temperature_c']} °C {'ok' if ok else 'OFF'}")
    return notes


# -- HOST_SYNC -----------------------------------------------------------------------------------------------
SYNC_MARKER = "# HOST_SYNC_SITE"


def measure_host_sync(check: Check, rows: Dict[str, Row]) -> None:
    row = rows["host_sync.finding"]
    script = LOOPS / "host_sync_loop.py"
    line = next(number for number, text in enumerate(script.read_text().splitlines(), 1) if SYNC_MARKER in text)
    expected_site = f"{script.name}:{line}"
    sizes = [] if check.on_cuda else ["--batch", 64, "--width", 128]
    run_dir = check.workdir / "run-host-sync"
    result = check.traceml_run(run_dir, script, ["--device", check.device, *sizes], 90)
    _require_ok(result, "traceml run host_sync_loop.py")
    findings = [f for f in _summary(run_dir)["findings"] if f["kind"] == "HOST_SYNC"]
    row.threshold = f"site {expected_site}, calls_per_step {THRESHOLDS['host_sync.calls_per_step'].text()} of 1"
    if not findings:
        row.figures = {"expected_site": expected_site}
        row.measured = f"no HOST_SYNC finding (kinds: {[f['kind'] for f in _summary(run_dir)['findings']]})"
        check.decide(row, False)
        return
    evidence = findings[0].get("evidence", {})
    site, calls, wait = evidence.get("site"), evidence.get("calls_per_step"), evidence.get("wait_ms_per_step")
    row.figures = {"expected_site": expected_site, "evidence": evidence}
    row.measured = f"site {site!r}, calls_per_step {calls!r}, wait_ms_per_step {wait!r}"
    typed = isinstance(calls, float) and isinstance(wait, float)
    calls_ok = typed and check.thresholds["host_sync.calls_per_step"].holds(calls, 1.0)
    site_ok = isinstance(site, str) and (site == expected_site or site.endswith("/" + expected_site))
    check.decide(row, calls_ok and site_ok)


# -- no synchronize under sync debug mode: the cuda-marked tests ----------------------------------------
def junit_cases(xml_text: str) -> List[dict]:
    """Each test case of a junit XML file: its name, and pass, fail or skipped with the reason's
    first line."""
    cases = []
    for case in ElementTree.fromstring(xml_text).iter("testcase"):
        outcome, detail = "pass", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "skipped" if child.tag == "skipped" else "fail"
                detail = (child.get("message") or child.text or child.tag).strip().splitlines()[0][:200]
                break
        cases.append({"name": case.get("name", "?"), "outcome": outcome, "detail": detail})
    return cases


SYNC_TESTS = ROOT / "tests" / "test_cuda.py"


def claims_of_tests(source: str) -> Dict[str, str]:
    """Each test function's claim: its docstring's first line, where it has one."""
    import ast

    claims = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            doc = ast.get_docstring(node)
            claims[node.name] = doc.strip().splitlines()[0] if doc else ""
    return claims


def measure_sync_tests(check: Check, rows: Dict[str, Row]) -> None:
    junit = check.workdir / "junit.xml"
    # A per-test limit well inside the group's, so that one hung test fails alone and the junit
    # file (written at the end) still comes.
    result = check.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                        "-o", "timeout=120", str(SYNC_TESTS), f"--junitxml={junit}"], 280, cwd=ROOT)
    if not junit.exists():
        raise RowError(f"pytest exited {result.returncode} without a junit file: "
                       f"{_first_error_line(result.stdout + result.stderr)}")
    cases = junit_cases(junit.read_text())
    claims = claims_of_tests(SYNC_TESTS.read_text())
    if not cases:
        raise RowError(f"pytest collected no cuda-marked test (exit {result.returncode})")
    rows.pop("sync.tests")  # the placeholder: each test case is a row of its own
    check.rows.pop("sync.tests")
    for case in cases:
        name = case["name"]
        row = check.row(f"sync.{name}", f"test_cuda.py::{name}" + (f": {claims[name]}" if claims.get(name) else ""))
        rows[row.id] = row
        row.threshold, row.figures = "passes", case
        if case["outcome"] == "skipped":
            row.status = SKIPPED_NO_CUDA if not check.on_cuda else f"skipped: {case['detail']}"
        else:
            row.measured = case["detail"] if case["outcome"] == "fail" else "passed"
            check.decide(row, case["outcome"] == "pass")


GROUPS = [
    Group("phases", {
        "phase.forward": "forward_ms matches torch.profiler's device time for the model call, same steps",
        "phase.backward": "backward_ms matches torch.profiler's device time for backward(), same steps",
        "phase.optimizer": "optimizer_ms matches torch.profiler's device time for optimizer.step(), same steps",
        "h2d.pinned": "h2d_ms of a pinned batch matches torch.profiler's copy time",
    }, measure_phases),
    Group("pageable", {"h2d.pageable": "h2d_ms of a pageable batch matches torch.profiler's copy time"},
          measure_pageable),
    Group("overhead", {"overhead.added_pct": "tracing a ~10 ms bf16 transformer step adds at most 0.5%"},
          measure_overhead),
    Group("memory", {
        "memory.allocated": "device_allocated_bytes at step end = torch.cuda.memory_allocated()",
        "memory.peak": "device_peak_bytes of the step = torch.cuda.max_memory_allocated()",
        "memory.reserved": "device_reserved_bytes = torch.cuda.memory_reserved()",
    }, measure_memory),
    Group("oom", {
        "oom.post_mortem": "a real CUDA OOM: the post-mortem names the phase and the layer in flight",
        "oom.unchanged": "under TraceML the OOM's exit code and traceback are plain python3's",
    }, measure_oom),
    Group("mfu", {
        "mfu.flops_per_step": "deep-dive's FLOPs a step = the MLP's FLOPs counted by hand",
        "mfu.mfu": "MFU = hand-counted FLOPs × measured steps/s ÷ the device's peak",
    }, measure_mfu),
    Group("idle", {"idle.gpu_idle_ms": f"gpu_idle_ms holds a {IDLE_STALL_MS:g} ms host stall between steps"},
          measure_idle),
    Group("nvml", {
        "nvml.card": "the card shows the GPU's utilisation, memory, temperature and power (NVML)",
        "nvml.metrics": "/metrics of a live traceml run serves them too",
    }, measure_nvml),
    Group("host_sync", {"host_sync.finding": "loss.item() every step: HOST_SYNC names its line, ~1 call a step"},
          measure_host_sync),
    # Last: the other engineer's tests take what time is left.
    Group("sync", {"sync.tests": "tests/test_cuda.py (cuda-marked): no synchronize under sync debug mode"},
          measure_sync_tests),
]


# -- the table ------------------------------------------------------------------------------------------------
def environment(force_cpu: bool) -> dict:
    """The device, torch and CUDA, asked of a child so that this process holds no CUDA context."""
    probe = ("import json, platform, torch\n"
             "info = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'python': platform.python_version(),\n"
             "        'cuda_available': torch.cuda.is_available()}\n"
             "if info['cuda_available']:\n"
             "    info['device_name'] = torch.cuda.get_device_name(0)\n"
             "    info['capacity_bytes'] = torch.cuda.get_device_properties(0).total_memory\n"
             "    try:\n"
             "        import pynvml; pynvml.nvmlInit(); info['driver'] = pynvml.nvmlSystemGetDriverVersion()\n"
             "    except Exception:\n"
             "        pass\n"
             "print(json.dumps(info))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    info = json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else {
        "torch": None, "cuda": None, "cuda_available": False, "error": _first_error_line(result.stderr)}
    info["on_cuda"] = bool(info.get("cuda_available")) and not force_cpu
    info["host"] = platform.node()
    info["commit"] = _commit()
    return info


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, cwd=ROOT, timeout=10)
        if head.returncode == 0:
            return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown (no git here)"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(info: dict, rows: List[Row], started: float, finished: bool) -> str:
    counts = {kind: sum(1 for row in rows if row.status.startswith(kind)) for kind in ("pass", "fail", "skipped")}
    device = (f"{info.get('device_name')} ({info.get('capacity_bytes', 0) / 2 ** 30:.0f} GiB), driver "
              f"{info.get('driver', '?')}" if info.get("cuda_available") else "no CUDA device")
    mode = ("CUDA" if info["on_cuda"] else
            "dry run on the CPU: CUDA claims are 'skipped: no CUDA', their figures are the CPU run's")
    lines = [
        "# TraceML GPU check", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- device: {device}",
        f"- torch {info.get('torch')}, CUDA {info.get('cuda')}, Python {info.get('python')}, host {info.get('host')}",
        f"- commit: {info.get('commit')}",
        f"- mode: {mode}",
        f"- result: {counts['pass']} pass, {counts['fail']} fail, {counts['skipped']} skipped; "
        f"{time.monotonic() - started:.0f} s" + ("" if finished else " (still running: partial table)"),
        "", "| row | claim | measured | threshold | result |", "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row.id} | {_cell(row.claim)} | {_cell(row.measured)} | {_cell(row.threshold)} | "
                     f"{_cell(row.status or 'not run')} |")
    return "\n".join(lines) + "\n"


def write(path: Path, info: dict, rows: List[Row], started: float, finished: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(info, rows, started, finished))
    details = {"environment": info, "rows": [asdict(row) for row in rows]}
    path.with_suffix(".json").write_text(json.dumps(details, indent=1, default=str))


def default_out() -> Path:
    return Path(os.environ["OUT"]) / "gpu_check.md" if os.environ.get("OUT") else Path("gpu_check.md")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="the table's file (default $OUT/gpu_check.md, "
                        "else ./gpu_check.md); the raw figures go beside it as .json")
    parser.add_argument("--dry-run", action="store_true", help="the CPU parts only, even where CUDA is present")
    parser.add_argument("--only", nargs="+", choices=[group.name for group in GROUPS], help="run these groups")
    parser.add_argument("--impossible", nargs="+", default=[], choices=sorted(THRESHOLDS),
                        help="make these rows' thresholds impossible to meet (shows a failing row fails the check)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time for all the groups")
    args = parser.parse_args(argv)

    started = time.monotonic()
    out = args.out or default_out()
    info = environment(force_cpu=args.dry_run)
    groups = [group for group in GROUPS if not args.only or group.name in args.only]
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        check = Check(info["on_cuda"], Path(workdir), args.budget_s, args.impossible)
        check.device_name = info.get("device_name", "") if info["on_cuda"] else ""
        for group in groups:
            rows = {row_id: check.row(row_id, claim) for row_id, claim in group.claims.items()}
            group_started = time.monotonic()
            try:
                group.measure(check, rows)
            except Exception as exc:  # one group's failure never loses the table
                reason = str(exc) if isinstance(exc, RowError) else f"{type(exc).__name__}: {exc}"
                for row in rows.values():
                    if not row.status:
                        row.status, row.measured = "fail", (row.measured + "; " if row.measured else "") + reason[:300]
            for row in rows.values():
                row.figures.setdefault("group_seconds", round(time.monotonic() - group_started, 1))
            ordered = list(check.rows.values())
            write(out, info, ordered, started, finished=False)
            print(f"[{time.monotonic() - started:5.0f} s] {group.name}: "
                  + ", ".join(f"{row.id} {row.status}" for row in rows.values()), flush=True)
    ordered = list(check.rows.values())
    write(out, info, ordered, started, finished=True)
    print()
    print(render(info, ordered, started, finished=True))
    print(f"written to {out} (figures in {out.with_suffix('.json')})")
    return 1 if any(row.status == "fail" or not row.status for row in ordered) else 0


if __name__ == "__main__":
    sys.exit(main())
