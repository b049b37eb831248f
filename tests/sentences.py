"""Recomputes every number in a finding's summary from its evidence: a reader must be able to check
each sentence at a glance, so each figure it states is in the evidence or follows directly from
it, shares come with their base and totals with their parts, adding up within the last digit shown.

FIGURES says, per finding kind, which figures its words may state and how each is derived from
the evidence; ADDS_UP, per kind, the sums and shares a reader would redo, on the figures as shown.
NAMES holds numbers that are names in a kind's words ("generation 2"); text the evidence holds (a
file:line, a layer's name, a reason torch gave) is quoted, not computed, and left out.
`problems(finding)` lists what does not hold (empty: the sentence checks); `check_findings` fails
with them. conftest.py runs it on every run of the traceml_run fixture as it ends and, after each
test, on every final_summary.json under the test's tmp_path; test_sentences.py on each kind made
by its rule.
"""
import math
import re
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

# A figure as shown: a number with the unit after it, if any; never part of a name ("gpt2", "fc1",
# "layer.0": a letter, digit or dot before it).
NUMBER = re.compile(r"(?<![\w.\-])(-?\d+(?:,\d{3})*(?:\.\d+)?)(%| ms\b| s\b| B\b| KiB\b| MiB\b| GiB\b)?")
SIZES = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}

# (value, unit, part, label): unit "%" a share (0-1), "ms" a time, "B" bytes, "" a count; part: one
# of the parts of a total, rounded so that they add up to it (words.rounded_parts), which may put it
# a unit of its last digit from its own rounding; label: what names it in the words ("rank 1",
# "ranks 0, 1", "step 49", "pid 4242", a setting's "num_workers=2"): a figure so named is one of those,
# and only such a figure is.
Figure = Tuple[float, str, bool, str]
LABELS = (("rank", re.compile(r"\branks? (?:\d+, )*$")), ("step", re.compile(r"\bstep $")),
          ("pid", re.compile(r"\bpid $")), ("=", re.compile(r"\w+=$")))


def share(value: Any, part: bool = False) -> List[Figure]:
    return [] if value is None else [(float(value), "%", part, "")]


def ms(value: Any, part: bool = False) -> List[Figure]:
    return [] if value is None else [(float(value), "ms", part, "")]


def count(*values: Any, label: str = "") -> List[Figure]:
    return [(float(value), "", False, label) for value in values if value is not None and not isinstance(value, str)]


def rank(*values: Any) -> List[Figure]:
    return count(*values, label="rank")


def step(*values: Any) -> List[Figure]:
    return count(*values, label="step")


def pid(*values: Any) -> List[Figure]:
    return count(*values, label="pid")


def nbytes(value: Any) -> List[Figure]:
    return [] if value is None else [(float(value), "B", False, "")]


def _of_step(e: dict) -> List[Figure]:
    """"X% of the step: A ms of B ms" (step_time._of_step), and the line of a share at it."""
    return (share(e.get("share")) + ms(e.get("phase_mean_ms")) + ms(e.get("step_mean_ms"))
            + share(e.get("share_low")) + share(e.get("share_high")) + share(e.get("line"))
            + share(e.get("verdict_share")) + share(e.get("verdict_low_share")) + share(e.get("interval_level")))


def _loader(e: dict) -> List[Figure]:
    """INPUT_BOUND's words about the DataLoader (step_time.describe_loader, loader_advice)."""
    settings = [figure for key in ("num_workers", "prefetch_factor", "batch_size") for figure in count(e.get(key), label=key)]
    return (settings + count(e.get("num_workers"), e.get("usable_cores"), e.get("iterators_made"))
            + share(e.get("ready_share")) + share(e.get("workers_busy_share")) + share(e.get("workers_cpu_wait_share"))
            + ms(e.get("worker_cpu_ms_per_batch")) + ms(e.get("input_wait_ms_per_batch"))
            + ms(e.get("thread_ms_per_batch")) + ms(e.get("training_ms_per_batch")))


