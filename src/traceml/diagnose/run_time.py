"""Rules over the run's time that is not training: SLOW_STARTUP (from goodput) and
RECOMPILATION (from torch.compile's own compile events and the guard that failed)."""
from __future__ import annotations

import re
from collections import Counter
from typing import List, Mapping, Optional, Sequence, Tuple, TypedDict, cast

from traceml.analysis.goodput import Goodput
from traceml.diagnose.untimed import named, sites_evidence, sites_text
from traceml.records import CodeSample, CompileRecord, Finding, FindingKind, Severity
from traceml.words import counted, duration, rounded_parts

STARTUP_LINE = 0.20  # startup at this share of a run ...
STARTUP_MIN_RUN_S = 60.0  # ... longer than this: SLOW_STARTUP
STARTUP_CRIT = 0.40
RECOMPILE_SHARE_LINE = 0.05  # recompilations after warm-up costing this share of the run ...
RECOMPILE_COUNT_LINE = 3  # ... or more of them than this: RECOMPILATION
RECOMPILE_CRIT = 0.20

STARTUP_PARTS = (("imports_s", "the script's imports"), ("first_compilation_s", "the first compilation"),
                 ("first_batch_s", "the first batch"), ("setup_s", "building the model and data"))
STARTUP_ACTIONS = {
    "imports_s": ("Import time dominates startup: import heavy libraries where they are used, not "
                  "at the top of every module, and look for a slow shared filesystem "
                  "(`python -X importtime train.py` shows which import costs what)."),
    "first_compilation_s": ("torch.compile's first compilation dominates startup: keep its caches "
                            "between runs (the FX graph and AOTAutograd caches, on a persistent "
                            "TORCHINDUCTOR_CACHE_DIR), compile the repeated block rather than the "
                            "whole model, and avoid mode='max-autotune' for short runs."),
    "first_batch_s": ("The first batch dominates startup: DataLoader workers start and fill their "
                      "prefetch; open the dataset lazily in each worker, memory-map it, and use "
                      "persistent_workers=True so later epochs do not pay again."),
    "setup_s": ("Building the model and the data dominates startup: load weights straight onto the "
                "device (meta-device init, safetensors), memory-map or cache the tokenised dataset, "
                "and do one-off preprocessing offline."),
}

# torch's guard failures, in the user's words: (pattern, what changed, what to do).
_INPUT = r"'(?P<name>[^']+)'"
REASONS: Tuple[Tuple[str, str, str], ...] = (
    (rf"tensor {_INPUT} size mismatch at index (?P<dim>\d+)",
     "the size of dim {dim} of {input} changes",
     "pad to a few bucket lengths, or mark it dynamic: torch._dynamo.mark_dynamic({tensor}, {dim}) "
     "before the call, or torch.compile(dynamic=True)"),
    (rf"tensor {_INPUT} stride mismatch", "the memory layout (strides) of {input} changes",
     "make it contiguous before the compiled call"),
    (rf"tensor {_INPUT} dtype mismatch", "the dtype of {input} changes",
     "cast it to one dtype before the compiled call"),
    (rf"tensor {_INPUT} (?:device|dispatch key set) mismatch", "the device of {input} changes",
     "move it to one device before the compiled call"),
    (rf"tensor {_INPUT} requires_grad mismatch", "whether {input} requires grad changes",
     "keep requires_grad the same on every call"),
    (r"grad_mode|GLOBAL_STATE", "the gradient mode changes (called in training and under no_grad)",
     "a compiled function used for training and evaluation compiles once for each: expected once, "
     "not every time"),
    (r"(?P<name>L\[[^\]]+\](?:\.\w+|\[[^\]]+\])*) == ", "the Python value {input} changes",
     "pass values that change as tensors, or keep them constant"),
    (r"___check_obj_id|ID_MATCH", "a Python object it reads is replaced",
     "keep the object (a module, a config) the same between calls"),
)


