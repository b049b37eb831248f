"""What every view shows alike (the phases' names, colours and order; the straggler's rank) and
the end-of-run card, printed from the summary report/summary.py builds."""
from __future__ import annotations

import io
import re
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

from traceml.analysis.goodput import PARTS, PartTime
from traceml.analysis.ledger import Adapters, DeviceMesh, LedgerParameters, LedgerRow, Sharding
from traceml.analysis.rollup import RankRow, comm_wait_parts
from traceml.diagnose.hangs import PULSED_STATES, signal_name
from traceml.diagnose.run_time import CompileSummary
from traceml.diagnose.stragglers import straggler_rank
from traceml.diagnose.untimed import code_lines
from traceml.records import ALL_PHASES, OVERLAPPING_PHASES, STEP_PHASES, FindingKind, Severity
from traceml.report.summary import FinalSummary, FindingDict, MemoryPart, SpanFigures, SystemPart, Throughput
from traceml.words import counted, every, size

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

CARD_WIDTH = 100


# -- what every view shows alike: the card, the report, the terminal, the web page, compare ----
# Each phase's name on screen, in the order the views list them; the whole step, and the time a
# rank waits for the others inside backward, are named beside the phases. And each one's colour.
PHASE_LABELS = {"step": "step", "input_wait": "input wait", "outside": "outside step", "h2d": "host→device",
                "forward": "forward", "backward": "backward", "optimizer": "optimizer",
                "untraced": "untraced (in step)", "gc": "gc (overlaps)", "comm_wait": "comm wait"}
PHASE_COLOURS = {"input_wait": "#e45756", "outside": "#9d9da1", "h2d": "#f58518", "forward": "#4c78a8",
                 "backward": "#72b7b2", "optimizer": "#54a24b", "untraced": "#b279a2", "gc": "#eeca3b",
                 "comm_wait": "#ff9da6"}
# Each severity's colour on a page (the web page's and report.html's), and its style on a terminal.
SEVERITY_COLOURS: Dict[str, str] = {Severity.CRIT: "#d62728", Severity.WARN: "#d98c00", Severity.INFO: "#3b73b9"}


def phase_display() -> Dict[str, object]:
    """The phases' names, colours and order for the web page, which keeps no tables of its own:
    the step phases stack up to the step, the overlapping ones are drawn beside them; with the
    severities' colours and the finding kinds. (The timeline sends its TIMELINE_ORDER with its
    steps.)"""
    return {"labels": PHASE_LABELS, "colours": PHASE_COLOURS, "order": list(PHASE_LABELS),
            "step_phases": list(STEP_PHASES), "overlapping_phases": list(OVERLAPPING_PHASES),
            "severity_colours": SEVERITY_COLOURS, "finding_kinds": list(FindingKind)}


def goodput_text(parts: Mapping[str, PartTime]) -> str:
    """"81% · evaluation 11% · checkpoint 5% · startup 3%": the training share, then the other
    parts largest first (those under half a percent left out). Shown after "Goodput"."""
    rest = sorted((part for part in PARTS if part != "training" and parts[part]["share"] >= 0.005),
                  key=lambda part: -parts[part]["share"])
    return " · ".join([f"{parts['training']['share']:.0%}"] + [f"{part} {parts[part]['share']:.0%}"
                                                               for part in rest])


# -- the card ---------------------------------------------------------------------------------
SEVERITY_STYLE: Dict[str, str] = {Severity.CRIT: "bold white on red", Severity.WARN: "bold black on yellow",
                  Severity.INFO: "bold white on blue"}


# The card's labels ("Step time", "Captured", ...) in one column width, so that the facts above
# the tables and the verdict below them start their values in the same column.
LABEL_WIDTH = 9