def _stalls(e: dict) -> List[Figure]:
    """Slow steps (spikes.Stalls.evidence): how many, how often, how long, what they cost."""
    figures = (count(e.get("slow_steps"), e.get("episodes"), e.get("period_steps"), e.get("longest_episode_steps"),
                     e.get("first_spike_step"))
               + ms(e.get("spike_median_ms")) + ms(e.get("step_median_ms")) + ms(e.get("phase_growth_ms"))
               + ms(e.get("cost_ms")) + ms(e.get("steps_total_ms")) + ms(e.get("stall_ms"))
               + share(e.get("share")) + share(e.get("stall_share")) + count(e.get("input_ratio"))
               + count(e.get("other_cpu_cores")))
    outliers = e.get("outliers") or []
    figures += count(len(outliers), e.get("slow_steps", 0) - len(outliers))
    for outlier in outliers:
        figures += step(outlier["step"]) + ms(outlier["ms"])
    return figures


def _periodic(base: Callable[[dict], List[Figure]]) -> Callable[[dict], List[Figure]]:
    """A share-based finding told by the period of its stalls (spikes.periodic), or as itself."""
    return lambda e: _stalls(e) + base(e) if e.get("periodic") else base(e)


def _planned(e: dict) -> List[Figure]:
    """EVAL_HEAVY, CHECKPOINT_STALL: "evaluated 5 times (every 10 steps): 4 of about 36 ms, one of 402 ms
    at step 500, and 402 ms elsewhere: 948 ms, 3.2% of the 29.4 s run"."""
    outliers = e.get("outliers") or []
    run_ms = e["run_ms"] if e.get("run_ms") is not None else None if e.get("run_s") is None else e["run_s"] * 1e3
    figures = (count(e.get("count"), e.get("period_steps"), e.get("count", 0) - len(outliers), len(outliers),
                     e.get("after_last_step_count"))
               + step(e.get("first_step")) + ms(e.get("each_ms")) + ms(e.get("elsewhere_ms")) + ms(e.get("total_ms"))
               + share(e.get("share")) + ms(run_ms))
    for outlier in outliers:
        figures += step(outlier["step"]) + ms(outlier["ms"])
    return figures


def _code(e: dict) -> List[Figure]:
    """The code an untimed part was sampled in (diagnose/untimed.sites_evidence): each site's share
    of the step or, at startup, its seconds; and the modules the script imported."""
    figures = count(e.get("modules_imported"))
    for key, value in e.items():
        if re.fullmatch(r"code_\d+_share", key):
            figures += share(value)
        elif re.fullmatch(r"code_\d+_s", key):
            figures += ms(value * 1e3)
    return figures


def _hang(e: dict) -> List[Figure]:
    """HANG: each rank's figures (hangs._figures) and the collective counts' differences."""
    figures = ms(e["stalled_s"] * 1e3) + count(e.get("stalled_ranks"), e.get("waiting_ranks"))
    issued: Dict[str, Dict[int, int]] = {}  # on the default group, and on the group that decided
    for key, value in e.items():
        match = re.fullmatch(r"rank_(\d+)_(\w+)", key)
        if not match or isinstance(value, str):
            continue
        figures += rank(int(match.group(1)))
        if match.group(2) == "stalled_s":
            figures += ms(value * 1e3)
        else:
            figures += pid(value) if match.group(2).endswith("pid") else count(value)
        if match.group(2) in ("collectives_issued", "issued_on_group"):
            issued.setdefault(match.group(2), {})[int(match.group(1))] = value
    for counts in issued.values():
        figures += count(*(max(counts.values()) - value for value in counts.values()))
    return figures


