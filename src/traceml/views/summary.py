"""The end-of-run summary: final_summary.json (its schema in the README) and the card printed from it."""
from __future__ import annotations

import io
import os
import statistics
import time
from typing import Any, Dict, List, Optional

import msgspec

from traceml import rundir
from traceml.analysis.goodput import RunTime, goodput_text
from traceml.analysis.rollup import (Window, max_present, rank_medians, rank_spread,
                                      roll_up, warmup_steps)
from traceml.collector.store import Store
from traceml.diagnose import MemoryLimits, Stalls, diagnose
from traceml.diagnose.captures import grown_layers
from traceml.diagnose.run_time import compile_summary
from traceml.records import (ALL_PHASES, STEP_PHASES, Finding, LayerCapture, LayerReport, RankEnd, RankHello,
                             RolledStep, SystemSample)

SCHEMA_VERSION = 1
RANK_SAMPLE_STEPS = 10_000  # beyond this many steps, per-rank figures read every k-th step
CARD_WIDTH = 100
LOW_COVERAGE = 0.6  # leaf modules holding less of the model's time than this: the card says why


class RunFacts(msgspec.Struct):
    """What the launcher (or, without one, rank 0's hello and goodbye) knows about the run."""

    script: str
    argv: List[str]
    exit_code: Optional[int]
    started_at_unix_s: float
    ended_at_unix_s: float

    @classmethod
    def from_store(cls, store: Store, script: Optional[str] = None,
                   ended_at_unix_s: Optional[float] = None) -> "RunFacts":
        """With no launcher to ask: rank 0's hello (its argv, its start) and goodbye (its exit code)."""
        hellos, ends = store.hellos(), store.ends()
        rank0 = next((h for h in hellos if h.rank == 0), hellos[0] if hellos else None)
        end0 = next((e for e in ends if e.rank == 0), None)
        argv = rank0.argv if rank0 is not None else [script or "python"]
        return cls(script=os.path.basename(argv[0]) if argv else (script or ""), argv=argv,
                   exit_code=end0.exit_code if end0 is not None else None,
                   started_at_unix_s=rank0.started_at_unix_s if rank0 is not None else time.time(),
                   ended_at_unix_s=ended_at_unix_s or time.time())


