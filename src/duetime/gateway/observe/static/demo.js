// The SFS demo page: the simulator panel (POST /duetime/demo/simulate) and the batch-time panel
// (POST /duetime/demo/batch). Charts are made on the first answer and then given new data.
"use strict";
dt.nav("/demo");
const $ = id => document.getElementById(id);
const charts = {};

async function post(path, body) {
  const resp = await dt.api(path, {method: "POST", headers: {"content-type": "application/json"},
                                   body: JSON.stringify(body)});
  if (!resp.ok) throw new Error(await dt.errorText(resp));
  return resp.json();
}

// a chart made once per container, then fed new data (its series stay the same)
function plot(id, opts, data) {
  if (charts[id]) { charts[id].setData(data); return charts[id]; }
  charts[id] = dt.chart($(id), opts, data);
  return charts[id];
}

const stepped = uPlot.paths.stepped({align: 1});
const dots = (label, stroke, size) => ({label, stroke, fill: stroke, paths: () => null,
  points: {show: true, size: size || 4, stroke, fill: stroke}});

// -- the simulator ------------------------------------------------------------------------------

let running = false, again = false;

function simInput() {
  return {rate: +$("rate").value, router: $("router").value, lambda: +$("lambda").value,
          delta: +$("delta").value, requests: +$("requests").value, seed: +$("seed").value};
}

async function runSim() {
  if (running) { again = true; return; }
  running = true;
  $("run").disabled = true;
  dt.status("simulating…");
  try {
    const t0 = performance.now();
    const r = await post("/duetime/demo/simulate", simInput());
    drawSim(r);
    dt.status(`simulated in ${dt.num(r.timing.total_s, 2)} s (server), ${dt.num((performance.now() - t0) / 1000, 2)} s round trip`);
  } catch (e) {
    $("sim-note").textContent = "";
    $("sim-note").append(dt.el("span", {class: "error"}, "Simulation failed: " + e.message));
    dt.status("error");
  } finally {
    running = false;
    $("run").disabled = false;
    if (again) { again = false; runSim(); }
  }
}

function drawTable(r) {
  const cols = ["mean_ttft_s", "p95_ttft_s", "on_time", "utility", "ontime_utility"];
  const best = {};
  for (const c of cols) {
    const vals = r.table.map(x => x[c]);
    best[c] = c.endsWith("ttft_s") ? Math.min(...vals) : Math.max(...vals);
  }
  const fmt = (c, v) => c.endsWith("ttft_s") ? dt.ms(1000 * v) : c === "on_time" ? dt.pct(v) : dt.num(v, 3);
  const body = $("routers").tBodies[0];
  body.replaceChildren(...r.table.map(row => dt.el("tr", {class: row.router === r.router ? "chosen" : null},
    dt.el("td", {}, row.router),
    cols.map(c => dt.el("td", {class: row[c] === best[c] ? "best" : null}, fmt(c, row[c]))))));
}

function drawSim(r) {
  document.querySelectorAll(".sel-router").forEach(e => { e.textContent = r.router; });
  const d = r.detail, q = d.queue, reqs = d.requests;
  const shares = r.instances.map((_, k) => reqs.instance.filter(i => i === k).length);
  $("sim-note").textContent = `${r.requests} requests at ${r.rate} q/s (λ = ${r.lambda}` +
    (r.router === "sfs-soft" ? `, δ = ${r.delta} per µs` : "") + `), ${dt.num(d.simulated_s, 1)} s simulated. ` +
    `${r.router} sent ` + r.instances.map((n, k) => `${shares[k]} to ${n}`).join(", ") + ".";
  drawTable(r);
  const inst = r.instances.map((name, k) => ({label: name, stroke: dt.PALETTE[k], width: 1.5, paths: stepped}));
  const xTime = {label: "time (s)"};
  plot("queue-chart", {height: 240, scales: {x: {time: false}},
    axes: [xTime, {label: "requests"}], series: [{label: "t (s)"}, ...inst]},
    [q.t, ...q.awaiting_first_token]);
  plot("decode-chart", {height: 240, scales: {x: {time: false}},
    axes: [xTime, {label: "requests"}], series: [{label: "t (s)"}, ...inst]},
    [q.t, ...q.decoding]);
  const on = reqs.ttft_s.map((v, i) => reqs.on_time[i] ? v : null);
  const late = reqs.ttft_s.map((v, i) => reqs.on_time[i] ? null : v);
  plot("ttft-chart", {height: 240, scales: {x: {time: false}, y: {distr: 3}},
    axes: [{label: "arrival (s)"}, {label: "seconds (log)"}],
    series: [{label: "arrival (s)"}, dots("on time", "#1f8a4c", 4), dots("late", "#c8372d", 4),
             dots("target", "#9aa5b4", 2)]},
    [reqs.arrival_s, on, late, reqs.target_s]);
  const routers = Object.keys(r.sweep.ontime_utility);
  plot("sweep-chart", {height: 240, scales: {x: {time: false}},
    axes: [{label: "arrival rate (q/s)"}, {label: "OnTimeUtility"}],
    series: [{label: "q/s"}, ...routers.map((name, k) => ({label: name, stroke: dt.PALETTE[k], width: 2,
                                                            points: {show: true, size: 5}}))]},
    [r.sweep.rates, ...routers.map(n => r.sweep.ontime_utility[n])]);
  $("sweep-note").textContent = `${r.sweep.requests} requests per point, the same trace for every router at a rate.`;
}