FIGURES: Dict[str, Callable[[dict], List[Figure]]] = {
    "INSUFFICIENT_DATA": lambda e: count(e["steps"], e["min_steps"]),
    "INPUT_BOUND": _periodic(lambda e: _of_step(e) + _loader(e)),
    "H2D_BOUND": _periodic(_of_step),
    "UNTRACED_WORK": _periodic(lambda e: _of_step(e) + share(e.get("outside_share")) + share(e.get("untraced_share"))
                               + _code(e)),
    "GC_PRESSURE": _periodic(lambda e: _of_step(e) + count(e.get("collections_per_step")) + ms(e.get("median_pause_ms"))
                             + ms(e.get("worst_pause_ms")) + share(e.get("full_collection_share"))),
    "COMPUTE_BOUND": lambda e: (_of_step(e) + share(e["forward_share"], True) + share(e["backward_share"], True)
                                + share(e["optimizer_share"], True) + share(e.get("comm_wait_share"), True)),
    "STEP_SPIKES": _stalls,
    "EVAL_HEAVY": _planned,
    "CHECKPOINT_STALL": _planned,
    "RECOMPILATION": lambda e: (count(e["recompilations"], e["reasons"] - 1) + step(e["after_step"], e["first_step"])
                                + ms(e["seconds"] * 1e3) + share(e["share"]) + ms(e["run_s"] * 1e3)),
    "SLOW_STARTUP": lambda e: (ms(e["seconds"] * 1e3) + share(e["share"]) + ms(e["run_s"] * 1e3) + [
        figure for key in ("imports_s", "first_compilation_s", "first_batch_s", "setup_s")
        for figure in ms(None if e.get(key) is None else e[key] * 1e3, True)] + _code(e)),
    "HOST_SYNC": lambda e: (count(e["calls_per_step"], e["lines"] - 1) + share(e["calls_per_step"])
                            + ms(e["wait_ms_per_step"]) + share(e["wait_ms_per_step"] / e["step_mean_ms"])
                            + ms(e["step_mean_ms"]) + ms(e["others_wait_ms_per_step"])),
    "MEMORY_CREEP": lambda e: (nbytes(e["bytes_per_step"]) + nbytes(e["growth_bytes"]) + count(e["over_steps"])
                               + step(e.get("projected_oom_step")) + nbytes(e.get("headroom_bytes"))),
    "MEMORY_PRESSURE": lambda e: (
        step(e.get("step")) + rank(e.get("rank")) + nbytes(e.get("held_bytes")) + nbytes(e.get("capacity_bytes"))
        + nbytes(e.get("peak_bytes")) + nbytes(e.get("reserved_bytes")) + share(e.get("share"))
        + nbytes(e.get("headroom_bytes")) + nbytes(e.get("largest_part_bytes")) + rank(e.get("largest_part_rank"))
        + nbytes(e.get("largest_part_rank_held_bytes"))
        + share(e["largest_part_bytes"] / e["largest_part_rank_held_bytes"] if e.get("largest_part_rank_held_bytes")
                else None)),
    "COMM_BOUND": lambda e: (ms(e["comm_wait_ms"]) + share(e["share"]) + ms(e["step_median_ms"])
                             + rank(e["least_waiting_rank"]) + ms(e["forward_comm_wait_ms"], True)
                             + ms(e["backward_comm_wait_ms"], True) + ms(e["optimizer_comm_wait_ms"], True)),
    "HANG": _hang,
    "RANK_LOST": lambda e: (rank(e["rank"], *(e.get("other_ranks_lost") or ()), *(e.get("ranks_stopped") or ()))
                            + step(e["last_step"]) + count(e.get("exit_code")) + pid(e.get("pid"))),
}
_STRAGGLER = lambda e: (ms(e["loss_ms"]) + share(e["share"]) + ms(e["step_median_ms"]) + ms(e["rank_value_ms"])
                        + ms(e["others_median_ms"]) + count(e.get("other_processes_cores")))
FIGURES.update(INPUT_STRAGGLER=_STRAGGLER, COMPUTE_STRAGGLER=_STRAGGLER, STRAGGLER=_STRAGGLER)

