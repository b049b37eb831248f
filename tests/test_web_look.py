"""What a person sees: the dashboard read as a person would, in a real browser, on a 2-rank
compute-straggler run with a slow warm-up step (live mid-run, then through `traceml view`), at
two window widths; and the text views off a terminal, where no number or path may be cut.

The browser checks read every Plotly chart's data and layout and fail on a value on an axis
whose unit it is not, an axis without a unit, a percentage that does not say what 100% is, an
element over a legend entry or a title, a colour scale stretched by a few cells (its maximum
over 3x its 99th percentile), and a page wider than the window. Full-page screenshots are kept
in test-artifacts/ for a person to look at.
"""
import json
import math
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import TRAIN_LOOP, _env, ended_well
from test_web import get, read_url
from traceml.views.summary import PHASE_LABELS, SEVERITY_COLOURS

# One worker for the module: its 2-rank run and the pages looked at are made once (conftest.py).
pytestmark = pytest.mark.xdist_group("web_look")

ROOT = Path(__file__).parent.parent
ARTIFACTS = Path(os.environ.get("TRACEML_ARTIFACTS", ROOT / "test-artifacts"))
CHROMIUM = "/usr/bin/chromium"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--no-first-run"]
WIDTHS_PX = (1400, 1000, 700)  # a wide window, a laptop beside an editor, a narrow one
# At most, and far more than a look takes even on a loaded machine: the fixture stops the run
# once it has looked at the live page, so the page is always seen mid-run.
STEPS = 20000
WARMUP_MS = 1000  # the first step's stall: a compile, an autotune, a cold cache
STRAGGLER_BUSY_MS = 10  # rank 1's longer forward every step

# A DDP loop (gloo, CPU) whose rank 1 computes longer in forward every step and whose first
# forward stalls on every rank, as a first step does under torch.compile or cudnn autotuning.
# It ends early, every rank at the same step, once the file given after --stop-when exists.
STRAGGLER_SCRIPT = f'''
import os, sys, time
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import traceml


class Net(nn.Module):
    def __init__(self, busy_s):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
        self.busy_s, self.stall_s = busy_s, {WARMUP_MS} / 1000

    def forward(self, inputs):
        if self.stall_s:  # the first call only
            time.sleep(self.stall_s)
            self.stall_s = 0.0
        # As a rank waits on a slower device: the page is judged here, not the rule (test_distributed
        # spins real CPU for that), and a sleep costs the suite no CPU while the browser looks.
        time.sleep(self.busy_s)
        return self.body(inputs)


torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(Net({STRAGGLER_BUSY_MS} / 1000 if rank == 1 else 0.0))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
steps = int(sys.argv[sys.argv.index("--steps") + 1])
stop_file = sys.argv[sys.argv.index("--stop-when") + 1]
for step in range(steps):
    if step % 50 == 0:
        stop = torch.tensor([float(os.path.exists(stop_file))])
        dist.all_reduce(stop)
        if stop.item():
            break
    inputs, targets = torch.randn(8, 32), torch.randint(0, 10, (8,))
    with traceml.trace_step(model):
        loss = nn.functional.cross_entropy(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
print(f"rank {{rank}} stopped at step {{step}}", flush=True)
dist.barrier()
'''

