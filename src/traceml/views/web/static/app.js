// TraceML dashboard: reads the local /api/* JSON, renders overview, charts and tables, and follows a live run.
'use strict';

const PALETTE = ['#4c78a8', '#f58518', '#54a24b', '#e45756', '#72b7b2', '#b279a2', '#eeca3b', '#9d755d', '#ff9da6'];
const WAITING = 'waiting for steps…';
const LAYERS_HINT = 'Run with `traceml run --deep` or call traceml.trace_model_instance(model) for per-layer figures.';
const CHART_EVERY_MS = 2000;
const LAYERS_EVERY_MS = 5000;
const POLL_EVERY_MS = 2000;
const PLOT_CONFIG = { responsive: true, displaylogo: false };

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
    margin: { l: 60, r: 20, t: 10, b: 45 },
    legend: { orientation: 'h', x: 0, y: 1.02, yanchor: 'bottom' },
    font: { family: 'system-ui, sans-serif', size: 12, color: '#1f2328' },
    paper_bgcolor: 'rgba(0,0,0,0)',
    plot_bgcolor: 'rgba(0,0,0,0)',
    uirevision: 'keep', // keeps the user's zoom and legend toggles across live refreshes
  }, extra);
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
  verdict.textContent = primary ? String(primary.kind).replace(/_/g, ' ') : 'no verdict yet';
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
    head.append(make('span', 'kind', String(f.kind).replace(/_/g, ' ')));
    if (isNum(f.rank)) head.append(make('span', 'muted', 'rank ' + f.rank));
    head.append(make('span', 'summary', f.summary || ''));
    card.append(head);
    if (f.action) card.append(make('div', 'action', 'Next: ' + f.action));
    const ev = f.evidence || {};
    if (ev.captured_layers) card.append(make('div', 'captured', 'Captured ' + ev.captured_layers));
    const keys = Object.keys(ev);
    if (keys.length) {
      const dl = make('dl', 'evidence');
      for (const k of keys) {
        const row = make('div');
        row.append(make('dt', null, k), make('dd', null, fmtValue(ev[k])));
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
    tr.append(name, make('td', null, isNum(ph.median_ms) ? ph.median_ms.toFixed(1) : '–'),
      make('td', null, isNum(ph.mean_ms) ? ph.mean_ms.toFixed(1) : '–'), make('td', null, fmtPct(ph.share)));
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
  return [traces, layout({
    hovermode: 'x unified',
    legend: { orientation: 'h', x: 0, y: 1.02, yanchor: 'bottom', traceorder: 'normal' },
    xaxis: { title: { text: 'step' + per } },
    yaxis: { title: { text: 'ms per step' }, rangemode: 'tozero' },
  })];
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
      lay.yaxis2 = { title, overlaying: 'y', side: 'right', rangemode: 'tozero', showgrid: false, tickmode: 'auto' };
      lay.margin = { l: 60, r: 60, t: 10, b: 45 };
    } else {
      lay.yaxis = { title, rangemode: 'tozero' };
    }
  }
  return [traces, lay];
}

// ---------- timeline ----------

function renderTimeline(tl) {
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
      type: 'bar', orientation: 'h', name: 'span: ' + name, marker: { color: PALETTE[(i + 5) % PALETTE.length] },
      x: mine.map((s) => s.duration_ms), base: mine.map((s) => (s.start_unix_s - t0) * 1000),
      y: mine.map((s) => 'rank ' + s.rank + ' spans'), customdata: mine.map((s) => [s.step, s.duration_ms, s.count]),
      hovertemplate: 'step %{customdata[0]}<br>' + name + ': %{customdata[1]:.2f} ms (×%{customdata[2]})<extra>%{y}</extra>',
    });
  });
  plot('chart-timeline', traces, layout({
    barmode: 'overlay', bargap: 0.25, height: 110 + rows.length * 34,
    margin: { l: 100, r: 20, t: 10, b: 45 },
    xaxis: { title: { text: 'ms since the earliest step shown' }, rangemode: 'tozero' },
    yaxis: { type: 'category', categoryorder: 'array', categoryarray: rows, autorange: 'reversed' },
  }));
}

// ---------- system ----------

function renderSystem(sys) {
  const t = sys.unix_s || [];
  if (!t.length) { plot('chart-system', [], {}, 'waiting for system samples…'); return; }
  const x = t.map((v) => v - t[0]);
  const gpus = sys.gpus || [];
  const memSeries = [sys.ram_used_bytes, sys.training_rss_bytes].concat(gpus.map((g) => g.memory_used_bytes));
  const unit = byteUnit([].concat(...memSeries.filter(Array.isArray)));
  const traces = [];
  const pct = (name, y, color, dash) => {
    if (hasData(y)) traces.push({ type: 'scatter', mode: 'lines', name, x, y, line: { color, dash, width: 1.5 },
      hovertemplate: '%{y:.0f}%' });
  };
  const mem = (name, y, color, dash) => {
    if (hasData(y)) traces.push({ type: 'scatter', mode: 'lines', name, x, y: scaled(y, unit), yaxis: 'y2',
      line: { color, dash, width: 1.5 }, hovertemplate: '%{y:.2f} ' + unit.name });
  };
  pct('CPU %', sys.cpu_percent, '#4c78a8');
  pct('training CPU %', sys.training_cpu_percent, '#72b7b2');
  mem('RAM used', sys.ram_used_bytes, '#9d755d');
  mem('training RSS', sys.training_rss_bytes, '#b279a2', 'dot');
  if (isNum(sys.ram_total_bytes) && hasData(sys.ram_used_bytes)) {
    traces.push(capacityTrace('RAM total', sys.ram_total_bytes, [x[0], x[x.length - 1]], unit, sys.ram_used_bytes, '#9d755d', 'y2'));
  }
  gpus.forEach((g, i) => {
    const color = PALETTE[(i + 1) % PALETTE.length];
    pct('GPU ' + g.index + ' util %', g.utilization_percent, color, 'dashdot');
    mem('GPU ' + g.index + ' memory', g.memory_used_bytes, color);
  });
  plot('chart-system', traces, layout({
    hovermode: 'x unified',
    margin: { l: 55, r: 60, t: 10, b: 45 },
    xaxis: { title: { text: 'seconds since first sample' } },
    yaxis: { title: { text: 'utilisation %' }, rangemode: 'tozero' },
    yaxis2: { title: { text: 'memory (' + unit.name + ')' }, overlaying: 'y', side: 'right', rangemode: 'tozero', showgrid: false, tickmode: 'auto' },
  }));
}