def render_card(summary: FinalSummary, width: int = CARD_WIDTH) -> RenderableType:
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
    facts.add_column(style="bold", no_wrap=True, width=LABEL_WIDTH)
    facts.add_column()
    exit_note = "" if run["exit_code"] in (0, None) else f"  [bold red]exit code {run['exit_code']}[/]"
    facts.add_row("Run", f"{escape(run['script'])}  ·  {run['duration_s']:.1f} s  ·  world size "
                         f"{run['world_size']}  ·  {', '.join(run['devices']) or 'cpu'}{exit_note}")
    hang = summary.get("hang")
    if hang:  # the run ended stuck: said before anything else
        facts.add_row("Hang", Text(hang["summary"], style="bold red"))
        for place in hang["ranks"]:
            if place["state"] in PULSED_STATES and place["stack"]:
                facts.add_row("", Text(f"rank {place['rank']}: " + " < ".join(
                    frame.rsplit("/", 1)[-1] for frame in place["stack"][:4])))
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
    for line in code_lines(summary.get("code") or {}):
        facts.add_row("Untimed", Text(line))
    compiled = summary.get("compile")
    if compiled:
        facts.add_row("Compile", _compile_line(compiled))
    facts.add_row("System", _system_line(system))
    if steps["count"]:
        facts.add_row("Memory", _memory_line(memory))
    for label, line in ledger_lines(memory.get("ledger") or [], run["world_size"]):
        facts.add_row(label, line)
    mesh = summary.get("mesh")
    if mesh:
        facts.add_row("Mesh", mesh_text(mesh))
    for missing in summary["missing_ranks"]:
        signal = signal_name(missing.get("exit_code"))
        how = (f"killed by {signal}" if signal else f"exit status {missing['exit_code']}"
               if missing.get("exit_code") is not None else "died or killed")
        facts.add_row("Missing", f"[bold red]rank {missing['rank']} from step {missing['from_step']}[/]"
                                 f" (stopped reporting without a goodbye: {how})")
    if steps["records_dropped"]:
        facts.add_row("Dropped", f"[yellow]{steps['records_dropped']} records dropped (buffer full "
                                 f"or collector unreachable)[/]")

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), expand=False)
    table.add_column("phase", no_wrap=True)
    table.add_column("median ms", justify="right", no_wrap=True)
    table.add_column("mean ms", justify="right", no_wrap=True)
    table.add_column("% of step", justify="right", no_wrap=True)
    # The bar may shrink, and is cropped, before any figure would be: a narrow terminal loses
    # the picture, never a number.
    table.add_column("", overflow="crop")
    for name in ALL_PHASES:
        stats = phases[name]
        bar = "█" * int(round(stats["share"] * 40)) if name in STEP_PHASES else ""
        table.add_row(PHASE_LABELS[name], f"{stats['median_ms']:.2f}", f"{stats['mean_ms']:.2f}",
                      f"{stats['share']:.1%}", Text(bar, style="cyan"))

    parts: List[RenderableType] = [facts, table] if steps["count"] else [facts]
    spans = summary.get("spans")
    if spans:  # a run without user spans gets no block: its card is as before
        parts.append(_span_table(spans))
    if run["world_size"] > 1 and summary["rank_spread"]:
        parts.append(_rank_table(summary))
    if summary["layers"]:
        parts.extend(_layer_tables(summary))

    verdict = Table.grid(padding=(0, 2))
    verdict.add_column(style="bold", no_wrap=True, width=LABEL_WIDTH)
    verdict.add_column()
    primary = summary["primary_diagnosis"]
    if primary:
        badge = Text(primary["kind"], style=SEVERITY_STYLE[primary["severity"]])
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


def _captured_row(verdict: Table, finding: FindingDict) -> None:
    """The layers an automatic capture found grown, right under the finding it belongs to. A
    capture that found none stays in final_summary.json: on the card it would tell nothing."""
    from rich.text import Text

    evidence = finding.get("evidence") or {}
    layers = evidence.get("captured_layers")
    if layers and evidence.get("captured_grown"):
        verdict.add_row("Captured", Text(str(layers)))