class RunData:
    """Everything the summary and the report read, taken from the store and rolled up once."""

    def __init__(self, store: Store):
        meta = store.meta()
        # The collector rolled each step up as it completed and kept it in the store; a store
        # without them (an older run, a collector that died) is rolled up here.
        self.rank_sample_every = 1
        if meta.get("rolled_complete"):
            self.rolled: List[RolledStep] = store.rolled_steps()
            # Per-rank figures read every record of a run up to RANK_SAMPLE_STEPS steps, and
            # every k-th step of a longer one (medians need no million records).
            self.rank_sample_every = max(1, len(self.rolled) // RANK_SAMPLE_STEPS)
            self.records = (store.steps() if self.rank_sample_every == 1 else
                            store.steps_every(self.rank_sample_every))
        else:
            self.records = store.steps()
            self.rolled = roll_up(self.records)
        self.warmup = warmup_steps(len(self.rolled))
        self.window = Window(self.rolled[self.warmup:])
        self.hellos: List[RankHello] = store.hellos()
        self.ends: List[RankEnd] = store.ends()
        self.samples: List[SystemSample] = store.system_samples()
        self.ranks = rank_medians(self.records, skip_steps=self.warmup)
        if self.rank_sample_every > 1:
            self._exact_rank_counts(store)
        self.ooms = store.ooms()
        self.compiles = store.compiles()
        self.run_time = self._run_time(store, meta)
        self.goodput = self.run_time.goodput(now_unix_s=None)
        self.lost_ranks: List[int] = meta.get("lost_ranks", [])
        reports = store.layer_reports()
        self.layer_report = reports[0] if reports else None  # rank 0's, or the first rank's
        self.layers = layer_rows(self.layer_report)
        self.limits = MemoryLimits.of_run(self.hellos, self.samples[-1] if self.samples else None)
        self.found_by = _steps_found_by(self)
        self.stalls = Stalls(self.window, self.samples)
        self.captures: List[LayerCapture] = store.captures()
        self.findings: List[Finding] = diagnose(
            self.window, steps_seen=len(self.rolled), ranks=self.ranks if len(self.ranks) > 1 else None,
            limits=self.limits, peak_device_bytes=max_present(s.device_peak_bytes for s in self.rolled),
            peak_rss_bytes=max_present(s.host_rss_bytes for s in self.rolled),
            oom=self.ooms[0] if self.ooms else None, layers_alive=self._layers_alive(),
            steps_found_by=self.found_by, system=self.samples, stalls=self.stalls,
            captures=self.captures, goodput=self.goodput, compiles=self.compiles)

    def _exact_rank_counts(self, store: Store) -> None:
        """Sampled records give the medians; each rank's step count and last step (which say
        whether it went missing) come exactly from the store's (rank, step) key."""
        rows = {row["rank"]: row for row in self.ranks}
        for hello in self.hellos:
            last = store.step_bounds("steps", hello.rank)[1]
            if last is None:
                continue
            row = rows.get(hello.rank)
            if row is None:  # all its records fell between the sampled steps
                row = rows[hello.rank] = {"rank": hello.rank, "step_median_ms": None, "behind_share": 0.0,
                                          **{f"{name}_median_ms": None
                                             for name in STEP_PHASES + ("gc", "comm_wait")}}
            row["last_step"] = last
            row["steps"] = store.step_count(hello.rank, since_step=self.warmup)
        self.ranks = [rows[rank] for rank in sorted(rows)]

    def _run_time(self, store: Store, meta: Dict[str, Any]) -> RunTime:
        """Every rank's wall-time tally: the collector's, kept at the run's end, or (a run whose
        collector did not finish) tallied again from every step record, read once."""
        if meta.get("run_time") is not None:
            return RunTime.from_builtins(meta["run_time"])
        steps = self.records if self.rank_sample_every == 1 else store.steps()
        return RunTime.of([*self.hellos, *steps, *self.compiles, *self.ends])

    def _layers_alive(self) -> List[Dict[str, Any]]:
        rows = [row for row in self.layers if row["leaf"] and row["alive_bytes"]]
        return [{"name": row["name"], "alive_bytes": row["alive_bytes"]}
                for row in sorted(rows, key=lambda row: -row["alive_bytes"])]


def deep_dive_facts(report: LayerReport) -> Dict[str, Any]:
    """How the per-layer figures were sampled and how much of the model's time its leaf modules
    hold, with the words for a low coverage."""
    note = None
    if min(report.forward_coverage, report.backward_coverage) < LOW_COVERAGE:
        note = (f"leaf modules hold {report.forward_coverage:.0%} of forward and "
                f"{report.backward_coverage:.0%} of backward: the rest runs in the model's own code "
                "between them (functional calls such as F.scaled_dot_product_attention, residual "
                "adds, reshapes) and counts in the parent modules' rows")
    return {"sampled_steps": report.sampled_steps, "every_n_steps": report.every_n_steps,
            "forward_coverage": report.forward_coverage, "backward_coverage": report.backward_coverage,
            "coverage_note": note}


def device_names(hellos: List[RankHello]) -> List[str]:
    """The run's devices as the card names them: "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)"."""
    return sorted({h.device_name if h.device == "cpu" else f"{h.device} ({h.device_name})"
                   for h in hellos})


def layer_rows(report: Optional[LayerReport]) -> List[Dict[str, Any]]:
    """Deep-dive figures per step (the sums over sampled steps, divided by their count)."""
    if report is None:
        return []
    per_step = 1.0 / report.sampled_steps
    rows = [{"name": layer.name, "type": layer.kind, "leaf": layer.leaf,
             "calls_per_step": layer.calls * per_step, "forward_ms": layer.forward_ms * per_step,
             "backward_ms": layer.backward_ms * per_step,
             "memory_bytes": round(layer.saved_bytes * per_step),
             "output_bytes": round(layer.output_bytes * per_step),
             "allocated_delta_bytes": (round(layer.allocated_delta_bytes * per_step)
                                       if layer.allocated_delta_bytes is not None else None),
             "alive_bytes": layer.alive_bytes} for layer in report.layers]
    return sorted(rows, key=lambda row: -(row["forward_ms"] + row["backward_ms"]))


def build_summary(data: RunData, facts: RunFacts) -> Dict[str, Any]:
    window = data.window
    phases: Dict[str, Any] = {name: msgspec.to_builtins(stats) for name, stats in window.phases.items()}
    phases["step"] = {"median_ms": window.step_median_ms, "mean_ms": window.step_mean_ms,
                      "p90_ms": window.step_p90_ms, "share": 1.0 if len(window) else 0.0}
    world_size = max([h.world_size for h in data.hellos] + [len({r.rank for r in data.records}), 1])
    findings = [msgspec.to_builtins(f) for f in data.findings]
    return _rounded({
        "schema_version": SCHEMA_VERSION,
        "run": {
            "script": facts.script,
            "argv": facts.argv,
            "exit_code": facts.exit_code,
            "started_at": rundir.iso_time(facts.started_at_unix_s),
            "duration_s": round(facts.ended_at_unix_s - facts.started_at_unix_s, 3),
            "world_size": world_size,
            "devices": device_names(data.hellos),
            "torch_version": data.hellos[0].torch_version if data.hellos else None,
        },
        "steps": {
            "count": len(data.rolled),
            "warmup_excluded": data.warmup,
            "measured": len(window),
            "records_dropped": sum(end.records_dropped for end in data.ends),
            "device_timed": any(s.device_timed for s in window.steps),
            "found_by": data.found_by,
            # Slow steps early in the run that never came back (allocator, optimizer state,
            # caches warming up): noted here, never a finding.
            "warmup_transients": data.stalls.warmup_note(),
            "rank_figures_every_n_steps": data.rank_sample_every,
        },
        "phases": phases,
        "throughput": {
            "steps_per_s": window.steps_per_s,
            "samples_per_s": window.samples_per_s,
            # The global batch: samples a step, summed over ranks (the median step's).
            "samples_per_step": statistics.median(s.samples for s in window.steps) if len(window) else None,
            "tokens_per_s": window.tokens_per_s,  # real tokens (attention_mask), summed over ranks
            "padding_share": window.padding_share,
            **_model_flops(data),
        },
        "goodput": data.goodput.parts if data.goodput is not None else None,
        "startup": data.goodput.startup if data.goodput is not None else None,
        "compile": compile_summary(data.compiles, after_step=data.warmup),
        "memory": _memory(data),
        "system": _system(data.samples),
        "ranks": data.ranks,
        "rank_spread": rank_spread(data.records, skip_steps=data.warmup),
        "missing_ranks": _missing_ranks(data),
        "layers": data.layers,
        "deep_dive": deep_dive_facts(data.layer_report) if data.layer_report is not None else None,
        "captures": [{"rank": c.rank, "step": c.step, "reason": c.reason, "detail": c.detail,
                      "layers": grown_layers(c)[:10]} for c in data.captures],
        "primary_diagnosis": findings[0] if findings else None,
        "findings": findings,
    })


def flat_summary(records: List[Any]) -> Dict[str, Any]:
    """One rank's figures so far as a flat dict (traceml.summary()), for W&B or MLflow: the
    same rollup, warm-up and rules as the card, over the records this process sent."""
    rolled = roll_up(records)
    window = Window(rolled[warmup_steps(len(rolled)):])
    findings = diagnose(window, steps_seen=len(rolled),
                        peak_device_bytes=max_present(s.device_peak_bytes for s in rolled),
                        peak_rss_bytes=max_present(s.host_rss_bytes for s in rolled)) if rolled else []
    flat: Dict[str, Any] = {
        "traceml/steps": len(rolled),
        "traceml/step/median_ms": window.step_median_ms,
        "traceml/step/p90_ms": window.step_p90_ms,
        "traceml/step/mean_ms": window.step_mean_ms,
        "traceml/throughput/steps_per_s": window.steps_per_s,
        "traceml/throughput/samples_per_s": window.samples_per_s,
        "traceml/throughput/tokens_per_s": window.tokens_per_s,
        "traceml/throughput/padding_share": window.padding_share,
        "traceml/memory/device_peak_bytes": max_present(s.device_peak_bytes for s in rolled),
        "traceml/memory/host_rss_peak_bytes": max_present(s.host_rss_bytes for s in rolled),
        "traceml/diagnosis/primary": findings[0].kind if findings else None,
        "traceml/diagnosis/severity": findings[0].severity if findings else None,
    }
    for name, stats in window.phases.items():
        flat[f"traceml/phase/{name}/share"] = stats.share
        flat[f"traceml/phase/{name}/median_ms"] = stats.median_ms
        flat[f"traceml/phase/{name}/mean_ms"] = stats.mean_ms
    for finding in findings:
        flat[f"traceml/finding/{finding.kind}"] = finding.severity
    return flat


# Dense bf16/fp16 tensor-core peaks, TFLOP/s, by a part of the device name (first match wins).
PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0),
               ("L40S", 362.0), ("L4", 121.0), ("V100", 125.0), ("T4", 65.0))