def plain_reason(raw: str) -> Tuple[str, str]:
    """(what changed, what to do) for one of torch's recompile reasons."""
    text = re.sub(r"^\s*\d+/\d+:\s*", "", raw.strip().splitlines()[0] if raw.strip() else "")
    for pattern, what, action in REASONS:
        match = re.search(pattern, text)
        if match:
            values = match.groupdict()
            name = values.get("name")
            values["input"] = _input_name(name) if name else "an input"
            values["tensor"] = values["input"] if values["input"].isidentifier() else "x"
            return what.format(**values), action.format(**values)
    return (text[:160] or "a guard failed (torch gave no reason)",
            "run with TORCH_LOGS=recompiles to see each guard that fails")


def _input_name(name: str) -> str:
    """args[0] -> input 0; L['x'] or kwargs['x'] -> x."""
    match = re.fullmatch(r"(?:L\['args'\]|args)\[(\d+)\]", name)
    if match:
        return f"input {match.group(1)}"
    match = re.fullmatch(r"(?:L|kwargs|L\['kwargs'\])\['([^']+)'\]", name)
    return match.group(1) if match else name


def recompilations(compiles: Sequence[CompileRecord], after_step: int, run_ms: float) -> Optional[Finding]:
    """RECOMPILATION: torch.compile compiling again after warm-up (after_step), because a
    guard failed, for more than a few times or a share of the run."""
    late_ids = {(r.rank, r.compile_id) for r in compiles
                if r.trigger == "dynamo" and r.recompiled and r.step >= after_step}
    if not late_ids:
        return None
    rank0 = min(rank for rank, _ in late_ids)
    late = [r for r in compiles if (r.rank, r.compile_id) in late_ids and r.rank == rank0]
    frames = [r for r in late if r.trigger == "dynamo"]
    count, seconds = len(frames), sum(r.duration_ms for r in late) / 1e3
    share = seconds * 1e3 / run_ms if run_ms > 0 else 0.0
    if share < RECOMPILE_SHARE_LINE and count <= RECOMPILE_COUNT_LINE:
        return None
    reasons = Counter(plain_reason(r.recompile_reason) for r in frames)
    (what, action), _ = reasons.most_common(1)[0]
    first = min(r.step for r in frames)
    summary = (f"{counted(count, 'recompilation')} after step {after_step} (first at "
               f"step {first}), {seconds:.1f} s, {share:.1%} of the {duration(run_ms)} run: {what}")
    if len(reasons) > 1:
        summary += f" (and {counted(len(reasons) - 1, 'other reason')})"
    return Finding(
        kind=FindingKind.RECOMPILATION, severity=Severity.CRIT if share >= RECOMPILE_CRIT else Severity.WARN,
        summary=summary,
        action=(f"{action[0].upper()}{action[1:]}. Each recompilation stops the step to compile "
                "again; past torch._dynamo.config.recompile_limit (8 by default) torch stops "
                "compiling that function and runs it uncompiled. TORCH_LOGS=recompiles shows each guard."),
        rank=rank0 if len({rank for rank, _ in late_ids}) < len({r.rank for r in compiles}) else None,
        evidence={"share": round(share, 4), "recompilations": count, "seconds": round(seconds, 3),
                  "first_step": first, "after_step": after_step, "reason": what, "run_s": round(run_ms / 1e3, 3),
                  "reasons": len(reasons),
                  "torch_reason": frames[0].recompile_reason[:300], "code": frames[0].code})


