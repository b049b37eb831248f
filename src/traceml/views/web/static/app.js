// TraceML dashboard: reads the local /api/* JSON, renders overview, charts and tables, and follows a live run.
'use strict';

const PALETTE = ['#4c78a8', '#f58518', '#54a24b', '#e45756', '#72b7b2', '#b279a2', '#eeca3b', '#9d755d', '#ff9da6'];
// User spans on the timeline: colours no phase has, so a span never reads as a phase.
const SPAN_PALETTE = ['#17becf', '#bcbd22', '#8c564b', '#393b79', '#637939', '#843c39'];
const WAITING = 'waiting for steps…';
const LAYERS_HINT = 'Run with `traceml run --deep` or call traceml.trace_model_instance(model) for per-layer figures.';
const CHART_EVERY_MS = 2000;
const LAYERS_EVERY_MS = 5000;
const POLL_EVERY_MS = 2000;
// Selection tools mean nothing on these charts; fewer buttons keep the mode bar short.
const PLOT_CONFIG = { responsive: true, displaylogo: false, modeBarButtonsToRemove: ['select2d', 'lasso2d'] };
// Legends sit below the x axis, where Plotly's mode bar (top right, on hover) never covers
// them; the bottom margin grows to hold however many rows they wrap to.
const LEGEND = { orientation: 'h', x: 0, xanchor: 'left', y: 0, yanchor: 'bottom', yref: 'container', traceorder: 'normal' };
// The top margin leaves the mode bar room above the plot and its top tick labels.
const MARGIN = { l: 60, r: 20, t: 36, b: 10 };
const OFF_SCALE = 2; // a chart's scale stops near its 99th percentile once the maximum is this far above it

const state = {
  // How the phases are named, coloured and ordered: the server's one table (/api/phases), read
  // before anything is drawn. Without it a phase shows by its own name, in grey.
  phases: { labels: {}, colours: {}, order: [], step_phases: [], overlapping_phases: [] },
  overview: null,
  layers: null,
  layerSort: { key: '_total', desc: true },
  ended: false,
  initialFinal: false, // the first overview already said "not live": the loaded data is final
  source: null,
  pollTimer: null,
  timeline: null, // the last /api/timeline answer
};

// ---------- small helpers ----------

const $ = (id) => document.getElementById(id);
const isNum = (v) => typeof v === 'number' && isFinite(v);
const fmtMs = (v) => (isNum(v) ? v.toFixed(1) + ' ms' : '–');
const fmtPct = (v) => (isNum(v) ? (v * 100).toFixed(1) + '%' : '–');
const mib = (b) => (isNum(b) ? (b / 1048576).toFixed(1) : '–');
const label = (p) => state.phases.labels[p] || p.replace(/_/g, ' ');
const colour = (p) => state.phases.colours[p] || '#999';
const hasData = (arr) => Array.isArray(arr) && arr.some(isNum);