def device_peak_tflops(device_name: str) -> Optional[float]:
    return next((peak for part, peak in PEAK_TFLOPS if part in device_name), None)


def _model_flops(data: RunData) -> Dict[str, Any]:
    """Under deep-dive: FLOPs of a step (rank 0's, counted once), what the device achieves, and
    MFU where the device's peak is known (not for CPUs)."""
    report = data.layer_report
    flops = report.flops_per_step if report is not None else None
    if not flops:
        return {"flops_per_step": None, "achieved_tflops": None, "mfu": None}
    achieved = flops * data.window.steps_per_s / 1e12
    names = [h.device_name for h in data.hellos if h.device != "cpu"]
    peak = device_peak_tflops(names[0]) if names else None
    return {"flops_per_step": flops, "achieved_tflops": achieved,
            "mfu": achieved / peak if peak else None, "device_peak_tflops": peak}


def _steps_found_by(data: RunData) -> Optional[str]:
    """How rank 0 found its steps: its goodbye knows best (an explicit trace_step may have
    replaced inference late); a rank that died only said so in its hello."""
    for records in (data.ends, data.hellos):
        said = [r.steps_from for r in sorted(records, key=lambda r: r.rank) if r.steps_from]
        if said:
            return said[0]
    return None


def _rounded(value: Any) -> Any:
    """Floats to 4 decimals (0.1 µs in ms), so the JSON reads as figures, not noise."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def _missing_ranks(data: RunData) -> List[Dict[str, int]]:
    """Ranks that stopped reporting before the others and never said goodbye (died, killed),
    or that the run's world size promised and never reported at all."""
    world_size = max([h.world_size for h in data.hellos] + [1])
    if world_size < 2 or not data.ranks:
        return []
    said_goodbye = {end.rank for end in data.ends}
    last_step = {rank: -1 for rank in range(world_size)}  # -1: no step from that rank
    last_step.update({row["rank"]: row["last_step"] for row in data.ranks})
    last = max(last_step.values())
    # Lost: its connection dropped without a goodbye while others were still connected (the
    # collector saw it go first; the survivors a launcher then stops are not the cause).
    # Without that record: no goodbye and fewer steps than the others sent.
    lost = set(data.lost_ranks)
    return [{"rank": rank, "from_step": step + 1} for rank, step in sorted(last_step.items())
            if rank not in said_goodbye and (rank in lost if lost else step < last)]