// ---------- ranks ----------

function renderRanks(r) {
  const n = (r.ranks || []).length;
  const worldSize = state.overview && isNum(state.overview.world_size) ? state.overview.world_size : n;
  if (n === 0 && worldSize > 1) {
    plot('chart-rank-phases', [], {}, WAITING);
    plot('chart-rank-heatmap', [], {}, WAITING);
    return;
  }
  // Live, one rank has no rank table (nothing to compare): its world size says so.
  if (n <= 1 && worldSize <= 1) {
    plot('chart-rank-phases', [], {}, 'single rank: nothing to compare across ranks');
    plot('chart-rank-heatmap', [], {}, 'single rank');
    return;
  }
  const spread = r.spread || {};
  const known = state.phases.order.filter((k) => k !== 'step');
  const keys = known.filter((k) => spread[k]).concat(
    Object.keys(spread).filter((k) => k !== 'step' && !known.includes(k)));
  const xs = keys.map(label);
  const pick = (f) => keys.map((k) => spread[k][f]);
  const st = spread.step;
  let title = r.straggler !== null && r.straggler !== undefined ? 'Straggler: rank ' + r.straggler : 'No straggler';
  if (st) title += ' · step median ' + fmtMs(st.median) + ', worst ' + fmtMs(st.worst) + ' (rank ' + st.worst_rank + ')';
  plot('chart-rank-phases', [
    { type: 'bar', name: 'median rank', x: xs, y: pick('median'), marker: { color: '#4c78a8' },
      hovertemplate: '%{x}: %{y:.2f} ms<extra>median</extra>' },
    { type: 'bar', name: 'worst rank', x: xs, y: pick('worst'), marker: { color: '#e45756' },
      customdata: keys.map((k) => [spread[k].worst_rank, spread[k].skew]),
      hovertemplate: '%{x}: %{y:.2f} ms on rank %{customdata[0]} (skew %{customdata[1]:.2f})<extra>worst</extra>' },
  ], keys.length ? layout({
    barmode: 'group',
    title: { text: title, x: 0, xanchor: 'left', font: { size: 13 } },
    margin: { l: 55, r: 20, t: 60, b: 60 },
    legend: { orientation: 'h', x: 1, xanchor: 'right', y: 1.02, yanchor: 'bottom' },
    xaxis: { tickangle: -30 },
    yaxis: { title: { text: 'ms per step' }, rangemode: 'tozero' },
  }) : {}, keys.length ? '' : 'no per-phase spread yet');

  const hm = r.heatmap || {};
  const hasHeat = Array.isArray(hm.step_ms) && hm.step_ms.some(hasData);
  plot('chart-rank-heatmap', [{
    type: 'heatmap', x: hm.step, y: (hm.ranks || []).map((k) => 'rank ' + k), z: hm.step_ms,
    colorscale: 'YlOrRd', reversescale: true, colorbar: { title: { text: 'ms' }, thickness: 12 },
    hovertemplate: '%{y}, step %{x}: %{z:.2f} ms<extra></extra>',
  }], layout({
    margin: { l: 70, r: 20, t: 10, b: 45 },
    xaxis: { title: { text: 'step' } },
    yaxis: { type: 'category', autorange: 'reversed' },
  }), hasHeat ? '' : WAITING);
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
  meta.textContent = dd ? 'sampled ' + dd.sampled_steps + ' steps (every ' + dd.every_n_steps + ') · coverage forward ' +
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

function renderScalars(data) {
  const sc = data.scalars || {};
  const names = Object.keys(sc).filter((n) => sc[n] && Array.isArray(sc[n].step) && sc[n].step.length);
  plot('chart-scalars', names.map((n, i) => ({
    type: 'scatter', mode: 'lines', name: n, x: sc[n].step, y: sc[n].value,
    line: { color: PALETTE[i % PALETTE.length], width: 1.5 },
  })), layout({
    hovermode: 'x unified', showlegend: true,
    xaxis: { title: { text: 'step' } },
  }), names.length ? '' : 'no scalars recorded');
}

// ---------- loading and live updates ----------

function refreshOverview() {
  return load('/api/overview', renderOverview, ['overview']);
}

function refreshCharts() {
  return Promise.all([
    load('/api/steps', renderSteps, ['chart-phases', 'chart-memory']),
    load('/api/timeline', renderTimeline, ['chart-timeline']),
    load('/api/system', renderSystem, ['chart-system']),
    load('/api/ranks', renderRanks, ['chart-rank-phases', 'chart-rank-heatmap']),
    load('/api/spans', renderSpans, ['spans-table']),
    load('/api/scalars', renderScalars, ['chart-scalars']),
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
  await load('/api/phases', (phases) => { state.phases = phases; }, ['conn']);
  await Promise.all([refreshOverview(), refreshCharts(), refreshLayers()]);
  state.initialFinal = Boolean(state.overview) && state.overview.live === false;
  startStream();
}

main().catch((err) => console.warn('traceml: start-up failed', err));