$("rate").addEventListener("input", () => { $("rate-val").textContent = $("rate").value + " q/s"; });
$("router").addEventListener("change", () => { $("delta").disabled = $("router").value !== "sfs-soft"; });
for (const id of ["rate", "router", "lambda", "delta", "requests", "seed"]) $(id).addEventListener("change", runSim);
$("sim-form").addEventListener("submit", e => { e.preventDefault(); runSim(); });

// -- one token batch ----------------------------------------------------------------------------

const KNOBS = ["decode_seqs", "decode_context", "prefill_tokens", "prefill_requests", "prefill_context"];
const KNOB_LABEL = {decode_context: "decode context (tokens)", prefill_context: "prefill prior context (tokens)",
                    decode_share: "decode sequences (the rest prefill tokens)", prefill_requests: "prefill requests"};
const termColor = {};
let batchSeq = 0;

function colorOf(label) {
  if (!(label in termColor)) termColor[label] = dt.PALETTE[Object.keys(termColor).length % dt.PALETTE.length];
  return termColor[label];
}

function batchInput() {
  const b = {vary: $("vary").value};
  for (const k of KNOBS) b[k] = +$(k).value;
  if (b.prefill_tokens === 0) b.prefill_requests = 1;
  else b.prefill_requests = Math.min(b.prefill_requests, b.prefill_tokens);
  if (b.decode_seqs + b.prefill_tokens === 0) b.decode_seqs = 1;
  return b;
}

async function runBatch() {
  for (const k of KNOBS) $(k + "-val").textContent = dt.num(+$(k).value, 0);
  const seq = ++batchSeq;
  try {
    const r = await post("/duetime/demo/batch", batchInput());
    if (seq === batchSeq) drawBatch(r);  // (an older answer arriving late is dropped)
  } catch (e) {
    $("batch-note").textContent = "";
    $("batch-note").append(dt.el("span", {class: "error"}, "Batch failed: " + e.message));
  }
}

function drawBatch(r) {
  const b = r.batch;
  $("batch-note").textContent = `${dt.num(b.total_tokens, 0)} tokens: ${b.decode_seqs} decode + ` +
    `${dt.num(b.prefill_tokens, 0)} prefill (chunks ${b.prefill_chunks.join(", ") || "none"}).`;
  const longest = Math.max(...r.instances.map(i => i.total_s));
  $("batch-cards").replaceChildren(...r.instances.map(i => dt.el("div", {class: "card"},
    dt.el("h3", {}, dt.el("span", {}, i.name), dt.el("span", {class: "muted"}, i.batch_time_model)),
    dt.el("dl", {},
      dt.el("dt", {}, "Predicted batch time"), dt.el("dd", {class: "bt-total", "data-instance": i.name}, dt.ms(1000 * i.total_s)),
      dt.el("dt", {}, "Per decode token"), dt.el("dd", {}, i.per_decode_token_s === null ? "–" : dt.ms(1000 * i.per_decode_token_s)),
      dt.el("dt", {}, "Prefill throughput"), dt.el("dd", {}, i.prefill_tokens_per_s === null ? "–" : dt.num(i.prefill_tokens_per_s, 0) + " tok/s")),
    dt.el("div", {class: "bar", title: "terms, to the scale of the slowest instance"},
      i.terms.filter(t => t.seconds > 0).map(t => dt.el("span", {
        style: `width:${100 * t.seconds / longest}%;background:${colorOf(t.label)}`,
        title: `${t.label}: ${dt.ms(1000 * t.seconds)} (${t.name} = ${t.coefficient.toExponential(3)} × ${dt.num(t.feature, 0)})`}))),
    dt.el("table", {class: "terms"}, i.terms.map(t => dt.el("tr", {},
      dt.el("td", {}, dt.el("i", {style: `display:inline-block;width:.7rem;height:.7rem;margin-right:.3rem;background:${colorOf(t.label)}`}), t.label),
      dt.el("td", {}, dt.ms(1000 * t.seconds))))))));
  $("term-legend").replaceChildren(...Object.entries(termColor).map(([label, c]) =>
    dt.el("span", {}, dt.el("i", {style: `background:${c}`}), label)));
  const s = r.sweep;
  $("bsweep-title").textContent = `Step time vs ${KNOB_LABEL[s.knob]}, ${dt.num(b.total_tokens, 0)} tokens throughout (now: ${dt.num(s.current, 0)})`;
  const opts = {height: 260, scales: {x: {time: false}}, axes: [{label: "the varied knob (see the title)"}, {label: "step time (ms)"}],
    series: [{label: "x"}, ...r.instances.map((i, k) => ({label: i.name, stroke: dt.PALETTE[k], width: 2}))]};
  const data = [s.x, ...r.instances.map(i => i.sweep_s.map(v => 1000 * v))];
  plot("bsweep-chart", opts, data);
}

for (const k of KNOBS) $(k).addEventListener("input", runBatch);
$("vary").addEventListener("change", runBatch);

runBatch();
runSim();