function fmtBytes(b) {
  if (!isNum(b)) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (Math.abs(b) >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return (i === 0 ? String(b) : b.toFixed(1)) + ' ' + units[i];
}

// One unit per axis, picked from its largest value, so tick labels stay short.
function byteUnit(values) {
  const max = values.reduce((m, v) => (isNum(v) && v > m ? v : m), 0);
  return max >= 2 * 1073741824 ? { name: 'GiB', div: 1073741824 } : { name: 'MiB', div: 1048576 };
}
const scaled = (arr, unit) => arr.map((v) => (isNum(v) ? v / unit.div : null));

function fmtValue(v) {
  if (!isNum(v)) return v === null || v === undefined ? '–' : String(v);
  return Number.isInteger(v) ? String(v) : String(+v.toPrecision(4));
}

// A finding's evidence as a person reads it: shares as percentages, times in ms, sizes in
// bytes' units; the unit leaves the name once the value carries it.
function evidenceItem(key, value) {
  if (isNum(value) && /(^|_)share$/.test(key)) return [key.replace(/_/g, ' '), fmtPct(value)];
  if (isNum(value) && /_ms$/.test(key)) return [key.slice(0, -3).replace(/_/g, ' '), +value.toPrecision(4) + ' ms'];
  if (isNum(value) && /_bytes$/.test(key)) return [key.slice(0, -6).replace(/_/g, ' '), fmtBytes(value)];
  return [key.replace(/_/g, ' '), fmtValue(value)];
}

// The value 99% of `values` lie at or below (the lower of the two nearest ranks): one warm-up
// step or a lone spike does not set a chart's scale.
function p99(values) {
  const sorted = values.filter(isNum).sort((a, b) => a - b);
  return sorted.length ? sorted[Math.floor(0.99 * (sorted.length - 1))] : null;
}

function setNote(id, text) {
  const n = $(id + '-note');
  if (!n) return;
  n.textContent = text || '';
  n.hidden = !text;
}

function make(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}

function setMsg(id, text, isError) {
  const m = $(id + '-msg');
  if (!m) return;
  m.textContent = text || '';
  m.hidden = !text;
  m.classList.toggle('error', Boolean(isError));
}

async function getJSON(path) {
  const r = await fetch(path, { cache: 'no-store' });
  if (!r.ok) throw new Error('HTTP ' + r.status);
  return r.json();
}

// Fetch + render one endpoint; any failure (network or a render bug) becomes a message in the
// sections it feeds, so one bad endpoint never blanks the page.
async function load(path, render, msgIds) {
  try {
    render(await getJSON(path));
  } catch (err) {
    console.warn('traceml:', path, err);
    msgIds.forEach((id) => setMsg(id, 'could not load ' + path.split('?')[0] + ': ' + err.message, true));
  }
}

function layout(extra) {
  const out = Object.assign({
    font: { family: 'system-ui, sans-serif', size: 12, color: '#1f2328' },
    paper_bgcolor: 'rgba(0,0,0,0)',
    plot_bgcolor: 'rgba(0,0,0,0)',
    uirevision: 'keep', // keeps the user's zoom and legend toggles across live refreshes
  }, extra);
  out.margin = Object.assign({}, MARGIN, extra.margin);
  out.legend = Object.assign({}, LEGEND, extra.legend);
  // Long tick labels (phase names, rank rows) grow the margin instead of being clipped.
  for (const k of Object.keys(out)) if (/^[xy]axis\d*$/.test(k)) out[k] = Object.assign({ automargin: true }, out[k]);
  return out;
}

// Draws a chart, or (emptyText set) clears it and says why; resolves true once drawn.
function plot(id, traces, lay, emptyText) {
  const div = $(id);
  if (typeof Plotly === 'undefined') {
    setMsg(id, 'charts unavailable: /assets/plotly.min.js did not load', true);
    return Promise.resolve(false);
  }
  if (emptyText) {
    Plotly.purge(div);
    div.classList.add('empty');
    setMsg(id, emptyText);
    return Promise.resolve(false);
  }
  div.classList.remove('empty');
  setMsg(id, '');
  return Plotly.react(div, traces, lay, PLOT_CONFIG).then(() => true);
}

// Runs fn at most once per `ms` and never twice at once; requests in between coalesce into one.
function throttled(fn, ms) {
  let last = Date.now(); // the initial load has just fetched everything
  let timer = null;
  let running = false;
  let again = false;
  async function run() {
    timer = null;
    running = true;
    last = Date.now();
    try { await fn(); } finally {
      running = false;
      if (again) { again = false; request(); }
    }
  }
  function request() {
    if (state.ended) return;
    if (running) { again = true; return; }
    if (!timer) timer = setTimeout(run, Math.max(0, last + ms - Date.now()));
  }
  return request;
}

// ---------- overview ----------

function setLive(live) {
  const pill = $('live-status');
  const on = Boolean(live) && !state.ended;
  pill.textContent = on ? 'live' : 'finished';
  pill.className = 'pill ' + (on ? 'live' : 'finished');
}

function renderOverview(ov) {
  state.overview = ov;
  setMsg('overview', '');
  const script = ov.script || '';
  $('title').textContent = 'TraceML · ' + script;
  document.title = 'TraceML · ' + script;
  setLive(ov.live);
  $('run-dir').textContent = ov.run_dir || '';

  const verdict = $('verdict');
  const primary = ov.primary;
  verdict.textContent = primary ? String(primary.kind) : 'no verdict yet';
  verdict.className = 'badge ' + (primary ? primary.severity : 'none');
  if (primary) verdict.title = primary.summary || '';

  $('steps-seen').textContent = String(isNum(ov.steps_seen) ? ov.steps_seen : 0);
  const step = ov.step || {};
  $('step-median').textContent = fmtMs(step.median_ms);
  $('step-p90').textContent = isNum(step.p90_ms) ? 'p90 ' + fmtMs(step.p90_ms) : '';
  const tp = ov.throughput || {};
  let tpText = isNum(tp.steps_per_s) ? tp.steps_per_s.toFixed(2) + ' steps/s' : '–';
  if (isNum(tp.samples_per_s)) tpText += ' · ' + tp.samples_per_s.toFixed(1) + ' samples/s';
  $('throughput').textContent = tpText;
  renderGoodput(ov.goodput);

  const info = [];
  if (isNum(ov.elapsed_s)) info.push('elapsed ' + ov.elapsed_s.toFixed(0) + ' s');
  if (isNum(ov.world_size)) info.push(ov.world_size + (ov.world_size === 1 ? ' rank' : ' ranks'));
  if (Array.isArray(ov.devices) && ov.devices.length) info.push(ov.devices.join(', '));
  if (isNum(ov.exit_code)) info.push('exit code ' + ov.exit_code);
  $('run-info').textContent = info.join(' · ');

  renderFindings(ov.findings || []);
  // Where the untimed time goes, in the user's code (sampled stacks): a line a part.
  $('untimed').replaceChildren(...(ov.untimed || []).map((line) => make('div', 'untimed', 'untimed: ' + line)));
  renderBreakdown(ov.phases || {});
}

// Goodput: the training share of the run's wall time, and the other parts largest first.
function renderGoodput(goodput) {
  if (!goodput || !goodput.training) {
    $('goodput').textContent = '–';
    $('goodput-rest').textContent = '';
    return;
  }
  $('goodput').textContent = (goodput.training.share * 100).toFixed(0) + '%';
  const rest = ['startup', 'evaluation', 'checkpoint', 'other']
    .filter((part) => goodput[part] && goodput[part].share >= 0.005)
    .sort((a, b) => goodput[b].share - goodput[a].share)
    .map((part) => part + ' ' + (goodput[part].share * 100).toFixed(0) + '% (' + goodput[part].seconds.toFixed(1) + ' s)');
  $('goodput-rest').textContent = rest.join(' · ');
}

function renderFindings(findings) {
  const box = $('findings');
  box.textContent = '';
  for (const f of findings) {
    const card = make('div', 'finding ' + (f.severity || 'info'));
    card.dataset.kind = f.kind;
    const head = make('div', 'head');
    head.append(make('span', 'kind', String(f.kind)));
    if (isNum(f.rank)) head.append(make('span', 'muted', 'rank ' + f.rank));
    head.append(make('span', 'summary', f.summary || ''));
    card.append(head);
    if (f.action) card.append(make('div', 'action', 'Next: ' + f.action));
    const ev = f.evidence || {};
    // A capture that found no layer grown tells nothing: final_summary.json keeps it.
    if (ev.captured_layers && ev.captured_grown) card.append(make('div', 'captured', 'Captured ' + ev.captured_layers));
    // The capture is told above in words, or not at all: never as bare figures.
    const keys = Object.keys(ev).filter((k) => !k.startsWith('captured_'));
    if (keys.length) {
      const dl = make('dl', 'evidence');
      for (const k of keys) {
        const [name, value] = evidenceItem(k, ev[k]);
        const row = make('div', value.length > 40 ? 'long' : null); // a sentence takes a whole row
        row.append(make('dt', null, name), make('dd', null, value));
        dl.append(row);
      }
      card.append(dl);
    }
    box.append(card);
  }
}

function renderBreakdown(phases) {
  const box = $('phase-breakdown');
  box.textContent = '';
  const order = state.phases.order;
  const names = order.concat(Object.keys(phases).filter((p) => !order.includes(p)));
  const present = names.filter((p) => phases[p]);
  if (!present.length) { box.append(make('p', 'msg', WAITING)); return; }
  // gc overlaps the other phases, so only the step phases make up the 100% bar.
  const bar = make('div', 'stackbar');
  for (const p of state.phases.step_phases) {
    const share = phases[p] && phases[p].share;
    if (!isNum(share) || share <= 0) continue;
    const seg = make('span');
    seg.style.width = (share * 100) + '%';
    seg.style.background = colour(p);
    seg.title = label(p) + ' ' + fmtPct(share);
    bar.append(seg);
  }
  const table = make('table', 'data');
  const head = make('tr');
  head.append(make('th', 'text', 'phase'), make('th', null, 'median ms'), make('th', null, 'mean ms'), make('th', null, 'share'));
  table.appendChild(make('thead')).append(head);
  const body = table.appendChild(make('tbody'));
  for (const p of present) {
    const ph = phases[p];
    const tr = make('tr');
    tr.dataset.phase = p;
    const name = make('td', 'text');
    const sw = make('span', 'swatch');
    sw.style.background = colour(p);
    name.append(sw, label(p));
    // Two decimals, as the card has them: sub-millisecond steps are common on small models.
    tr.append(name, make('td', null, isNum(ph.median_ms) ? ph.median_ms.toFixed(2) : '–'),
      make('td', null, isNum(ph.mean_ms) ? ph.mean_ms.toFixed(2) : '–'), make('td', null, fmtPct(ph.share)));
    body.append(tr);
  }
  box.append(bar, table);
}

// ---------- per-step charts ----------

function renderSteps(s) {
  const empty = !s || !Array.isArray(s.step) || s.step.length === 0;
  plot('chart-phases', ...(empty ? [[], {}, WAITING] : phaseChart(s))).then(() => {
    // Tests (and anyone scripting the page) wait on this; an empty run also counts as rendered.
    if (typeof Plotly !== 'undefined') document.body.dataset.rendered = '1';
  }, (err) => setMsg('chart-phases', 'chart failed: ' + err, true));
  plot('chart-memory', ...(empty ? [[], {}, WAITING] : memoryChart(s)));
}

function phaseChart(s) {
  const x = s.step;
  const ph = s.phases || {};
  const traces = state.phases.step_phases.filter((p) => Array.isArray(ph[p])).map((p) => ({
    type: 'scatter', mode: 'lines', name: label(p), x, y: ph[p], stackgroup: 'step',
    line: { width: 0.5, color: colour(p) }, fillcolor: colour(p),
    hovertemplate: '%{y:.2f} ms',
  }));
  // Overlapping phases (gc) happen inside the others: a dashed line over the stack, not a layer of it.
  for (const p of state.phases.overlapping_phases.filter((p) => Array.isArray(ph[p]))) {
    traces.push({ type: 'scatter', mode: 'lines', name: label(p), x, y: ph[p],
      line: { color: colour(p), dash: 'dash', width: 1.5 }, hovertemplate: '%{y:.2f} ms' });
  }
  if (Array.isArray(s.step_max_ms)) {
    traces.push({ type: 'scatter', mode: 'lines', name: 'step max', x, y: s.step_max_ms, visible: 'legendonly',
      line: { color: '#444', dash: 'dot', width: 1 }, hovertemplate: '%{y:.2f} ms' });
  }
  const per = s.bucket_steps > 1 ? ' (mean of ' + s.bucket_steps + ' steps per point)' : '';
  const yaxis = { title: { text: 'ms per step' }, rangemode: 'tozero' };
  const top = robustTop(x, s.step_ms, s.warmup_steps || 0);
  if (top) yaxis.range = [0, top.limit];
  setNote('chart-phases', top ? offScaleNote(top) : '');
  return [traces, layout({ hovermode: 'x unified', xaxis: { title: { text: 'step' + per } }, yaxis })];
}

// Where a chart's scale stops when a few points would flatten the rest: above every step after
// warm-up, unless a lone spike among them is far above the 99th percentile too; null when all fit.
function robustTop(steps, values, warmupSteps) {
  const maxOf = (list) => list.reduce((m, v) => (isNum(v) && v > m ? v : m), 0);
  const settled = values.filter((v, i) => steps[i] >= warmupSteps);
  const high = p99(settled.length ? settled : values);
  if (!isNum(high) || high <= 0 || maxOf(values) <= OFF_SCALE * high) return null;
  const settledMax = maxOf(settled);
  const limit = 1.05 * (settledMax <= OFF_SCALE * high ? settledMax : 1.1 * high);
  const off = steps.map((step, i) => [step, values[i]]).filter(([, v]) => isNum(v) && v > limit);
  return { limit, off };
}

function offScaleNote(top) {
  const shown = top.off.slice(0, 3).map(([step, v]) => 'step ' + step + ' (' + fmtMs(v) + ')');
  const more = top.off.length > 3 ? ' and ' + (top.off.length - 3) + ' more' : '';
  return 'Above the scale: ' + shown.join(', ') + more + '. The scale stops at ' + fmtMs(top.limit) +
    ' so the other steps stay readable; double-click the chart to see everything.';
}

// A dashed capacity line; when it is far above the data it would flatten every other line, so it
// then starts hidden behind its legend entry (one click shows it).
function capacityTrace(name, bytes, xEnds, unit, data, color, axis) {
  const max = data.reduce((a, v) => (isNum(v) && v > a ? v : a), 0);
  return { type: 'scatter', mode: 'lines', name: name + ' ' + fmtBytes(bytes), x: xEnds, yaxis: axis,
    y: [bytes / unit.div, bytes / unit.div], line: { color, dash: 'dash', width: 1 }, hoverinfo: 'skip',
    visible: max >= 0.25 * bytes ? true : 'legendonly' };
}

function memoryChart(s) {
  const m = s.memory || {};
  const cap = s.capacity || {};
  const x = s.step;
  const xEnds = [x[0], x[x.length - 1]];
  const dev = [['device_allocated_bytes', 'allocated', '#4c78a8'], ['device_peak_bytes', 'peak', '#e45756'],
    ['device_reserved_bytes', 'reserved', '#72b7b2']].filter((d) => hasData(m[d[0]]));
  const hasHost = hasData(m.host_rss_bytes);
  if (!dev.length && !hasHost) return [[], {}, 'no memory samples yet'];

  const traces = [];
  const lay = layout({ hovermode: 'x unified', xaxis: { title: { text: 'step' } } });
  if (dev.length) {
    const values = [].concat(...dev.map((d) => m[d[0]]));
    const unit = byteUnit(values);
    for (const [key, name, color] of dev) {
      traces.push({ type: 'scatter', mode: 'lines', name, x, y: scaled(m[key], unit), line: { color },
        hovertemplate: '%{y:.2f} ' + unit.name });
    }
    if (isNum(cap.device_bytes)) traces.push(capacityTrace('device capacity', cap.device_bytes, xEnds, unit, values, '#d62728', 'y'));
    lay.yaxis = { title: { text: 'device memory (' + unit.name + ')' }, rangemode: 'tozero' };
  }
  if (hasHost) {
    // With device data too, host RSS gets its own right-hand axis: the scales differ.
    const axis = dev.length ? 'y2' : 'y';
    const unit = byteUnit(m.host_rss_bytes);
    traces.push({ type: 'scatter', mode: 'lines', name: 'host RSS', x, y: scaled(m.host_rss_bytes, unit), yaxis: axis,
      line: { color: '#9d755d' }, hovertemplate: '%{y:.2f} ' + unit.name });
    if (isNum(cap.host_bytes)) traces.push(capacityTrace('host RAM', cap.host_bytes, xEnds, unit, m.host_rss_bytes, '#9d755d', axis));
    const title = { text: 'host RSS (' + unit.name + ')' };
    if (dev.length) {
      lay.yaxis2 = { title, overlaying: 'y', side: 'right', rangemode: 'tozero', showgrid: false, tickmode: 'auto', automargin: true };
      lay.margin = Object.assign({}, MARGIN, { r: 60 });
    } else {
      lay.yaxis = { title, rangemode: 'tozero' };
    }
  }
  return [traces, lay];
}

// ---------- the memory ledger ----------

// One colour per part, in the order the bars stack them (analysis.ledger.LEDGER_PARTS).
const LEDGER_COLOURS = {
  parameters_frozen: '#9ecae9', parameters_trainable: '#4c78a8', gradients: '#f58518', optimizer_state: '#e45756',
  activations: '#54a24b', rest: '#bab0ac', cache: '#d6d6d6',
};

// What a bar's length is, by how the rank's memory was measured (the ledger row's measured_on):
// a person reading a bar that is mostly "the rest" needs to know what the rest is.
const LEDGER_MEASURES = {
  device_peak: "Each bar is the rank's device memory at its fullest step (peak allocated): the rest is what "
    + 'else was allocated then, beyond the parts counted; the cache is what the allocator reserved beyond that.',
  host_rss: "Each bar is the rank's host RSS at its highest: the rest is what the process holds beyond the "
    + "parts counted (the interpreter, torch's libraries, the DataLoader's buffers).",
};

// The ledger's note: how the bars were measured, and which step the activations are from.
function ledgerNote(rows) {
  const measures = [...new Set(rows.map((r) => r.measured_on))];
  const said = measures.map((m) => LEDGER_MEASURES[m] || 'No memory figure from the steps yet: the bars are the parts counted alone.');
  const first = rows[0];
  said.push(isNum(first.activations_step)
    ? 'Activations: saved for backward at the peak of step ' + first.activations_step + ', the latest sampled.'
    : 'Activations: not measured yet (they come with a sampled step).');
  return said.join(' ');
}

function renderMemoryLedger(data) {
  const rows = data.ledger || [];
  const words = data.words || {};
  const adapters = $('ledger-adapters');
  const withAdapters = rows.filter((r) => r.adapters);
  adapters.textContent = withAdapters.map((r) => (rows.length > 1 ? 'rank ' + r.rank + ': ' : '') + r.adapters).join(' · ');
  adapters.hidden = !withAdapters.length;
  if (!rows.length) {
    const empty = 'no ledger yet: it comes with the first steps';
    setNote('chart-ledger', '');
    plot('chart-ledger', [], {}, empty);
    plot('chart-ledger-history', [], {}, empty);
    return;
  }
  setNote('chart-ledger', ledgerNote(rows));
  const unit = byteUnit(rows.map((r) => Object.values(r.parts).reduce((a, b) => a + b, 0)));
  const ranks = rows.map((r) => 'rank ' + r.rank);
  const bars = data.parts.filter((p) => rows.some((r) => isNum(r.parts[p]))).map((p) => ({
    type: 'bar', orientation: 'h', name: words[p] || p, y: ranks, x: rows.map((r) => (isNum(r.parts[p]) ? r.parts[p] / unit.div : null)),
    marker: { color: LEDGER_COLOURS[p] }, hovertemplate: '%{x:.2f} ' + unit.name + '<extra>' + (words[p] || p) + '</extra>',
  }));
  plot('chart-ledger', bars, layout({ barmode: 'stack', xaxis: { title: { text: unit.name }, rangemode: 'tozero' },
    yaxis: { autorange: 'reversed' } }));
  // Over steps: the first rank's readings (each sent when a figure moved), its counted parts stacked.
  const first = rows[0].rank;
  const history = (data.history || []).filter((h) => h.rank === first);
  const counted = data.parts.filter((p) => history.some((h) => isNum(h[p])));
  if (!history.length) {
    plot('chart-ledger-history', [], {}, 'no readings over steps yet');
    return;
  }
  const historyUnit = byteUnit(history.map((h) => counted.reduce((a, p) => a + (h[p] || 0), 0)));
  // Markers as well as lines: the readings are few, and the latest (often the first sampled
  // step's activations) would otherwise be a bare edge at the chart's right border.
  const lines = counted.map((p) => ({
    type: 'scatter', mode: 'lines+markers', stackgroup: 'ledger', line: { shape: 'hv', color: LEDGER_COLOURS[p] },
    marker: { size: 4, color: LEDGER_COLOURS[p] }, name: words[p] || p,
    x: history.map((h) => h.step), y: history.map((h) => (isNum(h[p]) ? h[p] / historyUnit.div : 0)),
    hovertemplate: '%{y:.2f} ' + historyUnit.name,
  }));
  plot('chart-ledger-history', lines, layout({ hovermode: 'x unified', xaxis: { title: { text: 'step (rank ' + first + ')' } },
    yaxis: { title: { text: historyUnit.name }, rangemode: 'tozero' } }));
}

// ---------- timeline ----------

function renderTimeline(tl) {
  state.timeline = tl; // drawn again when the window's width changes: its height depends on it
  const steps = tl.steps || [];
  const spans = tl.spans || [];
  if (!steps.length && !spans.length) { plot('chart-timeline', [], {}, WAITING); return; }
  const starts = steps.map((s) => s.start_unix_s).concat(spans.map((s) => s.start_unix_s)).filter(isNum);
  const t0 = starts.reduce((a, b) => Math.min(a, b), Infinity);
  const ranks = (tl.ranks && tl.ranks.length ? tl.ranks : steps.map((s) => s.rank))
    .filter((r, i, a) => a.indexOf(r) === i).sort((a, b) => a - b);
  const rows = [];
  for (const r of ranks) {
    rows.push('rank ' + r);
    if (spans.length) rows.push('rank ' + r + ' spans');
  }
  const order = tl.order || [];
  const byPhase = {};
  for (const p of order) byPhase[p] = { x: [], base: [], y: [], customdata: [] };
  for (const st of steps) {
    let cursor = (st.start_unix_s - t0) * 1000;
    for (const p of order) {
      const ms = (st.phases || {})[p];
      if (!isNum(ms) || ms <= 0) continue;
      const b = byPhase[p];
      b.x.push(ms); b.base.push(cursor); b.y.push('rank ' + st.rank); b.customdata.push([st.step, ms]);
      cursor += ms;
    }
  }
  const traces = order.filter((p) => byPhase[p].x.length).map((p) => Object.assign({
    type: 'bar', orientation: 'h', name: label(p), marker: { color: colour(p) },
    hovertemplate: 'step %{customdata[0]}<br>' + label(p) + ': %{customdata[1]:.2f} ms<extra>%{y}</extra>',
  }, byPhase[p]));

  const names = spans.map((s) => s.name).filter((n, i, a) => a.indexOf(n) === i);
  names.forEach((name, i) => {
    const mine = spans.filter((s) => s.name === name);
    traces.push({
      type: 'bar', orientation: 'h', name: 'span: ' + name, marker: { color: SPAN_PALETTE[i % SPAN_PALETTE.length] },
      x: mine.map((s) => s.duration_ms), base: mine.map((s) => (s.start_unix_s - t0) * 1000),
      y: mine.map((s) => 'rank ' + s.rank + ' spans'), customdata: mine.map((s) => [s.step, s.duration_ms, s.count]),
      hovertemplate: 'step %{customdata[0]}<br>' + name + ': %{customdata[1]:.2f} ms (×%{customdata[2]})<extra>%{y}</extra>',
    });
  });
  // Its height follows its rows and its legend's rows (about 150 px an entry): set on the
  // element too, or a window resize (Plotly then reads the element's height) would shrink it
  // under its own legend.
  const perLegendRow = Math.max(1, Math.floor(($('chart-timeline').clientWidth || 900) / 150));
  const height = 130 + rows.length * 34 + Math.ceil(traces.length / perLegendRow) * 22;
  $('chart-timeline').style.height = height + 'px';
  plot('chart-timeline', traces, layout({
    barmode: 'overlay', bargap: 0.25, height,
    margin: { l: 100 },
    xaxis: { title: { text: 'ms since the earliest step shown' }, rangemode: 'tozero' },
    yaxis: { type: 'category', categoryorder: 'array', categoryarray: rows, autorange: 'reversed' },
  }));
}

// ---------- system ----------

const SYSTEM_CHARTS = ['chart-system', 'chart-system-gpu', 'chart-system-memory'];

function renderSystem(sys) {
  const t = sys.unix_s || [];
  if (!t.length) { SYSTEM_CHARTS.forEach((id) => plot(id, [], {}, 'waiting for system samples…')); return; }
  const x = t.map((v) => v - t[0]);
  plot('chart-system', ...cpuChart(sys, x));
  plot('chart-system-gpu', ...gpuChart(sys.gpus || [], x));
  plot('chart-system-memory', ...nodeMemoryChart(sys, x));
}

const secondsAxis = () => ({ title: { text: 'seconds since first sample' } });

// One scale for the machine and the training processes: % of all the node's cores, so 100% is
// the whole machine busy (psutil counts a process's use as % of one core: divided here).
function cpuChart(sys, x) {
  const cores = sys.cpu_count;
  const traces = [];
  const line = (name, y, color, dash) => {
    if (!hasData(y)) return;
    traces.push({ type: 'scatter', mode: 'lines', name, x, y, line: { color, dash, width: 1.5 },
      customdata: isNum(cores) ? y.map((v) => (isNum(v) ? (v / 100) * cores : null)) : undefined,
      hovertemplate: '%{y:.0f}%' + (isNum(cores) ? ' (%{customdata:.1f} cores)' : '') });
  };
  line('whole machine', sys.cpu_percent, '#4c78a8');
  if (isNum(cores)) {
    line('training processes', (sys.training_cpu_percent || []).map((v) => (isNum(v) ? v / cores : null)), '#72b7b2', 'dot');
  }
  if (!traces.length) return [[], {}, 'no CPU readings'];
  const of = isNum(cores) ? 'all ' + cores + (cores === 1 ? ' core' : ' cores') : 'all cores';
  return [traces, layout({
    hovermode: 'x unified', xaxis: secondsAxis(),
    yaxis: { title: { text: 'CPU (% of ' + of + ')' }, range: [0, 100] },
  })];
}

// Each GPU's utilisation is its own: 100% is that device busy all the time.
function gpuChart(gpus, x) {
  const traces = gpus.filter((g) => hasData(g.utilization_percent)).map((g, i) => ({
    type: 'scatter', mode: 'lines', name: 'GPU ' + g.index, x, y: g.utilization_percent,
    line: { color: PALETTE[(i + 1) % PALETTE.length], width: 1.5 }, hovertemplate: '%{y:.0f}%',
  }));
  if (!traces.length) return [[], {}, 'no GPUs on this node'];
  return [traces, layout({
    hovermode: 'x unified', xaxis: secondsAxis(),
    yaxis: { title: { text: 'GPU busy (% of each device)' }, range: [0, 100] },
  })];
}

function nodeMemoryChart(sys, x) {
  const gpus = (sys.gpus || []).filter((g) => hasData(g.memory_used_bytes));
  const series = [['RAM used', sys.ram_used_bytes, '#9d755d'], ['training RSS', sys.training_rss_bytes, '#b279a2', 'dot']]
    .concat(gpus.map((g, i) => ['GPU ' + g.index + ' memory', g.memory_used_bytes, PALETTE[(i + 1) % PALETTE.length]]))
    .filter((m) => hasData(m[1]));
  if (!series.length) return [[], {}, 'no memory readings'];
  const unit = byteUnit([].concat(...series.map((m) => m[1])));
  const traces = series.map(([name, y, color, dash]) => ({ type: 'scatter', mode: 'lines', name, x, y: scaled(y, unit),
    line: { color, dash, width: 1.5 }, hovertemplate: '%{y:.2f} ' + unit.name }));
  const xEnds = [x[0], x[x.length - 1]];
  if (isNum(sys.ram_total_bytes) && hasData(sys.ram_used_bytes)) {
    traces.push(capacityTrace('RAM total', sys.ram_total_bytes, xEnds, unit, sys.ram_used_bytes, '#9d755d', 'y'));
  }
  return [traces, layout({
    hovermode: 'x unified', xaxis: secondsAxis(),
    yaxis: { title: { text: 'memory (' + unit.name + ')' }, rangemode: 'tozero' },
  })];
}

// ---------- ranks ----------

const RANK_CHARTS = ['chart-rank-phases', 'chart-rank-heatmap'];
const rankName = (rank, straggler) => 'rank ' + rank + (rank === straggler ? ' (straggler)' : '');

function renderRanks(r) {
  const rows = (r.ranks || []).slice().sort((a, b) => a.rank - b.rank);
  const worldSize = state.overview && isNum(state.overview.world_size) ? state.overview.world_size : rows.length;
  let empty = '';
  if (rows.length === 0 && worldSize > 1) empty = WAITING;
  // Live, one rank has no rank table (nothing to compare): its world size says so.
  else if (rows.length <= 1 && worldSize <= 1) empty = 'single rank: nothing to compare across ranks';
  if (empty) {
    RANK_CHARTS.forEach((id) => { plot(id, [], {}, empty); setNote(id, ''); });
    $('rank-verdict').textContent = '';
    renderRankMemory({});
    return;
  }
  const straggler = isNum(r.straggler) ? r.straggler : null;
  // The straggler finding says who the others wait for and how long; the slowest step alone
  // would not (under DDP every rank's step lasts as long as the slowest's).
  const st = (r.spread || {}).step;
  let verdict = 'No straggler';
  if (straggler !== null) verdict = 'Straggler: ' + (r.straggler_summary || 'rank ' + straggler); // the summary names the rank
  else if (st) verdict += ': the median rank takes ' + fmtMs(st.median) + ' a step, the slowest ' + fmtMs(st.worst);
  $('rank-verdict').textContent = verdict;
  $('rank-verdict').classList.toggle('alert', straggler !== null);
  plot('chart-rank-phases', ...rankBars(rows, straggler));
  renderRankMemory(r.spread || {});
  plot('chart-rank-heatmap', ...rankHeatmap(r.heatmap || {}, straggler, r.warmup_steps || 0));
}

// Each rank's step, phase by phase (medians), stacked: under DDP and FSDP every rank's step lasts
// as long as the slowest's, so the time spent waiting in collectives is drawn apart from the
// phases it happens in; the rank the others wait for is the one that hardly waits.
function rankBars(rows, straggler) {
  const names = rows.map((row) => rankName(row.rank, straggler));
  const ms = (row, p) => row[p + '_median_ms'];
  const waits = rows.some((row) => isNum(row.comm_wait_median_ms));
  const traces = [];
  const bar = (name, y, color, what, pattern) => traces.push({ type: 'bar', name, x: names, y,
    marker: { color, pattern }, hovertemplate: '%{x}: %{y:.2f} ms<extra>' + what + '</extra>' });
  // The wait inside each phase (the server's split: FSDP's all-gathers in forward, ZeRO's in the
  // optimizer, the rest in backward), drawn apart from the phase's work.
  const within = (row, p) => (row.comm_wait_parts || {})[p] || 0;
  for (const p of state.phases.step_phases) {
    if (!rows.some((row) => isNum(ms(row, p)) && ms(row, p) > 0)) continue;
    if (waits && rows.some((row) => within(row, p) > 0)) {
      bar(label(p), rows.map((row) => Math.max(0, (ms(row, p) || 0) - within(row, p))), colour(p),
        p + ' less comm wait');
    } else {
      bar(label(p), rows.map((row) => ms(row, p)), colour(p), label(p));
    }
    if (p === 'backward' && waits) {
      // Hatched: time spent waiting, not working.
      bar(label('comm_wait'), rows.map((row) => row.comm_wait_median_ms), colour('comm_wait'),
        'comm wait: waiting in collectives for the other ranks and the wire', { shape: '/', fillmode: 'overlay', fgcolor: '#ffffff', size: 6 });
    }
  }
  if (!traces.length) return [[], {}, 'no per-rank figures yet'];
  return [traces, layout({
    barmode: 'stack', hovermode: 'closest',
    xaxis: { type: 'category', tickmode: 'array', tickvals: names,
      ticktext: names.map((n, i) => (rows[i].rank === straggler ? '<b>' + n + '</b>' : n)) },
    yaxis: { title: { text: 'ms per step (medians)' }, rangemode: 'tozero' },
  })];
}

// Memory is not time: the ranks' memory figures get a table of their own.
const RANK_MEMORY_LABELS = { host_rss_bytes: 'host RSS', device_peak_bytes: 'device peak' };

function renderRankMemory(spread) {
  const table = $('rank-memory');
  const tbody = table.tBodies[0];
  tbody.textContent = '';
  const keys = Object.keys(spread).filter((k) => /_bytes$/.test(k));
  for (const k of keys) {
    const m = spread[k];
    const tr = make('tr');
    tr.append(make('td', 'text', RANK_MEMORY_LABELS[k] || k.slice(0, -6).replace(/_/g, ' ')),
      make('td', null, fmtBytes(m.median)), make('td', null, fmtBytes(m.worst)), make('td', null, 'rank ' + m.worst_rank));
    tbody.append(tr);
  }
  table.hidden = !keys.length;
}

// Own time per rank and step: the step less the time the rank waited for the others. The colours
// stop at the 99th percentile of the steps after warm-up: the top of the colour bar says so.
function rankHeatmap(hm, straggler, warmupSteps) {
  const z = hm.own_ms || [];
  if (!z.some(hasData)) return [[], {}, WAITING];
  const steps = hm.step || [];
  const settled = [].concat(...z.map((row) => row.filter((v, i) => steps[i] >= warmupSteps)));
  const all = [].concat(...z);
  const top = p99(settled.some(isNum) ? settled : all);
  const max = all.reduce((m, v) => (isNum(v) && v > m ? v : m), 0);
  const what = hm.comm_wait_measured ? 'own time' : 'step time';
  const clipped = max > top;
  const tickvals = [0, 0.25, 0.5, 0.75, 1].map((f) => f * top);
  const ticktext = tickvals.map((v, i) => (clipped && i === 4 ? '≥ ' + v.toFixed(1) + ' (p99)' : v.toFixed(1)));
  setNote('chart-rank-heatmap', hm.comm_wait_measured
    ? 'Own time: each step less the time the rank waited for the others. The rank the others wait for is the bright row.'
    : 'Step time of each rank.');
  const names = (hm.ranks || []).map((k) => rankName(k, straggler));
  return [[{
    type: 'heatmap', x: steps, y: names, z, zmin: 0, zmax: top, zauto: false,
    colorscale: 'YlOrRd', reversescale: true,
    colorbar: { title: { text: what + ' (ms)', side: 'right' }, thickness: 12, tickvals, ticktext },
    hovertemplate: '%{y}, step %{x}: %{z:.2f} ms ' + what + '<extra></extra>',
  }], layout({
    margin: { l: 70 },
    xaxis: { title: { text: 'step' } },
    yaxis: { type: 'category', autorange: 'reversed' },
  })];
}

// ---------- layers ----------

const layerValue = (row, key) => (key === '_total' ? (row.forward_ms || 0) + (row.backward_ms || 0) : row[key]);

function renderLayers(data) {
  state.layers = data;
  const tbody = $('layers-table').tBodies[0];
  tbody.textContent = '';
  const meta = $('layers-meta');
  const dd = data.deep_dive;
  const rows = (data.layers || []).slice();
  if (!dd && !rows.length) { meta.textContent = ''; setMsg('layers-table', LAYERS_HINT); return; }
  const stepsWord = (n) => n + (n === 1 ? ' step' : ' steps');  // the card's words (traceml.words)
  meta.textContent = dd ? 'sampled ' + stepsWord(dd.sampled_steps) + ' (every ' +
    (dd.every_n_steps === 1 ? 'step' : stepsWord(dd.every_n_steps)) + ') · coverage forward ' +
    fmtPct(dd.forward_coverage) + ', backward ' + fmtPct(dd.backward_coverage) +
    (dd.coverage_note ? ' · ' + dd.coverage_note : '') : '';
  setMsg('layers-table', rows.length ? '' : 'no layers recorded yet');

  const { key, desc } = state.layerSort;
  rows.sort((a, b) => {
    const va = layerValue(a, key);
    const vb = layerValue(b, key);
    const c = typeof va === 'string' || typeof vb === 'string'
      ? String(va || '').localeCompare(String(vb || ''))
      : (isNum(va) ? va : -Infinity) - (isNum(vb) ? vb : -Infinity);
    return desc ? -c : c;
  });
  for (const l of rows) {
    const tr = make('tr', l.leaf === false ? 'container' : '');
    const name = make('td', 'text', l.name);
    if (l.type) name.append(' ', make('span', 'type', '(' + l.type + ')'));
    tr.append(name,
      make('td', null, isNum(l.calls_per_step) ? String(+l.calls_per_step.toFixed(2)) : '–'),
      make('td', null, isNum(l.forward_ms) ? l.forward_ms.toFixed(2) : '–'),
      make('td', null, isNum(l.backward_ms) ? l.backward_ms.toFixed(2) : '–'),
      make('td', null, mib(l.memory_bytes)), make('td', null, mib(l.output_bytes)), make('td', null, mib(l.alive_bytes)));
    tbody.append(tr);
  }
  for (const th of $('layers-table').tHead.rows[0].cells) {
    const on = th.dataset.key === key;
    th.classList.toggle('sorted', on);
    th.classList.toggle('desc', on && desc);
    th.classList.toggle('asc', on && !desc);
  }
}

function onLayerHeaderClick(ev) {
  const th = ev.target.closest('th[data-key]');
  if (!th) return;
  const s = state.layerSort;
  // A new column starts descending (largest cost first); the same column flips direction.
  state.layerSort = s.key === th.dataset.key ? { key: s.key, desc: !s.desc } : { key: th.dataset.key, desc: true };
  if (state.layers) renderLayers(state.layers);
}

// ---------- spans and scalars ----------

function renderSpans(data) {
  const tbody = $('spans-table').tBodies[0];
  tbody.textContent = '';
  const spans = (data.spans || []).slice().sort((a, b) => (b.total_ms || 0) - (a.total_ms || 0));
  setMsg('spans-table', spans.length ? '' : 'no user spans recorded');
  for (const s of spans) {
    const tr = make('tr');
    tr.append(make('td', 'text', s.name), make('td', null, String(s.count)),
      make('td', null, isNum(s.mean_ms) ? s.mean_ms.toFixed(2) : '–'),
      make('td', null, isNum(s.total_ms) ? s.total_ms.toFixed(1) : '–'), make('td', null, fmtPct(s.share)));
    tbody.append(tr);
  }
}

// One chart per scalar: a loss and a learning rate share nothing but their steps, so no axis
// carries two of them. Each axis is named after its scalar (the units are the user's).
function renderScalars(data) {
  const sc = data.scalars || {};
  const names = Object.keys(sc).filter((n) => sc[n] && Array.isArray(sc[n].step) && sc[n].step.length).sort();
  const box = $('chart-scalars');
  setMsg('chart-scalars', names.length ? '' : 'no scalars recorded');
  while (box.children.length > names.length) {
    if (typeof Plotly !== 'undefined') Plotly.purge(box.lastChild);
    box.lastChild.remove();
  }
  names.forEach((name, i) => {
    if (!box.children[i]) box.append(Object.assign(make('div', 'chart short'), { id: 'chart-scalar-' + i }));
    const y = sc[name].value;
    const yaxis = { title: { text: name } };
    // A constant (a fixed learning rate) would sit on a -1..1 axis and read as 0: centre it.
    const low = Math.min(...y.filter(isNum));
    const high = Math.max(...y.filter(isNum));
    if (low === high) yaxis.range = [low - (Math.abs(low) || 1) / 2, high + (Math.abs(high) || 1) / 2];
    plot(box.children[i].id, [{ type: 'scatter', mode: 'lines', name, x: sc[name].step, y,
      line: { color: PALETTE[i % PALETTE.length], width: 1.5 } }], layout({
      hovermode: 'x unified', showlegend: false, xaxis: { title: { text: 'step' } }, yaxis,
    }));
  });
}

// ---------- loading and live updates ----------

function refreshOverview() {
  return load('/api/overview', renderOverview, ['overview']);
}

function refreshCharts() {
  return Promise.all([
    load('/api/steps', renderSteps, ['chart-phases', 'chart-memory']),
    load('/api/timeline', renderTimeline, ['chart-timeline']),
    load('/api/system', renderSystem, SYSTEM_CHARTS),
    load('/api/ranks', renderRanks, RANK_CHARTS),
    load('/api/spans', renderSpans, ['spans-table']),
    load('/api/scalars', renderScalars, ['chart-scalars']),
    load('/api/memory', renderMemoryLedger, ['chart-ledger', 'chart-ledger-history']),
  ]);
}

function refreshLayers() {
  return load('/api/layers', renderLayers, ['layers-table']);
}

const chartsSoon = throttled(refreshCharts, CHART_EVERY_MS);
const layersSoon = throttled(refreshLayers, LAYERS_EVERY_MS);

function onOverview(ov) {
  try { renderOverview(ov); } catch (err) {
    console.warn('traceml: overview render', err);
    setMsg('overview', 'could not show the overview: ' + err.message, true);
    return;
  }
  if (ov.live) { chartsSoon(); layersSoon(); } else finish();
}

async function finish() {
  if (state.ended) return;
  state.ended = true;
  if (state.source) state.source.close();
  clearTimeout(state.pollTimer);
  setLive(false);
  if (!state.initialFinal) await Promise.all([refreshOverview(), refreshCharts(), refreshLayers()]);
}

// Used when the event stream is unavailable: poll the overview until the run stops being live.
function startPolling() {
  if (state.pollTimer || state.ended) return;
  const tick = async () => {
    try {
      const ov = await getJSON('/api/overview');
      $('conn-msg').hidden = true;
      onOverview(ov);
    } catch (err) {
      const m = $('conn-msg');
      m.textContent = 'lost contact with the server; retrying…';
      m.hidden = false;
    }
    if (!state.ended) state.pollTimer = setTimeout(tick, POLL_EVERY_MS);
  };
  state.pollTimer = setTimeout(tick, POLL_EVERY_MS);
}

function startStream() {
  if (state.ended) return;
  if (typeof EventSource === 'undefined') { startPolling(); return; }
  const es = new EventSource('/api/stream');
  state.source = es;
  es.addEventListener('overview', (e) => {
    let ov;
    try { ov = JSON.parse(e.data); } catch (err) { return; }
    onOverview(ov);
  });
  es.addEventListener('end', () => { es.close(); finish(); });
  // EventSource would reconnect on its own; polling is simpler to reason about and stops by itself.
  es.onerror = () => {
    es.close();
    if (!state.ended) startPolling();
  };
}

async function main() {
  $('layers-table').tHead.addEventListener('click', onLayerHeaderClick);
  let resizeTimer = null;
  window.addEventListener('resize', () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => { if (state.timeline) renderTimeline(state.timeline); }, 200);
  });
  await load('/api/phases', (phases) => {
    state.phases = phases;
    // The severities' colours are the server's too: the stylesheet's are only the fallback.
    for (const [severity, colour] of Object.entries(phases.severity_colours || {})) {
      document.documentElement.style.setProperty('--' + severity, colour);
    }
  }, ['conn']);
  await Promise.all([refreshOverview(), refreshCharts(), refreshLayers()]);
  state.initialFinal = Boolean(state.overview) && state.overview.live === false;
  startStream();
}

main().catch((err) => console.warn('traceml: start-up failed', err));