def _span_table(spans: Dict[str, SpanFigures]) -> Table:
    """The user spans (Trace.span), as report/summary.py's span_figures defines their figures."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), title="user spans (overlap the phases)",
                  title_justify="left", caption="median: a step it ran in; ms/step, %: all measured steps",
                  caption_justify="left")
    table.add_column("span", overflow="fold")  # the user's name is kept whole: wrapped, not cut
    for header in ("calls", "steps", "median ms", "ms/step", "% of step"):
        table.add_column(header, justify="right", no_wrap=True)
    for name, span in spans.items():
        # Text, not markup: the user's name may hold brackets rich must not interpret.
        table.add_row(Text(name), str(span["count"]), str(span["steps"]), f"{span['median_ms']:.2f}",
                      f"{span['total_ms_per_step']:.2f}", f"{span['share']:.1%}")
    return table


def _rank_table(summary: FinalSummary) -> Table:
    """Across ranks, per phase: the typical median, the typical worst, which rank, the skew."""
    from rich import box
    from rich.table import Table

    straggler = straggler_rank(summary["findings"])
    mesh = summary.get("mesh")
    # On a mesh of several dimensions the worst rank says where it sits on the outer ones (the
    # replica group under HSDP): a slow group and a slow rank read apart.
    outer = list(mesh["dims"])[:-1] if mesh else []
    coordinates = mesh["coordinates"] if mesh else {}

    def place(rank: int) -> str:
        coordinate = coordinates.get(rank) or coordinates.get(str(rank)) or {}
        return "".join(f" {name} {coordinate[name]}" for name in outer if name in coordinate)

    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), title="across ranks", title_justify="left")
    for header in ("phase", "median ms", "worst ms", "worst rank", "skew ms"):
        table.add_column(header, justify="left" if header == "phase" else "right", no_wrap=True)
    # The card has the room to say where comm wait is spent.
    labels = {**PHASE_LABELS, "comm_wait": f"comm wait (in {', '.join(_comm_phases(summary['ranks']))})"}
    for name, spread in summary["rank_spread"].items():
        if name not in labels or (name != "step" and spread["worst"] <= 0.0):
            continue
        rank = spread["worst_rank"]
        where = f"{rank}{place(rank)}"
        table.add_row(labels[name], f"{spread['median']:.2f}", f"{spread['worst']:.2f}",
                      f"[bold red]{where}[/]" if rank == straggler else where, f"{spread['skew']:.2f}")
    return table


def _comm_phases(ranks: Sequence[RankRow]) -> List[str]:
    """The phases some rank waited for collectives in: forward (FSDP's all-gathers), backward,
    optimizer (DeepSpeed ZeRO's all-gathers)."""
    parts = [comm_wait_parts(row) for row in ranks]
    phases = [phase for phase in ("forward", "backward", "optimizer")
              if max((part[phase] for part in parts), default=0.0) > 0.005]
    return phases or ["backward"]


def _layer_tables(summary: FinalSummary) -> List[RenderableType]:
    """Deep-dive: the top 5 leaf modules by time, and by memory saved for backward."""
    from rich import box
    from rich.table import Table

    deep = summary["deep_dive"]
    if deep is None:  # layers come with the deep-dive that sampled them
        return []
    leaves = [row for row in summary["layers"] if row["leaf"]]
    by_time = sorted(leaves, key=lambda r: -(r["forward_ms"] + r["backward_ms"]))[:5]
    by_memory = sorted(leaves, key=lambda r: -r["memory_bytes"])[:5]
    prefix = shared_prefix([row["name"] for row in by_time + by_memory])
    title = (f"layers (deep-dive {every(deep['every_n_steps'], 'step')}, {deep['sampled_steps']} sampled;"
             f" leaves cover {deep['forward_coverage']:.0%} of forward, "
             f"{deep['backward_coverage']:.0%} of backward)")
    if prefix:
        title += f"\nunder {prefix}"
    tables: List[RenderableType] = []
    for heading, rows in (("top by time", by_time), ("top by memory", by_memory)):
        table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), title=title if not tables else None,
                      title_justify="left")
        # Wrapped at dots beforehand (wrap_at_dots), to a width the column is then given; a
        # single part longer than that is folded.
        table.add_column(heading, overflow="fold", min_width=LAYER_NAME_WIDTH)
        for header in ("calls", "fwd ms", "bwd ms", "saved MiB", "output MiB"):
            table.add_column(header, justify="right", no_wrap=True)
        for row in rows:
            table.add_row(wrap_at_dots(f"{row['name'][len(prefix):]} ({row['type']})", LAYER_NAME_WIDTH),
                          f"{row['calls_per_step']:.0f}",
                          f"{row['forward_ms']:.2f}", f"{row['backward_ms']:.2f}",
                          f"{row['memory_bytes'] / 2 ** 20:.2f}", f"{row['output_bytes'] / 2 ** 20:.2f}")
        tables.append(table)
    note = deep.get("coverage_note")
    if note:
        from rich.text import Text

        tables.append(Text(f"Coverage: {note}."))
    return tables