# Everything a person reads on each chart: its data, its axes, and where its words are drawn.
LOOK_JS = """() => {
  const severityColours = Object.fromEntries(['crit', 'warn', 'info'].map(
    (s) => [s, getComputedStyle(document.documentElement).getPropertyValue('--' + s).trim()]));
  const box = (e) => { const b = e.getBoundingClientRect(); return { l: b.left, t: b.top, r: b.right, b: b.bottom }; };
  const charts = [];
  for (const div of document.querySelectorAll('.js-plotly-plot')) {
    if (!div._fullLayout || div.offsetParent === null) continue;  // not drawn, or hidden
    const fl = div._fullLayout;
    const axes = {};
    for (const key of Object.keys(fl)) {
      if (!/^[xy]axis\\d*$/.test(key)) continue;
      const a = fl[key];
      axes[a._id] = { title: (a.title && a.title.text) || '', type: a.type, range: a.range,
                      ticktext: (a._vals || []).map((v) => v.text) };
    }
    const list = (v) => (v && v.length !== undefined ? Array.from(v) : null);
    const traces = div._fullData.map((t) => ({
      name: t.name, type: t.type, visible: t.visible, orientation: t.orientation || 'v',
      x: list(t.x), y: list(t.y), z: t.z ? t.z.map((row) => Array.from(row)) : null,
      xaxis: t.xaxis, yaxis: t.yaxis, stacked: Boolean(t.stackgroup) || fl.barmode === 'stack',
      zmax: t.zmax, hovertemplate: t.hovertemplate || '',
      colorbar: t.colorbar && t.colorbar.title ? t.colorbar.title.text : null }));
    const words = [];
    const add = (kind, selector, root, entry) => (root || div).querySelectorAll(selector).forEach((e) => {
      const b = box(e);
      if (b.r - b.l > 0.5 && b.b - b.t > 0.5) words.push(Object.assign({ kind, text: e.textContent, entry }, b));
    });
    // A legend entry is its symbol and its name: the two may touch, nothing else may.
    div.querySelectorAll('.legend .traces').forEach((item, i) => {
      add('legend', '.legendtext', item, i);
      add('legend', '.legendsymbols', item, i);
    });
    add('modebar', '.modebar');
    add('title', '.gtitle, .xtitle, .ytitle, .y2title, .cbtitle text');
    add('tick', '.xtick text, .ytick text, .y2tick text, .colorbar g[class$="tick"] text');
    add('annotation', '.annotation');
    const d = box(div);
    const s = fl._size;
    charts.push({ id: div.id, div: d, axes, traces, words,
                  plot: { l: d.l + s.l, t: d.t + s.t, r: d.l + s.l + s.w, b: d.t + s.t + s.h } });
  }
  // Whatever reaches past its card's padding: a table or chart wider than the room it was given.
  const overflows = [];
  for (const card of document.querySelectorAll('.card')) {
    const style = getComputedStyle(card);
    const right = box(card).r - parseFloat(style.paddingRight) - parseFloat(style.borderRightWidth);
    const past = (e) => { const b = box(e); return b.r - b.l > 0 && b.r > right + 1; };
    for (const e of card.querySelectorAll('*')) {
      const inside = e.parentElement.closest('.table-wrap, .js-plotly-plot');  // scrolls, or drawn by Plotly
      const b = box(e);
      if (!inside && past(e) && !past(e.parentElement)) {  // the outermost one that does
        overflows.push(card.id + ': ' + e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') + ' ends ' +
                       Math.round(b.r - right) + ' px past its card');
      }
    }
  }
  const text = (id) => (document.getElementById(id) || {}).textContent || '';
  return { charts, overflows, severity_colours: severityColours, page_width: document.documentElement.scrollWidth, window_width: window.innerWidth,
           live: text('live-status'), steps_seen: Number(text('steps-seen')), rank_verdict: text('rank-verdict'),
           phases_note: text('chart-phases-note'), heatmap_note: text('chart-rank-heatmap-note'),
           rank_memory: Array.from(document.querySelectorAll('#rank-memory tbody tr')).map((r) => r.textContent) };
}"""