def _memory(data: RunData) -> Dict[str, Any]:
    trend = data.window.memory_trend
    return {
        "device_peak_bytes": max_present(s.device_peak_bytes for s in data.rolled),
        "device_capacity_bytes": data.limits.device_capacity_bytes,
        "host_rss_peak_bytes": max_present(s.host_rss_bytes for s in data.rolled),
        "creep_bytes_per_step": round(trend.bytes_per_step, 1),
        "creep_measured_on": trend.measured_on,
    }


def _system(samples: List[SystemSample]) -> Dict[str, Any]:
    if not samples:
        return {"samples": 0}

    def avg_peak(values: List[float]) -> Dict[str, float]:
        return {"avg": round(statistics.fmean(values), 2), "peak": round(max(values), 2)}

    system: Dict[str, Any] = {
        "samples": len(samples),
        "cpu_percent": avg_peak([s.cpu_percent for s in samples]),
        "training_cpu_percent": avg_peak([s.training_cpu_percent for s in samples]),
        "ram_used_bytes": avg_peak([float(s.ram_used_bytes) for s in samples]),
        "ram_total_bytes": samples[-1].ram_total_bytes,
        "training_rss_bytes": avg_peak([float(s.training_rss_bytes) for s in samples]),
        "gpus": [],
    }
    by_gpu: Dict[int, list] = {}
    for sample in samples:
        for gpu in sample.gpus:
            by_gpu.setdefault(gpu.index, []).append(gpu)
    for index, readings in sorted(by_gpu.items()):
        system["gpus"].append({
            "index": index,
            "utilization_percent": avg_peak([g.utilization_percent for g in readings]),
            "memory_used_bytes": avg_peak([float(g.memory_used_bytes) for g in readings]),
            "memory_total_bytes": readings[-1].memory_total_bytes,
        })
    return system




