"""Where the untimed time went, in the user's code: the probe's sampled sites (probe/code_sites.py)
merged over ranks, as shares of the step (time inside the step outside its timed phases, and
between steps) or seconds of startup, for the findings that name them and for the summary."""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, TypedDict, cast

from traceml.analysis.goodput import Goodput
from traceml.analysis.rollup import Window
from traceml.records import CodeSample, Evidence

SITES_TOLD = 3  # the sites a sentence names
SITE_LINE = 0.01  # ... each at least this share of its whole (the step; startup)
PART_LINE = 0.10  # a part this share of its whole (the step; the run, for startup) is named in the summary


class MergedSite(TypedDict):
    """One line of the user's code, merged over the ranks that sampled it."""

    file: str
    line: int
    function: str
    statement: int  # startup: the script's top-level line it ran under (0: the site is that line)
    fraction: float  # of the part's samples
    seconds: float
    importing_s: float  # of them, importing modules


class _Where(TypedDict):
    where: str  # "train.py:41 update_metrics"


class NamedSite(_Where, total=False):
    """A site a finding or the summary names: its share of the step, or for startup its seconds."""

    share: float
    seconds: float
    importing_s: float
    statement: int


class UntimedPart(TypedDict):
    share: float  # of the step
    sites: List[NamedSite]


class StartupPart(TypedDict):
    seconds: float
    imports_s: Optional[float]
    modules_imported: Optional[int]
    sites: List[NamedSite]


class CodeSummary(TypedDict, total=False):
    """final_summary.json's "code": the parts at PART_LINE of their whole or more."""

    untraced: UntimedPart
    outside: UntimedPart
    startup: StartupPart


def where(site: MergedSite) -> str:
    """"train.py:41 update_metrics", or "train.py:57 (module level)"."""
    place = f"{os.path.basename(site['file'])}:{site['line']}"
    return f"{place} (module level)" if site["function"] == "<module>" else f"{place} {site['function']}"


def part_shares(window: Window) -> Dict[str, float]:
    """The step's untimed parts as shares of it: inside the step outside the timed phases, and
    between steps (evaluation and saves are beside the step, never in either)."""
    return {"untraced": window.share("untraced"), "outside": window.share("outside")}


def code_sites(samples: Sequence[CodeSample], part: str) -> List[MergedSite]:
    """The part's sites over every rank that sampled it, the most sampled first: each with its
    fraction of the samples and, for startup, its seconds (both the mean over those ranks)."""
    records = [sample for sample in samples if sample.part == part and sample.seconds > 0]
    rows: Dict[Tuple[str, str, int, int], MergedSite] = {}
    for record in records:
        for site in record.sites:
            key = (site.file, site.function, site.line if site.function == "<module>" else 0, site.statement)
            row = rows.setdefault(key, {"file": site.file, "line": site.line, "function": site.function,
                                        "statement": site.statement, "fraction": 0.0, "seconds": 0.0,
                                        "importing_s": 0.0})
            row["fraction"] += site.seconds / record.seconds / len(records)
            row["seconds"] += site.seconds / len(records)
            row["importing_s"] += site.importing_s / len(records)
    return sorted(rows.values(), key=lambda row: -row["fraction"])


def named(samples: Sequence[CodeSample], part: str, whole: float) -> List[NamedSite]:
    """The part's top sites, at least SITE_LINE of the whole, as {where, share} of the step (whole:
    the part's share of the step) or, for startup, {where, seconds, importing_s, statement}."""
    rows = [row for row in code_sites(samples, part) if whole * row["fraction"] >= SITE_LINE][:SITES_TOLD]
    if part == "startup":
        return [{"where": where(row), "seconds": round(row["seconds"], 3), "importing_s": round(row["importing_s"], 3),
                 "statement": row["statement"]} for row in rows]
    return [{"where": where(row), "share": round(whole * row["fraction"], 4)} for row in rows]


def sites_evidence(sites: List[NamedSite], figure: str) -> Evidence:
    """A finding's evidence of its named sites: code_1, code_1_share (or _s), ..."""
    evidence: Evidence = {}
    for index, site in enumerate(sites, 1):
        evidence[f"code_{index}"] = site["where"]
        # figure names a key: a TypedDict is keyed by literals alone
        evidence[f"code_{index}_{'s' if figure == 'seconds' else figure}"] = cast(Mapping[str, float], site)[figure]
    return evidence


def sites_text(sites: List[NamedSite]) -> str:
    """"55% of the step in train.py:41 update_metrics, 3% in train.py:60 log", or, for startup,
    "16.8 s in run.py:57 (module level), 1.2 s in ..."."""
    told = [(f"{site['share']:.0%}" if "share" in site else f"{site.get('seconds', 0.0):.1f} s") for site in sites]
    of_step = " of the step" if sites and "share" in sites[0] else ""
    return ", ".join(f"{figure}{of_step if index == 0 else ''} in {site['where']}"
                     for index, (figure, site) in enumerate(zip(told, sites)))


def untimed_summary(samples: Sequence[CodeSample], window: Window, goodput: Optional[Goodput]) -> CodeSummary:
    """final_summary.json's "code": each untimed part at PART_LINE of its whole or more, with its
    top sites (none sampled: an empty list)."""
    summary: CodeSummary = {}
    if len(window):
        shares = part_shares(window)
        if shares["untraced"] >= PART_LINE:
            summary["untraced"] = {"share": round(shares["untraced"], 4),
                                   "sites": named(samples, "untraced", shares["untraced"])}
        if shares["outside"] >= PART_LINE:
            summary["outside"] = {"share": round(shares["outside"], 4),
                                  "sites": named(samples, "outside", shares["outside"])}
    if goodput is not None and goodput.share("startup") >= PART_LINE:
        summary["startup"] = {"seconds": round(goodput.seconds("startup"), 3),
                              "imports_s": goodput.startup["imports_s"],
                              "modules_imported": goodput.startup.get("modules_imported"),
                              "sites": named(samples, "startup", 1.0)}
    return summary


def code_lines(code: CodeSummary) -> List[str]:
    """final_summary.json's "code" in words, a line a part: "in the step 41%: 33% of the step in
    train.py:62 update_metrics, ...", "startup 19.5 s (imports 17.0 s, 2,110 modules): 11.6 s in
    train.py:77 (module level), ..."."""
    lines = []
    for told, words in ((code.get("untraced"), "in the step"), (code.get("outside"), "between steps")):
        if told:
            lines.append(f"{words} {told['share']:.0%}: {sites_text(told['sites']) or 'no code sampled'}")
    startup = code.get("startup")
    if startup:
        imports = (f" (imports {startup['imports_s']:.1f} s, {startup['modules_imported'] or 0:,} modules)"
                   if startup.get("imports_s") is not None else "")
        lines.append(f"startup {startup['seconds']:.1f} s{imports}: {sites_text(startup['sites']) or 'no code sampled'}")
    return lines