# Numbers that are names in a kind's words, not figures.
NAMES: Dict[str, Sequence[str]] = {"GC_PRESSURE": ("generation 2",)}


class Shown:
    """A figure as the sentence shows it, with the precision its digits give."""

    def __init__(self, match: "re.Match[str]"):
        text, unit = match.group(1).replace(",", ""), (match.group(2) or "").strip()
        self.text = match.group(0)
        self.start = match.start()
        before = match.string[:match.start()]
        self.label = next((label for label, pattern in LABELS if pattern.search(before)), "")
        if self.label == "=":
            self.label = re.search(r"(\w+)=$", before)[1]
        digits = len(text.split(".")[1]) if "." in text else 0
        self.value = float(text)
        self.half_unit = 0.5 * 10 ** -digits
        if unit == "%":
            self.unit, self.scale = "%", 0.01
        elif unit in ("ms", "s"):
            self.unit, self.scale = "ms", 1e3 if unit == "s" else 1.0
        elif unit in SIZES:
            self.unit, self.scale = "B", float(SIZES[unit])
        else:
            self.unit, self.scale = "", 1.0

    @property
    def base_value(self) -> float:
        """The figure in its candidates' unit: a share as 0-1, a time in ms, a size in bytes."""
        return self.value * self.scale

    @property
    def slack(self) -> float:
        """How far the true value may be from the shown one, in the candidates' unit."""
        return self.half_unit * self.scale * 1.02 + 1e-9

    def derives_from(self, value: float, unit: str, part: bool, label: str) -> bool:
        return (unit == self.unit and label == self.label
                and abs(value - self.base_value) <= (2 if part else 1) * self.slack)


def shown_figures(finding: dict) -> List[Shown]:
    """The figures of a finding's summary, the names in it (evidence's text, NAMES) left out."""
    text = finding["summary"]
    names = [value for value in _texts(finding.get("evidence") or {}) if any(c.isdigit() for c in value)]
    names += NAMES.get(finding["kind"], ())
    for name in sorted(set(names), key=len, reverse=True):
        text = text.replace(name, " " * len(name))
    return [Shown(match) for match in NUMBER.finditer(text)]


def _texts(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _texts(item)
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)


def problems(finding: dict) -> List[str]:
    """What a reader could not check in this finding's summary: figures its evidence does not give,
    sums that do not add up, shares whose base is missing."""
    kind, evidence = finding["kind"], finding.get("evidence") or {}
    derive = FIGURES.get(kind)
    if derive is None:
        return [f"{kind}: no entry in tests/sentences.py FIGURES says how its figures derive"]
    try:
        candidates = derive(evidence)
    except (KeyError, TypeError, ZeroDivisionError) as error:
        return [f"{kind}: evidence lacks what its figures need ({error!r}): {evidence}"]
    if finding.get("rank") is not None:
        candidates += rank(finding["rank"])
    found = []
    for figure in shown_figures(finding):
        if not any(figure.derives_from(*candidate) for candidate in candidates):
            found.append(f"{kind}: {figure.text!r} follows from no evidence in {finding['summary']!r}")
    for check in ADDS_UP.get(kind, ()):
        found += [f"{kind}: {problem} in {finding['summary']!r}" for problem in check(finding["summary"], evidence)]
    return found


def check_findings(findings: Iterable[dict], where: str = "") -> None:
    """Fail with every problem of these findings' sentences."""
    found = [problem for finding in findings for problem in problems(finding)]
    assert not found, f"sentences a reader cannot check{f' ({where})' if where else ''}:\n" + "\n".join(found)


def check_summary(summary: dict, where: str = "") -> None:
    """Every finding a final_summary.json holds (its findings and its hang's)."""
    check_findings(summary.get("findings") or [], where)


# --- sums and shares, redone on the figures as shown -------------------------------------------

def _value(text: str) -> Shown:
    match = NUMBER.search(text)
    assert match is not None, text
    return Shown(match)