# -- the card ---------------------------------------------------------------------------------
PHASE_LABELS = {"input_wait": "input wait", "outside": "outside step", "h2d": "host→device",
                "forward": "forward", "backward": "backward", "optimizer": "optimizer",
                "untraced": "untraced (in step)", "gc": "gc (overlaps)"}
SEVERITY_STYLE = {"crit": "bold white on red", "warn": "bold black on yellow", "info": "bold white on blue"}


def render_card(summary: Dict[str, Any], width: int = CARD_WIDTH) -> Any:
    """The card as a rich renderable, `width` columns wide (CARD_WIDTH at most)."""
    from rich import box
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.markup import escape
    from rich.text import Text

    run, steps, phases = summary["run"], summary["steps"], summary["phases"]
    throughput, system, memory = summary["throughput"], summary["system"], summary["memory"]

    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold", no_wrap=True)
    facts.add_column()
    exit_note = "" if run["exit_code"] in (0, None) else f"  [bold red]exit code {run['exit_code']}[/]"
    facts.add_row("Run", f"{escape(run['script'])}  ·  {run['duration_s']:.1f} s  ·  world size "
                         f"{run['world_size']}  ·  {', '.join(run['devices']) or 'cpu'}{exit_note}")
    samples_per_s = throughput["samples_per_s"]
    found_by = f", found by {steps['found_by']}" if steps.get("found_by") else ""
    if steps["count"]:
        facts.add_row("Steps", f"{steps['count']} ({steps['warmup_excluded']} warm-up excluded{found_by})  ·  "
                               f"{throughput['steps_per_s']:.2f} steps/s  ·  "
                               + (f"{samples_per_s:,.1f} samples/s" if samples_per_s else "samples/s n/a")
                               + _tokens_text(throughput) + _flops_text(throughput))
        step = phases["step"]
        facts.add_row("Step time", f"median {step['median_ms']:.1f} ms  ·  p90 {step['p90_ms']:.1f} ms")
    else:  # nothing to break down: the verdict below says why and what to add
        facts.add_row("Steps", "none found")
    goodput = summary.get("goodput")
    if goodput:
        facts.add_row("Goodput", goodput_text(goodput))
    if summary.get("compile"):
        facts.add_row("Compile", _compile_line(summary["compile"]))
    facts.add_row("System", _system_line(system))
    if steps["count"]:
        facts.add_row("Memory", _memory_line(memory))
    for missing in summary["missing_ranks"]:
        facts.add_row("Missing", f"[bold red]rank {missing['rank']} from step {missing['from_step']}[/]"
                                 " (stopped reporting without a goodbye: died or killed)")
    if steps["records_dropped"]:
        facts.add_row("Dropped", f"[yellow]{steps['records_dropped']} records dropped (buffer full "
                                 f"or collector unreachable)[/]")

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), expand=False)
    table.add_column("phase", no_wrap=True)
    table.add_column("median ms", justify="right", no_wrap=True)
    table.add_column("mean ms", justify="right", no_wrap=True)
    table.add_column("% of step", justify="right", no_wrap=True)
    table.add_column("", no_wrap=True, overflow="crop")
    for name in ALL_PHASES:
        stats = phases[name]
        bar = "█" * int(round(stats["share"] * 40)) if name in STEP_PHASES else ""
        table.add_row(PHASE_LABELS[name], f"{stats['median_ms']:.2f}", f"{stats['mean_ms']:.2f}",
                      f"{stats['share']:.1%}", Text(bar, style="cyan"))

    parts = [facts, table] if steps["count"] else [facts]
    if run["world_size"] > 1 and summary["rank_spread"]:
        parts.append(_rank_table(summary))
    if summary["layers"]:
        parts.extend(_layer_tables(summary))

    verdict = Table.grid(padding=(0, 2))
    verdict.add_column(style="bold", no_wrap=True)
    verdict.add_column()
    primary = summary["primary_diagnosis"]
    if primary:
        badge = Text(f" {primary['kind'].replace('_', ' ')} ", style=SEVERITY_STYLE[primary["severity"]])
        verdict.add_row("Verdict", badge)
        # Text, not markup: findings carry brackets and paths that rich must not interpret.
        verdict.add_row("Why", Text(primary["summary"]))
        verdict.add_row("Next", Text(primary["action"]))
        _captured_row(verdict, primary)
        for other in summary["findings"][1:]:
            verdict.add_row("Also", Text.assemble((f"{other['kind']} ({other['severity']})",
                                                   "bold"), f": {other['summary']}"))
            _captured_row(verdict, other)

    parts.append(verdict)
    return Panel(Group(*parts), title=f"[bold]TraceML[/] · {escape(run['script'])}",
                 title_align="left", width=min(width, CARD_WIDTH), box=box.ROUNDED)