BYTES_UNITS = {"KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}
UNIT_PATTERN = re.compile(r"(?<![\w])(ms|KiB|MiB|GiB|TiB|seconds|steps?)(?![\w])|%")
OTHER_QUANTITY = re.compile(r"bytes|rss|memory|MiB|GiB|%", re.IGNORECASE)


def unit_of(title):
    """The one unit an axis title names ('ms per step' is in ms: per step is the rate), or the
    list of them when it names several quantities."""
    found = {"step" if m.group(0) == "steps" else m.group(0) for m in UNIT_PATTERN.finditer(title)}
    if len(found) > 1:
        found.discard("step")  # "ms per step", "% of the step": step is the denominator
    return found.pop() if len(found) == 1 else sorted(found)


def p99(values):
    """The nearest-rank 99th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def plotted(trace):
    """A trace's values along its value axis, and that axis: y, or x for horizontal bars."""
    if trace["type"] == "bar" and trace["orientation"] == "h":
        return trace["x"] or [], "x" + trace["xaxis"][1:]
    return trace["y"] or [], trace["yaxis"]


def axis_values(chart, axis_id):
    """What an axis shows: the values of the visible traces on it, stacked ones summed."""
    stacks, single = {}, []
    for trace in chart["traces"]:
        if trace["visible"] is not True or trace["type"] == "heatmap":
            continue
        values, axis = plotted(trace)
        if axis != axis_id:
            continue
        numbers = [v if isinstance(v, (int, float)) else None for v in values]
        if trace["stacked"]:
            for index, value in enumerate(numbers):
                stacks[index] = stacks.get(index, 0.0) + (value or 0.0)
        else:
            single += [v for v in numbers if v is not None]
    return single + list(stacks.values())


def unit_problems(chart, facts):
    """A value on an axis whose unit it is not; an axis with data and no unit; a percentage
    that does not say what 100% is."""
    problems = []
    if chart["id"].startswith("chart-scalar-"):  # a user's scalar: its axis says which, in its units
        names = [trace["name"] for trace in chart["traces"]]
        if len(names) != 1 or chart["axes"]["y"]["title"] != names[0]:
            problems.append(f"{chart['id']}: scalars {names} on an axis titled {chart['axes']['y']['title']!r}")
        return problems
    for axis_id, axis in chart["axes"].items():
        values = axis_values(chart, axis_id)
        if axis["type"] == "category" or not values:
            continue
        where = f"{chart['id']} {axis_id} {axis['title']!r}"
        unit = unit_of(axis["title"])
        if not isinstance(unit, str):
            problems.append(f"{where}: names {unit or 'no unit'}, not one")
            continue
        top = max(values)
        if unit == "ms" and top > facts.max_step_ms * 1.05:
            problems.append(f"{where}: {top:,.1f} on an ms axis; no step took over {facts.max_step_ms:.1f} ms")
        if unit == "%":
            if "% of" not in axis["title"]:
                problems.append(f"{where}: a percentage that does not say what 100% is")
            if top > 100.5 or min(values) < 0:
                problems.append(f"{where}: {top:.1f} on a % axis, beyond 100%")
        if unit in BYTES_UNITS and top * BYTES_UNITS[unit] > facts.max_memory_bytes * 1.05:
            problems.append(f"{where}: {top:,.1f} {unit}, more memory than the node has")
        if unit == "seconds" and top > facts.duration_s + 60:
            problems.append(f"{where}: {top:,.1f} s, longer than the run")
        # Categories on a value axis' chart name what they are: none may be another quantity.
        for other in chart["axes"].values():
            if other["type"] == "category" and unit == "ms":
                odd = [text for text in other["ticktext"] if OTHER_QUANTITY.search(text)]
                if odd:
                    problems.append(f"{where}: categories {odd} are not times")
        for trace in chart["traces"]:
            said = re.search(r"\}\s?(ms|KiB|MiB|GiB|%)", trace["hovertemplate"])
            if said and plotted(trace)[1] == axis_id and trace["visible"] is True and said.group(1) != unit:
                problems.append(f"{where}: {trace['name']!r} is in {said.group(1)}")
    for trace in chart["traces"]:
        if trace["type"] == "heatmap":
            cells = [v for row in trace["z"] for v in row if isinstance(v, (int, float))]
            if unit_of(trace["colorbar"] or "") != "ms":
                problems.append(f"{chart['id']}: a colour scale titled {trace['colorbar']!r}, no unit")
            elif cells and max(cells) > facts.max_step_ms * 1.05:
                problems.append(f"{chart['id']}: a {max(cells):.1f} ms cell, longer than any step")
    return problems


def overlap(a, b, tolerance_px=1.0):
    return (min(a["r"], b["r"]) - max(a["l"], b["l"]) > tolerance_px
            and min(a["b"], b["b"]) - max(a["t"], b["t"]) > tolerance_px)


def layout_problems(chart):
    """Words drawn over words: a legend entry, title or annotation under the mode bar, a tick
    label or another legend entry; a legend over the plotted data or outside its chart."""
    problems = []
    words = chart["words"]
    for index, word in enumerate(words):
        if word["kind"] not in ("legend", "title", "annotation"):
            continue
        for other in words[index + 1:] + words[:index]:
            if word["kind"] == other["kind"] == "legend" and word["entry"] == other["entry"]:
                continue
            if overlap(word, other):
                problems.append(f"{chart['id']}: {word['kind']} {word['text']!r} under {other['kind']} {other['text']!r}")
        if word["kind"] == "legend":
            if overlap(word, chart["plot"]):
                problems.append(f"{chart['id']}: legend {word['text']!r} drawn over the data")
            inside = (word["l"] >= chart["div"]["l"] - 1 and word["r"] <= chart["div"]["r"] + 1
                      and word["t"] >= chart["div"]["t"] - 1 and word["b"] <= chart["div"]["b"] + 1)
            if not inside:
                problems.append(f"{chart['id']}: legend {word['text']!r} outside its chart")
    for tick in (w for w in words if w["kind"] == "tick"):
        for bar in (w for w in words if w["kind"] == "modebar"):
            if overlap(tick, bar):
                problems.append(f"{chart['id']}: tick label {tick['text']!r} under the mode bar")
    return sorted(set(problems))


def colour_problems(chart):
    """A colour scale whose top is more than 3x the 99th percentile of its cells: a few cells
    (a warm-up step) would leave all the others one colour."""
    problems = []
    for trace in chart["traces"]:
        if trace["type"] != "heatmap":
            continue
        cells = [v for row in trace["z"] for v in row if isinstance(v, (int, float))]
        top = trace["zmax"] if isinstance(trace["zmax"], (int, float)) else max(cells)
        if cells and top > 3 * p99(cells):
            problems.append(f"{chart['id']}: colours run to {top:.1f}, {top / p99(cells):.1f}x the p99 {p99(cells):.1f}")
    return problems


def page_problems(look, facts):
    problems = []
    if look["page_width"] > look["window_width"] + 1:
        problems.append(f"the page is {look['page_width']} px wide in a {look['window_width']} px window")
    problems += look["overflows"]
    for chart in look["charts"]:
        problems += unit_problems(chart, facts) + layout_problems(chart) + colour_problems(chart)
    return problems


def chart(look, chart_id):
    return next(c for c in look["charts"] if c["id"] == chart_id)


# -- the run, looked at live, then finished --------------------------------------------------------
def browser_available():
    if Path(CHROMIUM).exists():
        return True
    assert not os.environ.get("TRACEML_REQUIRE_BROWSER"), "Debian's chromium is required here"
    return False


def look_at(page, name):
    """The page at each width: what the charts show, and a full-page screenshot to look at."""
    looks = {}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for width in WIDTHS_PX:
        page.set_viewport_size({"width": width, "height": 1000})
        page.wait_for_timeout(1500)  # Plotly redraws on the resize
        looks[width] = page.evaluate(LOOK_JS)
        page.screenshot(path=str(ARTIFACTS / f"{name}-{width}.png"), full_page=True)
    return looks


def ready(page):
    page.wait_for_selector('body[data-rendered="1"]', timeout=60000)
    page.wait_for_function("['chart-rank-phases', 'chart-rank-heatmap', 'chart-system']"
                           ".every((id) => (document.getElementById(id).data || []).length > 0)", timeout=60000)


def run_facts(run_dir):
    """The bounds any honest figure of this run lies within."""
    summary = json.loads((run_dir / "final_summary.json").read_text())
    with sqlite3.connect(run_dir / "telemetry.sqlite") as db:
        max_step_ms = db.execute("SELECT MAX(step_ms) FROM steps").fetchone()[0]
    return SimpleNamespace(max_step_ms=max_step_ms, duration_s=summary["run"]["duration_s"],
                           max_memory_bytes=summary["system"]["ram_total_bytes"], summary=summary)


@pytest.fixture(scope="module")
def straggler(tmp_path_factory):
    """The 2-rank run under `traceml run --mode dashboard`, its live page looked at mid-run."""
    tmp = tmp_path_factory.mktemp("look")
    script = tmp / "ddp_straggler.py"
    script.write_text(STRAGGLER_SCRIPT)
    run_dir, stop_file = tmp / "straggler", tmp / "looked"
    process = subprocess.Popen(
        [sys.executable, "-m", "traceml", "run", "--mode", "dashboard", "--port", "0", "--nproc-per-node", "2",
         "--run-dir", str(run_dir), str(script), "--steps", str(STEPS), "--stop-when", str(stop_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp, env=_env())
    live = None
    try:
        base, _ = read_url(process)
        if browser_available():
            from playwright.sync_api import sync_playwright

            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
                page = browser.new_page(viewport={"width": WIDTHS_PX[0], "height": 1000})
                page.goto(base)
                page.wait_for_function("Number(document.querySelector('#steps-seen').textContent) >= 100",
                                       timeout=90000)
                ready(page)
                live = look_at(page, "look-live")
                live["api_steps_seen"] = get(base, "/api/overview")["steps_seen"]
                browser.close()
        stop_file.touch()
        stdout, stderr = process.communicate(timeout=240)
    finally:
        process.kill()
    assert ended_well(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)), stderr
    return SimpleNamespace(run_dir=run_dir, stdout=stdout, live=live, tmp=tmp, script=script,
                           facts=run_facts(run_dir))


@pytest.fixture(scope="module")
def viewed(straggler):
    """The finished run reopened with `traceml view`, looked at at each width."""
    if not browser_available():
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    process = subprocess.Popen([sys.executable, "-m", "traceml", "view", str(straggler.run_dir), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        base, _ = read_url(process, timeout_s=30)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            page = browser.new_page(viewport={"width": WIDTHS_PX[0], "height": 1000})
            errors = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(base)
            ready(page)
            looks = look_at(page, "look-view")
            browser.close()
    finally:
        process.kill()
        process.communicate()
    assert not errors, errors
    return looks


def test_the_live_page_mid_run_reads_as_it_should(straggler):
    if straggler.live is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    for width in WIDTHS_PX:
        look = straggler.live[width]
        assert look["live"] == "live" and 100 <= look["steps_seen"] <= straggler.live["api_steps_seen"] < STEPS
        problems = page_problems(look, straggler.facts)
        assert not problems, f"at {width} px:\n" + "\n".join(problems)


@pytest.mark.parametrize("width", WIDTHS_PX)
def test_traceml_view_of_the_run_reads_as_it_should(straggler, viewed, width):
    look = viewed[width]
    assert look["live"] == "finished"
    ids = {c["id"] for c in look["charts"]}
    assert {"chart-phases", "chart-timeline", "chart-rank-phases", "chart-rank-heatmap", "chart-memory",
            "chart-system", "chart-system-memory"} <= ids
    problems = page_problems(look, straggler.facts)
    assert not problems, "\n".join(problems)
    assert look["severity_colours"] == dict(SEVERITY_COLOURS)  # the server's, not the page's own


def test_the_ranks_panel_shows_the_straggler_at_a_glance(straggler, viewed):
    look = viewed[WIDTHS_PX[0]]
    assert look["rank_verdict"].startswith("Straggler: rank 1 computes longer")
    bars = chart(look, "chart-rank-phases")
    by_name = {trace["name"]: dict(zip(trace["x"], trace["y"])) for trace in bars["traces"]}
    assert list(by_name["forward"]) == ["rank 0", "rank 1 (straggler)"]
    # Rank 1 computes ~10 ms more in forward; rank 0 spends that time waiting for it.
    assert by_name["forward"]["rank 1 (straggler)"] > by_name["forward"]["rank 0"] + 0.6 * STRAGGLER_BUSY_MS
    assert by_name["comm wait"]["rank 0"] > by_name["comm wait"]["rank 1 (straggler)"] + 0.6 * STRAGGLER_BUSY_MS
    # Memory is in a table of its own, in bytes' units, not on the time axis.
    assert any(row.startswith("host RSS") and "MiB" in row for row in look["rank_memory"])
    heat = chart(look, "chart-rank-heatmap")["traces"][0]
    assert heat["y"] == ["rank 0", "rank 1 (straggler)"]
    rows = [[v for v in row[10:] if v is not None] for row in heat["z"]]
    own_rank0, own_rank1 = (sum(row) / len(row) for row in rows)
    assert own_rank1 > 3 * own_rank0  # the straggler's row is the bright one
    assert "rank the others wait for" in look["heatmap_note"]


def test_a_warm_up_stall_neither_sets_the_colours_nor_flattens_the_steps(straggler, viewed):
    look = viewed[WIDTHS_PX[0]]
    heat = chart(look, "chart-rank-heatmap")["traces"][0]
    # The first bucket holds step 0's stall among its steps (how many grows with the run, which
    # goes on until the page has been looked at: longer on a loaded machine).
    bucket_steps = heat["x"][1] - heat["x"][0]
    first_cells = [row[0] for row in heat["z"]]
    assert min(first_cells) > 0.4 * WARMUP_MS / bucket_steps  # the stall is in the data...
    assert heat["zmax"] < min(WARMUP_MS / 6, min(first_cells))  # ...and the colours stop below it, and say so
    ticks = [w["text"] for w in chart(look, "chart-rank-heatmap")["words"] if w["kind"] == "tick"]
    assert any(text.startswith("≥") and text.endswith("(p99)") for text in ticks), ticks
    # The y axis stops at the settled steps' own times (tens of ms; up to 140 seen on a busy
    # machine, whose spikes are steps too), below the stall, which the note names.
    assert chart(look, "chart-phases")["axes"]["y"]["range"][1] < 0.8 * WARMUP_MS
    assert "step 0" in look["phases_note"] and "double-click" in look["phases_note"]


def test_cpu_is_a_share_of_the_whole_machine(straggler, viewed):
    cpu = chart(viewed[WIDTHS_PX[0]], "chart-system")
    cores = os.cpu_count()
    assert cpu["axes"]["y"]["title"] == f"CPU (% of all {cores} cores)"
    names = {trace["name"] for trace in cpu["traces"]}
    assert names == {"whole machine", "training processes"}
    assert all(v <= 100.0 for trace in cpu["traces"] for v in trace["y"] if v is not None)


# -- text views off a terminal ---------------------------------------------------------------------
CUT_NUMBER = re.compile(r"[\d.%+-]…")  # a figure rich cut short: "-19.…", "+261…"


@pytest.fixture(scope="module")
def single(straggler):
    """A one-rank run beside the straggler, for `traceml compare`."""
    run_dir = straggler.tmp / "single-rank-slow-loader"
    process = subprocess.run(
        [sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir", str(run_dir),
         str(TRAIN_LOOP), "--steps", "120", "--load-ms", "3"],
        capture_output=True, text=True, timeout=180, cwd=straggler.tmp, env=_env())
    assert process.returncode == 0, process.stderr
    return SimpleNamespace(run_dir=run_dir, stdout=process.stdout)


def test_compare_into_a_file_keeps_every_figure_and_path_whole(straggler, single):
    command = [sys.executable, "-m", "traceml", "compare", str(straggler.run_dir), str(single.run_dir)]
    out = straggler.tmp / "compare.txt"
    with out.open("w") as file:  # `traceml compare A B > out.txt`: not a terminal
        subprocess.run(command, stdout=file, stderr=subprocess.PIPE, text=True, timeout=120, check=True, env=_env())
    text = out.read_text()
    result = json.loads(subprocess.run(command + ["--json"], capture_output=True, text=True, timeout=120,
                                       check=True, env=_env()).stdout)
    assert not CUT_NUMBER.search(text), CUT_NUMBER.search(text)
    words = set(text.split())
    for row in [result["step"]] + list(result["phases"].values()):
        interval = [f"{end:+.2f}" for end in row["ci_ms"] or []]
        for figure in [f"{row['median_a_ms']:.2f}", f"{row['median_b_ms']:.2f}", f"{row['delta_ms']:+.2f}", *interval]:
            assert figure in words, figure
    # A phase that grows from nothing has no percent: the loader's wait, absent from the DDP loop.
    assert result["phases"]["input_wait"]["median_a_ms"] == 0 and result["phases"]["input_wait"]["delta_share"] is None
    # Backward grows twentyfold from the one-rank run to the straggler's: thousands of percent, whole.
    reverse_command = command[:-2] + [str(single.run_dir), str(straggler.run_dir)]
    backwards = subprocess.run(reverse_command, capture_output=True, text=True, timeout=120, check=True,
                               env=_env()).stdout
    reverse = json.loads(subprocess.run(reverse_command + ["--json"], capture_output=True, text=True, timeout=120,
                                        check=True, env=_env()).stdout)
    largest = max((row["delta_share"] for row in reverse["phases"].values() if row["delta_share"] is not None),
                  key=abs)
    assert largest > 10 and f"{largest:+.0%}" in set(backwards.split())
    lines = text.splitlines()
    for path in (str(straggler.run_dir), str(single.run_dir), str(straggler.script), str(TRAIN_LOOP)):
        assert any(path in line for line in lines), f"{path} is not whole on one line"


def test_the_card_off_a_terminal_keeps_every_figure_whole(straggler, single):
    for card, summary in ((straggler.stdout, straggler.facts.summary),
                          ((straggler.run_dir / "final_summary.txt").read_text(), straggler.facts.summary),
                          (single.stdout, json.loads((single.run_dir / "final_summary.json").read_text()))):
        assert "Verdict" in card and not CUT_NUMBER.search(card), CUT_NUMBER.search(card)
        words = set(re.findall(r"[^\s│]+", card))
        for name, stats in summary["phases"].items():
            if name != "step":
                assert f"{stats['median_ms']:.2f}" in words and f"{stats['share']:.1%}" in words, name
        for name, spread in summary["rank_spread"].items():
            if name in PHASE_LABELS and (name == "step" or spread["worst"] > 0):
                assert f"{spread['worst']:.2f}" in words, name


def test_print_comparison_gives_a_long_path_the_width_it_needs(straggler, single, tmp_path):
    from traceml.report.compare import ComparedRun, compare
    from traceml.views.compare import print_comparison

    long_name = tmp_path / ("a-run-directory-whose-name-alone-is-longer-than-a-terminal-is-wide-"
                            "as-long-names-from-sweeps-are")
    long_name.symlink_to(straggler.run_dir)
    result = compare(ComparedRun.load(long_name), ComparedRun.load(single.run_dir))
    out = tmp_path / "compare.txt"
    with out.open("w") as file:
        print_comparison(result, file)
    text = out.read_text()
    assert any(str(long_name) in line for line in text.splitlines())
    assert "A median ms" in text and not CUT_NUMBER.search(text)  # the full table, uncut


# -- a rank that reports late ----------------------------------------------------------------------
def test_a_rank_whose_first_steps_arrive_late_still_fills_its_row(tmp_path):
    """Live, one rank's records can reach the store after another's: the buckets read before
    they came must not leave a hole at the start of that rank's heatmap row (or in the means)."""
    from traceml.collector.store import Store
    from traceml.records import RankHello, StepRecord
    from traceml.report import queries

    store = Store(str(tmp_path / "telemetry.sqlite"))
    store.write([RankHello(1, 1, 2, 0, "h", 1, "cpu", "cpu", None, "2", ["x"], 0.0)])  # rank 0: not yet

    def steps(rank, first, last):
        # 10 ms steps; rank 0 waits 6 ms of them in backward for rank 1, which waits 1 ms.
        store.write([StepRecord(rank, step, step * 0.01, 10.0, 1, 1, 0, 3, 4, 1, 0, 0, 0, 1, 8,
                                comm_wait_ms=6.0 if rank == 0 else 1.0) for step in range(first, last)])
        store.commit()

    steps(1, 0, 40)
    reader = Store(store.path, readonly=True)
    own_time, step_buckets = queries.own_time_buckets(reader), queries.step_buckets(reader)
    own_time.refresh()
    step_buckets.refresh()
    store.write([RankHello(0, 0, 2, 0, "h", 1, "cpu", "cpu", None, "2", ["x"], 0.0)])
    steps(0, 0, 60)
    steps(1, 40, 60)
    own_time.refresh()
    step_buckets.refresh()
    heatmap = queries.rank_heatmap(own_time)
    assert heatmap["own_ms"] == [[4.0] * 60, [9.0] * 60] and heatmap["comm_wait_measured"]
    assert queries.step_series(step_buckets, {})["phases"]["backward"] == [4.0] * 60
    store.close()