def slow_startup(goodput: Optional[Goodput], code: Sequence[CodeSample] = ()) -> Optional[Finding]:
    """SLOW_STARTUP: startup at STARTUP_LINE or more of a run longer than STARTUP_MIN_RUN_S,
    with its largest part named where it can be told, and the script's code it was sampled in
    (diagnose/untimed.py)."""
    if goodput is None or goodput.wall_s < STARTUP_MIN_RUN_S:
        return None
    share = goodput.share("startup")
    if share < STARTUP_LINE:
        return None
    # The parts by name: a TypedDict is keyed by literals alone.
    startup = cast(Mapping[str, Optional[float]], goodput.startup)
    parts = [(key, words, startup.get(key)) for key, words in STARTUP_PARTS]
    told = sorted(((key, words, float(value)) for key, words, value in parts if value), key=lambda p: -p[2])
    largest = told[0][0] if told else "setup_s"
    slowest = goodput.startup["slowest_import"]
    # In tenths of a second that add up to the startup said (setup is what the others leave).
    tenths = rounded_parts([value for _, _, value in told] + [goodput.seconds("startup") - sum(
        value for _, _, value in told)], 1)
    described = ", ".join(f"{words} {value:.1f} s" + (f" ({slowest} the slowest)" if key == "imports_s"
                                                         and slowest else "")
                          for (key, words, _), value in zip(told, tenths) if value >= 0.05)
    sites = named(code, "startup", 1.0)
    modules = goodput.startup.get("modules_imported") or 0
    named_code = sites_text(sites) + (f", {modules:,} modules imported" if sites and modules else "")
    return Finding(
        kind=FindingKind.SLOW_STARTUP, severity=Severity.CRIT if share >= STARTUP_CRIT else Severity.WARN,
        summary=(f"startup takes {sum(tenths):.1f} s, {share:.0%} of the {goodput.wall_s:.1f} s run, before "
                 f"the first step" + (f": {described}" if described else "")
                 + (f"; {named_code}" if named_code else "")),
        action=STARTUP_ACTIONS[largest],
        evidence={"share": round(share, 4), "seconds": round(goodput.seconds("startup"), 3),
                  "run_s": round(goodput.wall_s, 3),
                  "largest_part": largest[:-2], **{key: (round(float(value), 3) if value is not None else None)
                                                   for key, _, value in parts},
                  "modules_imported": modules, **sites_evidence(sites, "seconds")})


class RecompileReason(TypedDict):
    reason: str
    count: int


class CompileSummary(TypedDict):
    """What torch.compile did in the run (the summary's compile)."""

    compilations: int
    recompilations: int
    recompilations_after_warmup: int
    compile_s: float
    recompile_s: float
    first_recompile_step: Optional[int]
    recompile_reasons: List[RecompileReason]
    graph_breaks: int
    graph_break_reasons: List[str]


def compile_summary(compiles: Sequence[CompileRecord], after_step: int) -> Optional[CompileSummary]:
    """What torch.compile did in the run (rank 0's, or the first rank's): for the summary."""
    if not compiles:
        return None
    rank0 = min(r.rank for r in compiles)
    mine = [r for r in compiles if r.rank == rank0]
    frames = [r for r in mine if r.trigger == "dynamo"]
    recompiles = [r for r in frames if r.recompiled]
    late_ids = {r.compile_id for r in recompiles if r.step >= after_step}
    reasons: List[RecompileReason] = []
    for (what, _), count in Counter(plain_reason(r.recompile_reason) for r in recompiles).most_common():
        reasons.append({"reason": what, "count": count})
    breaks: Counter[str] = Counter()
    for record in mine:
        for reason in record.graph_break_reasons:
            breaks[reason] += 1
    return {
        "compilations": len(frames) - len(recompiles),
        "recompilations": len(recompiles),
        "recompilations_after_warmup": len(late_ids),
        "compile_s": round(sum(r.duration_ms for r in mine) / 1e3, 3),
        "recompile_s": round(sum(r.duration_ms for r in mine if r.recompiled) / 1e3, 3),
        "first_recompile_step": min((r.step for r in recompiles), default=None),
        "recompile_reasons": reasons,
        "graph_breaks": sum(r.graph_breaks for r in mine),
        "graph_break_reasons": [reason for reason, _ in breaks.most_common(5)],
    }