def _close(total: Shown, parts: Sequence[Tuple[int, Shown]], what: str) -> List[str]:
    """Whether the signed parts add up to the shown total within their digits and its own."""
    added = sum(sign * part.base_value for sign, part in parts)
    slack = total.slack + sum(part.slack for _, part in parts)
    if abs(added - total.base_value) > slack:
        shown = " ".join(f"{'+' if sign > 0 else '-'} {part.text}" for sign, part in parts)
        return [f"{what}: {shown} is not {total.text}"]
    return []


def _ratio(part: Shown, base: Shown, shown_share: Shown, what: str) -> List[str]:
    """Whether part / base gives the shown share, within the digits of all three."""
    low = (part.base_value - part.slack) / (base.base_value + base.slack) if base.base_value + base.slack else math.inf
    high = (part.base_value + part.slack) / max(base.base_value - base.slack, 1e-12)
    if not low - shown_share.slack <= shown_share.base_value <= high + shown_share.slack:
        return [f"{what}: {part.text} of {base.text} is not {shown_share.text}"]
    return []


OF_STEP = re.compile(r"is (?P<share>\d+%) of the step: (?P<part>[\d.]+ ms) of (?P<base>[\d.]+ ms)")


def _of_step_adds_up(summary: str, evidence: dict) -> List[str]:
    match = OF_STEP.search(summary)
    if match is None:
        return [] if evidence.get("periodic") else ["no \"X% of the step: A ms of B ms\""]
    return _ratio(_value(match["part"]), _value(match["base"]), _value(match["share"]), "share of the step")


def _compute_adds_up(summary: str, evidence: dict) -> List[str]:
    match = re.search(r"is (\d+%) of the step.*\(forward (\d+%), backward (\d+%), optimizer (\d+%)"
                      r"(?:, less (\d+%) waiting in collectives)?\)", summary)
    if match is None:
        return ["no parts of the compute share"]
    parts = [(1, _value(match[i])) for i in (2, 3, 4)] + ([(-1, _value(match[5]))] if match[5] else [])
    return _close(_value(match[1]), parts, "compute's parts")


SOME = re.compile(r"(?P<regular>\d+) of about (?P<typical>[\d.]+ ms)(?:, (?:one|\d+) of (?P<outliers>[^:;]*?))?"
                  r"(?:,? against|:|,? and|$)")
AT_STEP = re.compile(r"([\d.]+ m?s) (?:at step \d+|after the last step)")


def _occurrences(summary: str, count_text: Optional[str], typical_text: Optional[str]) -> Tuple[int, Shown, List[Shown]]:
    """(how many typical, the typical figure, the outliers) as the sentence shows them."""
    match = SOME.search(summary)
    if match is not None:
        outliers = [_value(text) for text in AT_STEP.findall(match["outliers"] or "")]
        return int(match["regular"]), _value(match["typical"]), outliers
    if typical_text is None:  # one occurrence, or all alike: "402 ms at step 500"
        figure = re.search(r"[\d.]+ m?s", summary)
        typical_text = figure[0] if figure else "0 ms"
    return int(count_text or 1), _value(typical_text), []


def _spikes_add_up(summary: str, evidence: dict) -> List[str]:
    """STEP_SPIKES: the slow steps' time over the median makes their cost, their share of the steps."""
    plain = re.search(r"(\d+) steps? takes? (?:about )?([\d.]+ ms) against", summary)
    regular, typical, outliers = _occurrences(summary, plain and plain[1], plain and plain[2])
    median = _value(re.search(r"against a median of ([\d.]+ ms)", summary)[1])
    cost = re.search(r"costs? ([\d.]+ m?s) over the median step, ([\d.]+%) of the ([\d.]+ m?s) of measured steps",
                     summary)
    if cost is None:
        return ["no cost over the median with its base"]
    total, shown_share, base = _value(cost[1]), _value(cost[2]), _value(cost[3])
    parts = [(regular, typical), (-regular, median)] + [p for o in outliers for p in ((1, o), (-1, median))]
    return _weighted(total, parts, "slow steps' excess") + _ratio(total, base, shown_share, "cost's share")


