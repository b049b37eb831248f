"""HOST_SYNC: the lines of code that make the host wait for the GPU every step, from the probe's
sampled steps (probe.syncs)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple, TypedDict

from traceml.analysis.rollup import Window
from traceml.records import Finding, FindingKind, HostSyncSample, Severity
from traceml.words import counted

EVERY_STEP_LINE = 0.5  # calls per sampled step from one line: below, an occasional read (logging every N steps)
WARN_SHARE = 0.05  # what removing the syncs could win, as a share of the step: warn

# What to do instead, by what synchronized.
_LOGGING_ADVICE = ("log every N steps, or keep a device-side running sum (`running_loss += "
                   "loss.detach()`) and read it once every N steps")
ADVICE = {
    "Tensor.item": _LOGGING_ADVICE, "Tensor.__float__": _LOGGING_ADVICE, "Tensor.__int__": _LOGGING_ADVICE,
    "Tensor.__format__": _LOGGING_ADVICE, "Tensor.__repr__": "print every N steps, not every step",
    "Tensor.__bool__": ("a Python `if` on a device tensor reads it on the host: decide on the device "
                        "(torch.where, a mask) or check every N steps"),
    "Tensor.tolist": "keep the values on the device, or read them every N steps",
    "Tensor.nonzero": "use a mask on the device (torch.where) instead of the indices",
    "torch.cuda.synchronize": "take out torch.cuda.synchronize() (time with CUDA events, as TraceML does)",
}
_COPY_ADVICE = ("keep the tensor on the device, or copy it with .to('cpu', non_blocking=True) into pinned "
                "memory and read it a step later")


class _SiteTally(TypedDict):
    site: str
    code: str
    call: str
    calls: int
    wait_ms: float
    ranks: Set[int]


class SyncLine(TypedDict):
    """A line that made the host wait for the device (the summary's host_syncs)."""

    site: str  # "train.py:41"
    code: str  # its source line
    call: str  # what synchronized: ".item()", ".cpu()"
    calls_per_step: float
    wait_ms_per_step: float
    ranks: List[int]
    sampled_steps: int


def sync_sites(samples: Sequence[HostSyncSample]) -> List[SyncLine]:
    """Each line that synchronized, summed over every rank's samples: calls and host wait per
    sampled step, the longest wait first."""
    sampled_steps = sum(sample.steps for sample in samples)
    if not sampled_steps:
        return []
    sites: Dict[Tuple[str, str], _SiteTally] = {}
    for sample in samples:
        for site in sample.sites:
            row = sites.setdefault((site.site, site.call), {
                "site": site.site, "code": site.code, "call": site.call, "calls": 0, "wait_ms": 0.0,
                "ranks": set()})
            row["calls"] += site.calls
            row["wait_ms"] += site.wait_ms
            row["ranks"].add(sample.rank)
    rows: List[SyncLine] = [{"site": row["site"], "code": row["code"], "call": row["call"],
             "calls_per_step": round(row["calls"] / sampled_steps, 3),
             "wait_ms_per_step": round(row["wait_ms"] / sampled_steps, 4),
             "ranks": sorted(row["ranks"]), "sampled_steps": sampled_steps}
            for row in sites.values()]
    return sorted(rows, key=lambda row: -row["wait_ms_per_step"])


def host_sync(samples: Sequence[HostSyncSample], window: Window) -> Optional[Finding]:
    """HOST_SYNC: lines that read device values on the host every step. Worth what the host
    could overlap with the GPU once it no longer waits: its own work between the model's
    launches (the input wait and the work between steps), never more than the wait itself."""
    every_step = [row for row in sync_sites(samples) if row["calls_per_step"] >= EVERY_STEP_LINE]
    step_ms = window.step_mean_ms
    if not every_step or step_ms <= 0:
        return None
    top = every_step[0]
    wait_ms = sum(row["wait_ms_per_step"] for row in every_step)
    host_work_ms = window.mean_ms("input_wait") + window.mean_ms("outside")
    overlap_ms = min(wait_ms, host_work_ms)
    share = overlap_ms / step_ms
    code = f" `{top['code']}`" if top["code"] else ""
    summary = (f"{top['site']}{code} synchronizes {_how_often(top['calls_per_step'])}: the host waits "
               f"{top['wait_ms_per_step']:.1f} ms a step for the GPU, {top['wait_ms_per_step'] / step_ms:.0%} of "
               f"the {step_ms:.1f} ms step")
    if len(every_step) > 1:
        others = len(every_step) - 1
        summary += (f" (and {counted(others, 'other line')} every step: "
                    f"{wait_ms - top['wait_ms_per_step']:.1f} ms more)")
    advice = ADVICE.get(top["call"], _COPY_ADVICE)
    action = (f"{advice[0].upper()}{advice[1:]}. While the host waits it cannot load the next batch or "
              f"queue the next kernels: up to {overlap_ms:.1f} ms a step ({share:.0%}) could overlap "
              "with the GPU instead.")
    return Finding(
        kind=FindingKind.HOST_SYNC, severity=Severity.WARN if share >= WARN_SHARE else Severity.INFO,
        summary=summary, action=action,
        evidence={"share": round(share, 4), "site": top["site"], "code": top["code"], "call": top["call"],
                  "calls_per_step": top["calls_per_step"], "wait_ms_per_step": top["wait_ms_per_step"],
                  "wait_share": round(wait_ms / step_ms, 4), "lines": len(every_step),
                  "overlap_ms_per_step": round(overlap_ms, 4), "sampled_steps": top["sampled_steps"],
                  "step_mean_ms": round(step_ms, 3), "others_wait_ms_per_step": round(wait_ms - top["wait_ms_per_step"], 4)})


def _how_often(calls_per_step: float) -> str:
    if calls_per_step < 0.95:
        return f"on {calls_per_step:.0%} of the steps"
    if calls_per_step < 1.5:
        return "every step"
    return f"{calls_per_step:.0f} times a step"