def _captured_row(verdict: Any, finding: Dict[str, Any]) -> None:
    """The layers an automatic capture found grown, right under the finding it belongs to."""
    from rich.text import Text

    captured = (finding.get("evidence") or {}).get("captured_layers")
    if captured:
        verdict.add_row("Captured", Text(captured))


def _rank_table(summary: Dict[str, Any]) -> Any:
    """Across ranks, per phase: the typical median, the typical worst, which rank, the skew."""
    from rich import box
    from rich.table import Table

    straggler = next((f["rank"] for f in summary["findings"] if f["kind"].endswith("STRAGGLER")), None)
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), title="across ranks", title_justify="left")
    for header in ("phase", "median ms", "worst ms", "worst rank", "skew ms"):
        table.add_column(header, justify="left" if header == "phase" else "right", no_wrap=True)
    labels = {"step": "step", "comm_wait": "comm wait (in backward)", **PHASE_LABELS}
    for name, spread in summary["rank_spread"].items():
        if name not in labels or (name != "step" and spread["worst"] <= 0.0):
            continue
        rank = spread["worst_rank"]
        table.add_row(labels[name], f"{spread['median']:.2f}", f"{spread['worst']:.2f}",
                      f"[bold red]{rank}[/]" if rank == straggler else str(rank), f"{spread['skew']:.2f}")
    return table


def _layer_tables(summary: Dict[str, Any]) -> List[Any]:
    """Deep-dive: the top 5 leaf modules by time, and by memory saved for backward."""
    from rich import box
    from rich.table import Table

    deep = summary["deep_dive"]
    leaves = [row for row in summary["layers"] if row["leaf"]]
    title = (f"layers (deep-dive every {deep['every_n_steps']} steps, {deep['sampled_steps']} sampled;"
             f" leaves cover {deep['forward_coverage']:.0%} of forward, "
             f"{deep['backward_coverage']:.0%} of backward)")
    tables = []
    for heading, key in (("top by time", lambda r: -(r["forward_ms"] + r["backward_ms"])),
                         ("top by memory", lambda r: -r["memory_bytes"])):
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), title=title if not tables else None,
                      title_justify="left")
        table.add_column(heading, no_wrap=True, max_width=40, overflow="ellipsis")
        for header in ("calls", "fwd ms", "bwd ms", "saved MiB", "output MiB"):
            table.add_column(header, justify="right", no_wrap=True)
        for row in sorted(leaves, key=key)[:5]:
            table.add_row(f"{row['name']} ({row['type']})", f"{row['calls_per_step']:.0f}",
                          f"{row['forward_ms']:.2f}", f"{row['backward_ms']:.2f}",
                          f"{row['memory_bytes'] / 2 ** 20:.2f}", f"{row['output_bytes'] / 2 ** 20:.2f}")
        tables.append(table)
    if deep.get("coverage_note"):
        from rich.text import Text

        tables.append(Text(f"Coverage: {deep['coverage_note']}."))
    return tables