LAYER_NAME_WIDTH = 40  # the layer tables' name column, beside five figure columns on a CARD_WIDTH card


def shared_prefix(names: Sequence[str]) -> str:
    """The dotted prefix every name starts with ("base_model.model.model."), whole parts only,
    leaving each name at least its last part; "" when there is none."""
    if len(names) < 2:
        return ""
    split = [name.split(".")[:-1] for name in names]
    common: List[str] = []
    for parts in zip(*split):
        if any(part != parts[0] for part in parts):
            break
        common.append(parts[0])
    return ".".join(common) + "." if common else ""


def wrap_at_dots(text: str, width: int) -> str:
    """Lines of at most `width` characters, broken after a dot or a space, never inside a word
    (a part longer than the width is left whole)."""
    lines: List[str] = []
    line = ""
    for piece in re.findall(r"[^. ]*[. ]|[^. ]+$", text):
        if line and len(line) + len(piece.rstrip()) > width:
            lines.append(line.rstrip())
            line = ""
        line += piece
    if line:
        lines.append(line.rstrip())
    return "\n".join(lines)


def _tokens_text(throughput: Throughput) -> str:
    tokens_per_s = throughput.get("tokens_per_s")
    if not tokens_per_s:
        return ""
    padding = throughput.get("padding_share")
    return f"  ·  {tokens_per_s:,.0f} tokens/s" + (f" ({padding:.0%} padding)" if padding is not None else "")


def _flops_text(throughput: Throughput) -> str:
    # From the exact counts: the summary's achieved_tflops is rounded, and a small model on a
    # busy CPU does less than the 0.00005 TFLOP/s that survive the rounding.
    flops, steps_per_s = throughput.get("flops_per_step"), throughput.get("steps_per_s")
    if not flops or not steps_per_s:
        return ""
    mfu = throughput.get("mfu")
    return (f"  ·  {flops * steps_per_s / 1e9:,.2f} GFLOP/s"
            + (f", MFU {mfu:.1%}" if mfu is not None else " (device peak unknown: no MFU)"))


def _compile_line(compiled: CompileSummary) -> str:
    """torch.compile's work: "1 compilation, 7 recompilations (0.9 s) · 1.7 s in all · 1 graph break"."""
    line = f"{counted(compiled['compilations'], 'compilation')}, {counted(compiled['recompilations'], 'recompilation')}"
    if compiled["recompilations"]:
        line += f" ({compiled['recompile_s']:.1f} s)"
    line += f"  ·  {compiled['compile_s']:.1f} s compiling in all"
    if compiled["graph_breaks"]:
        # Each break splits the graph: the code around it runs as Python between the pieces.
        line += (f"  ·  {counted(compiled['graph_breaks'], 'graph break')}: "
                 + "; ".join(compiled["graph_break_reasons"][:3]))
    return line