def _weighted(total: Shown, parts: Sequence[Tuple[int, Shown]], what: str) -> List[str]:
    added = sum(weight * part.base_value for weight, part in parts)
    slack = total.slack + sum(abs(weight) * part.slack for weight, part in parts)
    if abs(added - total.base_value) > slack:
        return [f"{what}: {' '.join(f'{w:+d} x {p.text}' for w, p in parts)} is not {total.text}"]
    return []


def _periodic_adds_up(summary: str, evidence: dict) -> List[str]:
    """A finding told by its stalls' period: their time in the part makes the share of the steps."""
    plain = re.search(r"takes ([\d.]+ ms) in (\d+) steps? against", summary)
    regular, typical, outliers = _occurrences(summary, plain and plain[2], plain and plain[1])
    told = re.search(r": ([\d.]+ m?s), ([\d.]+%) of the ([\d.]+ m?s) of measured steps", summary)
    if told is None:
        return ["no stalls' time with its base"]
    total, shown_share, base = _value(told[1]), _value(told[2]), _value(told[3])
    return (_weighted(total, [(regular, typical)] + [(1, o) for o in outliers], "stalls' time")
            + _ratio(total, base, shown_share, "stalls' share"))


def _share_based(summary: str, evidence: dict) -> List[str]:
    return _periodic_adds_up(summary, evidence) if evidence.get("periodic") else _of_step_adds_up(summary, evidence)


def _startup_adds_up(summary: str, evidence: dict) -> List[str]:
    # The parts come before the named code ("; 16.8 s in run.py:57 (module level), ..."), which
    # says where the same seconds went, not more of them.
    match = re.search(r"startup takes ([\d.]+ s), (\d+%) of the ([\d.]+ s) run, before the first step"
                      r"(?:: ([^;]*))?(?:; .*)?$", summary)
    if match is None:
        return ["no startup with its base"]
    total = _value(match[1])
    found = _ratio(total, _value(match[3]), _value(match[2]), "startup's share")
    if match[4]:
        parts = [_value(text) for text in re.findall(r"(?<![\w.])(\d+\.\d s)\b", match[4])]
        found += _close(total, [(1, part) for part in parts], "startup's parts")
    return found


def _recompilation_adds_up(summary: str, evidence: dict) -> List[str]:
    match = re.search(r"\), ([\d.]+ s), ([\d.]+%) of the ([\d.]+ m?s) run", summary)
    if match is None:
        return ["no recompilation time with its base"]
    return _ratio(_value(match[1]), _value(match[3]), _value(match[2]), "recompilations' share")


def _comm_adds_up(summary: str, evidence: dict) -> List[str]:
    match = re.search(r"waits ([\d.]+ ms) for collectives \((\d+%) of the ([\d.]+ ms) step\)", summary)
    if match is None:
        return ["no collectives' wait with its base"]
    total = _value(match[1])
    found = _ratio(total, _value(match[3]), _value(match[2]), "collectives' share")
    parts = re.findall(r"([\d.]+ ms) in (?:forward's|backward|the optimizer)", summary)
    if parts:
        found += _close(total, [(1, _value(part)) for part in parts], "collectives' parts")
    return found


def _straggler_adds_up(summary: str, evidence: dict) -> List[str]:
    match = re.search(r"wait ([\d.]+ ms) a step for it \((\d+%) of the ([\d.]+ ms) step\)", summary)
    if match is None:
        return ["no wait with its base"]
    return _ratio(_value(match[1]), _value(match[3]), _value(match[2]), "the others' wait")


def _host_sync_adds_up(summary: str, evidence: dict) -> List[str]:
    match = re.search(r"waits ([\d.]+ ms) a step for the GPU, (\d+%) of the ([\d.]+ ms) step", summary)
    if match is None:
        return ["no host wait with its base"]
    return _ratio(_value(match[1]), _value(match[3]), _value(match[2]), "the host's wait")