def _tokens_text(throughput: Dict[str, Any]) -> str:
    tokens_per_s = throughput.get("tokens_per_s")
    if not tokens_per_s:
        return ""
    padding = throughput.get("padding_share")
    return f"  ·  {tokens_per_s:,.0f} tokens/s" + (f" ({padding:.0%} padding)" if padding is not None else "")


def _flops_text(throughput: Dict[str, Any]) -> str:
    # From the exact counts: the summary's achieved_tflops is rounded, and a small model on a
    # busy CPU does less than the 0.00005 TFLOP/s that survive the rounding.
    flops, steps_per_s = throughput.get("flops_per_step"), throughput.get("steps_per_s")
    if not flops or not steps_per_s:
        return ""
    mfu = throughput.get("mfu")
    return (f"  ·  {flops * steps_per_s / 1e9:,.2f} GFLOP/s"
            + (f", MFU {mfu:.1%}" if mfu is not None else " (device peak unknown: no MFU)"))


def _compile_line(compiled: Dict[str, Any]) -> str:
    """torch.compile's work: "1 compilation, 7 recompilations (0.9 s) · 1.7 s in all · 1 graph break"."""
    def counted(count: int, what: str) -> str:
        return f"{count} {what}{'s' if count != 1 else ''}"

    line = f"{counted(compiled['compilations'], 'compilation')}, {counted(compiled['recompilations'], 'recompilation')}"
    if compiled["recompilations"]:
        line += f" ({compiled['recompile_s']:.1f} s)"
    line += f"  ·  {compiled['compile_s']:.1f} s compiling in all"
    if compiled["graph_breaks"]:
        # Each break splits the graph: the code around it runs as Python between the pieces.
        line += (f"  ·  {counted(compiled['graph_breaks'], 'graph break')}: "
                 + "; ".join(compiled["graph_break_reasons"][:3]))
    return line


def _system_line(system: Dict[str, Any]) -> str:
    if not system.get("samples"):
        return "no samples (run shorter than the sampling interval)"
    gib = 1024 ** 3
    line = (f"CPU avg {system['cpu_percent']['avg']:.0f}% peak {system['cpu_percent']['peak']:.0f}%  ·  "
            f"RAM avg {system['ram_used_bytes']['avg'] / gib:.1f} peak "
            f"{system['ram_used_bytes']['peak'] / gib:.1f} of {system['ram_total_bytes'] / gib:.1f} GiB")
    for gpu in system["gpus"]:
        line += (f"  ·  GPU{gpu['index']} util avg {gpu['utilization_percent']['avg']:.0f}% "
                 f"mem peak {gpu['memory_used_bytes']['peak'] / gib:.1f} GiB")
    return line


def _memory_line(memory: Dict[str, Any]) -> str:
    gib, mib = 1024 ** 3, 1024 ** 2
    parts = []
    if memory["device_peak_bytes"] is not None:
        capacity = memory["device_capacity_bytes"]
        parts.append(f"device peak {memory['device_peak_bytes'] / gib:.2f} GiB"
                     + (f" of {capacity / gib:.1f} GiB" if capacity else ""))
    if memory["host_rss_peak_bytes"] is not None:
        parts.append(f"host RSS peak {memory['host_rss_peak_bytes'] / mib:,.0f} MiB")
    parts.append(f"trend {memory['creep_bytes_per_step'] / 1024:+,.1f} KiB/step")
    return "  ·  ".join(parts)


def card_text(summary: Dict[str, Any]) -> str:
    """The card as plain text, as saved in final_summary.txt."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=CARD_WIDTH, color_system=None, record=True)
    console.print(render_card(summary))
    return console.export_text()


def prepare_card() -> None:
    """Load what printing the card needs (rich's modules, its unicode width table) ahead of
    time: the launcher does this while the script runs, so the card follows the script's end
    by the time it takes to render (about 5 ms, not 25)."""
    import io

    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    Console(file=io.StringIO(), width=CARD_WIDTH).print(Panel(Table("warm-up")))


def print_card(summary: Dict[str, Any], file: Any = None) -> None:
    from rich.console import Console

    console = Console(file=file, highlight=False)
    if not console.is_terminal:  # a pipe or a log file has no width: use the card's own
        console = Console(file=file, highlight=False, width=CARD_WIDTH)
    console.print(render_card(summary, width=console.width))