def _system_line(system: SystemPart) -> str:
    if not system.get("samples") or "cpu_percent" not in system:
        return "no samples (run shorter than the sampling interval)"
    gib = 1024 ** 3
    cpu, ram = system["cpu_percent"], system["ram_used_bytes"]
    line = (f"CPU avg {cpu['avg']:.0f}% peak {cpu['peak']:.0f}%  ·  "
            f"RAM avg {ram['avg'] / gib:.1f} peak "
            f"{ram['peak'] / gib:.1f} of {system['ram_total_bytes'] / gib:.1f} GiB")
    for gpu in system.get("gpus", []):
        line += (f"  ·  GPU{gpu['index']} util avg {gpu['utilization_percent']['avg']:.0f}%, "
                 f"mem peak {gpu['memory_used_bytes']['peak'] / gib:.1f} of "
                 f"{gpu['memory_total_bytes'] / gib:.1f} GiB")
        temperature, power = gpu.get("temperature_c"), gpu.get("power_w")
        if temperature:
            line += f", {temperature['peak']:.0f} °C peak"
        if power:
            line += f", {power['avg']:.0f} W avg"
    return line


def ledger_lines(ledger: List[LedgerRow], world_size: int = 1) -> List[Tuple[str, str]]:
    """(label, text) rows for the card: what holds the fullest rank's memory, and its adapters."""
    rows = [row for row in ledger if row.get("held")] or ledger
    if not rows:
        return []
    row = max(rows, key=lambda r: r.get("held") or 0)
    parameters = row["parameters"]
    text = (f"parameters {size(parameters['trainable'] + parameters['frozen'])}"
            f" ({size(parameters['trainable'])} trainable)")
    unsharded = parameters.get("unsharded")
    if unsharded is not None:
        text += f", this rank's shard of {size(unsharded)}"
    text += f"  ·  gradients {size(row['gradients'])}"
    cache, activations, rest = row.get("cache"), row["activations"], row["rest"]
    if cache:
        text += f"  ·  allocator cache {size(cache)}"
    text += f"\noptimizer state {size(row['optimizer_state'])}  ·  "
    text += (f"activations {size(activations)} (step {row['activations_step']})" if activations is not None
             else "activations not sampled")
    if rest is not None:  # of the device peak or the host RSS, which the Memory line gives
        text += f"  ·  rest {size(rest)}"
    if world_size > 1:
        text = f"rank {row['rank']}: " + text
    lines = [("Ledger", text)]
    sharding = row.get("sharding")
    if sharding:
        lines.append(("Shards", sharding_text(row, sharding)))
    adapters = row.get("adapters")
    if adapters:
        lines.append(("Adapters", adapter_text(adapters, parameters)))
    return lines


def mesh_text(mesh: DeviceMesh) -> str:
    """"replicate 2 × shard 4 · replicate 0: ranks 0-3 · replicate 1: ranks 4-7": the DeviceMesh's
    dimensions, and the ranks grouped by the outer one (a 1-D mesh: its size alone)."""
    dims = mesh["dims"]
    text = " × ".join(f"{name} {size}" for name, size in dims.items())
    names = list(dims)
    if len(names) < 2:
        return text
    groups: Dict[int, List[int]] = {}
    for rank, coordinate in sorted(mesh["coordinates"].items(), key=lambda item: int(item[0])):
        if names[0] in coordinate:
            groups.setdefault(coordinate[names[0]], []).append(int(rank))
    for index, ranks in sorted(groups.items()):
        listed = f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2 \
            else ", ".join(map(str, ranks))
        text += f"  ·  {names[0]} {index}: rank{'s' if len(ranks) > 1 else ''} {listed}"
    return text