def _pressure_adds_up(summary: str, evidence: dict) -> List[str]:
    match = re.search(r"peaks at (\d+%) of capacity: ([\d.]+ \w+) of ([\d.]+ \w+), ([\d.]+ \w+) of headroom", summary)
    if match is None:
        return [] if evidence.get("oom") else ["no peak with its capacity"]
    peak, capacity = _value(match[2]), _value(match[3])
    return (_ratio(peak, capacity, _value(match[1]), "the peak's share")
            + _close(capacity, [(1, peak), (1, _value(match[4]))], "peak and headroom"))


def _creep_adds_up(summary: str, evidence: dict) -> List[str]:
    match = re.search(r"grows ([\d.]+ \w+) a step \(([\d.]+ \w+) over ([\d,]+) steps?\)", summary)
    if match is None:
        return ["no growth a step with its steps"]
    slope, growth, steps = _value(match[1]), _value(match[2]), _value(match[3])
    return _weighted(growth, [(int(steps.value), slope)], "growth over the steps")


def _planned_adds_up(summary: str, evidence: dict) -> List[str]:
    """"evaluated 5 times (every 10 steps): 4 of about 36 ms, one of 402 ms at step 500, and 402 ms
    elsewhere: 948 ms, 3.2% of the 29.4 s run": the parts make the total, the total its share."""
    match = re.search(r"(once|twice|\d+ times)(?: \([^)]*\))?(?:: (.*?))?(?:,? and ([\d.]+ m?s) elsewhere)?: "
                      r"([\d.]+ m?s), ([\d.]+%) of the ([\d.]+ m?s) run", summary)
    if match is None:
        return ["not \"N times: K of about X ms, ... : T ms, P% of the R s run\""]
    said = {"once": 1, "twice": 2}.get(match[1]) or int(match[1].split()[0])
    total, amounts = _value(match[4]), match[2] or ""
    found = _ratio(total, _value(match[6]), _value(match[5]), "planned work's share")
    if not amounts and not match[3]:
        return found  # one occurrence: the total says it
    each = re.fullmatch(r"about ([\d.]+ m?s) each", amounts)
    if each is not None:
        regular, typical, outliers = said, _value(each[1]), []
    elif SOME.search(amounts):
        regular, typical, outliers = _occurrences(amounts, None, None)
    else:
        regular, typical, outliers = said, _value(amounts or "0 ms"), []
    parts = [(regular, typical)] + [(1, o) for o in outliers] + ([(1, _value(match[3]))] if match[3] else [])
    if regular + len(outliers) != said:
        found.append(f"{regular} + {len(outliers)} occurrences are not {match[1]}")
    return found + _weighted(total, parts, "planned work's parts")


ADDS_UP: Dict[str, Sequence[Callable[[str, dict], List[str]]]] = {
    "INPUT_BOUND": (_share_based,), "H2D_BOUND": (_share_based,), "UNTRACED_WORK": (_share_based,),
    "GC_PRESSURE": (_share_based,), "COMPUTE_BOUND": (_of_step_adds_up, _compute_adds_up),
    "STEP_SPIKES": (_spikes_add_up,), "EVAL_HEAVY": (_planned_adds_up,), "CHECKPOINT_STALL": (_planned_adds_up,),
    "SLOW_STARTUP": (_startup_adds_up,), "RECOMPILATION": (_recompilation_adds_up,), "COMM_BOUND": (_comm_adds_up,),
    "INPUT_STRAGGLER": (_straggler_adds_up,), "COMPUTE_STRAGGLER": (_straggler_adds_up,),
    "STRAGGLER": (_straggler_adds_up,), "HOST_SYNC": (_host_sync_adds_up,), "MEMORY_PRESSURE": (_pressure_adds_up,),
    "MEMORY_CREEP": (_creep_adds_up,),
}