def sharding_text(row: LedgerRow, sharding: Sharding) -> str:
    """"this rank holds parameters 130 KiB of 260 KiB, gradients ..., optimizer state ...;
    all-gathered at most 150 KiB at once in forward, 180 KiB in backward"."""
    parameters = row["parameters"]
    held = [("parameters", parameters["trainable"] + parameters["frozen"], sharding["parameters_unsharded"]),
            ("gradients", row["gradients"], sharding["gradients_unsharded"]),
            ("optimizer state", row["optimizer_state"], sharding["optimizer_state_unsharded"])]
    text = "this rank holds " + ", ".join(f"{name} {size(local)} of {size(full or 0)}" for name, local, full in held
                                          if full)  # None: not measured; 0: none held (SGD's state)
    peaks = [(phase, peak) for phase, peak in (("forward", sharding["gathered_peak_forward"]),
                                               ("backward", sharding["gathered_peak_backward"]))
             if peak is not None]
    if peaks:
        text += "; all-gathered at most " + ", ".join(f"{size(peak)} at once in {phase}" for phase, peak in peaks)
    return text


def adapter_text(adapters: Adapters, parameters: LedgerParameters) -> str:
    """"LoRA r=8 on q_proj, v_proj: 1.0 MiB trainable (0.5% of parameters), optimizer state 2.0 MiB;
    frozen base 190 MiB (bf16)", and under deep-dive the adapters' share of the time."""
    rank = f" r={adapters['r']}" if adapters.get("r") else ""
    share = adapters.get("share_of_parameters")
    text = (f"{adapters['kind']}{rank} on {', '.join(adapters['targets'])}: {size(adapters['parameters'])} trainable"
            + (f" ({share:.1%} of parameters)" if share is not None else "")
            + f", optimizer state {size(adapters['optimizer_state'])}")
    frozen_dtypes = parameters.get("frozen_dtypes") or {}
    if parameters["frozen"]:
        dtypes = ", ".join(DTYPE_WORDS.get(dtype, dtype) for dtype, _ in
                           sorted(frozen_dtypes.items(), key=lambda item: -item[1]))
        text += f"; frozen base {size(parameters['frozen'])}" + (f" ({dtypes})" if dtypes else "")
    forward_share, backward_share = adapters.get("forward_share"), adapters.get("backward_share")
    if forward_share is not None:
        text += f"; adapters take {forward_share:.0%} of their layers' forward"
        if backward_share is not None:
            text += f", {backward_share:.0%} of backward"
    return text


DTYPE_WORDS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "uint8": "uint8 (quantized)",
               "int8": "int8", "float8_e4m3fn": "fp8"}


def _memory_line(memory: MemoryPart) -> str:
    gib, mib = 1024 ** 3, 1024 ** 2
    parts = []
    device_peak, host_peak = memory["device_peak_bytes"], memory["host_rss_peak_bytes"]
    if device_peak is not None:
        capacity = memory["device_capacity_bytes"]
        parts.append(f"device peak {device_peak / gib:.2f} GiB"
                     + (f" of {capacity / gib:.1f} GiB" if capacity else ""))
    if host_peak is not None:
        parts.append(f"host RSS peak {host_peak / mib:,.0f} MiB")
    parts.append(f"trend {memory['creep_bytes_per_step'] / 1024:+,.1f} KiB/step")
    return "  ·  ".join(parts)


def card_text(summary: FinalSummary) -> str:
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


def print_card(summary: FinalSummary, file: Optional[TextIO] = None, text: Optional[str] = None) -> None:
    """Print the card: on a terminal at its width, in colour; elsewhere (a pipe, a log file)
    the plain text card, `text` when it is already rendered (card_text), as it is saved."""
    from rich.console import Console

    console = Console(file=file, highlight=False)
    if not console.is_terminal:  # a pipe or a log file has no width: use the card's own
        console = Console(file=file, highlight=False, width=CARD_WIDTH)
        if text is not None and console.color_system is None:
            console.file.write(text)
            return
    console.print(render_card(summary, width=console.width))
