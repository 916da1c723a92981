// The dashboard: a card per instance, per-second charts and the latest decisions, from the
// gateway's event stream (GET /duetime/dashboard/events, one update a second).
"use strict";
dt.nav("/dashboard");
const charts = {};
let updates = 0;

function card(inst) {
  const pill = inst.healthy ? dt.el("span", {class: "pill"}, "in rotation")
    : dt.el("span", {class: "pill bad", title: inst.last_error || ""}, "ejected");
  const rows = [
    ["running", inst.running], ["waiting", inst.waiting], ["KV use", dt.pct(inst.kv_usage)],
    ["in flight here", inst.in_flight], ["probe TTFT now", dt.ms(inst.probe_ttft_ms)],
    ["first tokens (1 min)", inst.first_tokens_1m], ["on time (1 min)", dt.pct(inst.on_time_1m)],
    ["forecast error (1 min)", dt.pct(inst.forecast_error_1m)],
  ];
  return dt.el("div", {class: "card", "data-instance": inst.name},
    dt.el("h3", {}, dt.el("span", {}, inst.name), pill),
    dt.el("div", {class: "muted"}, inst.model),
    dt.el("dl", {}, rows.map(([k, v]) => [dt.el("dt", {}, k), dt.el("dd", {"data-k": k}, v)])));
}

function series(s, names) {
  const xs = s.t;
  const data = {
    rps: [xs, s.requests],
    ttft: [xs, s.ttft_p50_ms, s.forecast_p50_ms],
    decisions: [xs, ...names.map(n => s.decisions[n])],
  };
  if (!charts.rps) {
    const axes = label => [{}, {label, size: 60}];
    charts.rps = dt.chart(document.getElementById("chart-rps"), {
      axes: axes("req/s"), series: [{}, {label: "requests", stroke: dt.PALETTE[0], fill: "rgba(47,111,214,.12)"}],
    }, data.rps);
    charts.ttft = dt.chart(document.getElementById("chart-ttft"), {
      axes: axes("ms"), series: [{}, {label: "observed", stroke: dt.PALETTE[1], spanGaps: true},
        {label: "forecast", stroke: dt.PALETTE[0], dash: [6, 4], spanGaps: true}],
    }, data.ttft);
    charts.decisions = dt.chart(document.getElementById("chart-decisions"), {
      axes: axes("decisions/s"), series: [{}, ...names.map((n, i) => ({label: n, stroke: dt.PALETTE[i % dt.PALETTE.length]}))],
    }, data.decisions);
  } else {
    for (const k of Object.keys(data)) charts[k].setData(data[k]);
  }
}

const explanations = new Map();  // id -> explanation, as they come (the latest few each update)
function decisions(list, explained) {
  for (const d of explained) explanations.set(d.id, d);
  for (const id of explanations.keys()) if (explanations.size > 200) explanations.delete(id);
  const body = document.querySelector("#decisions tbody");
  body.replaceChildren(...list.map(d => {
    const full = explanations.get(d.id);
    return dt.el("tr", {"data-id": d.id},
      dt.el("td", {class: "l"}, new Date(d.t * 1000).toLocaleTimeString()),
      dt.el("td", {class: "l"}, d.id), dt.el("td", {class: "l"}, d.instance), dt.el("td", {class: "l"}, d.model),
      dt.el("td", {}, dt.ms(d.forecast_ms)), dt.el("td", {}, dt.ms(d.ttft_ms)), dt.el("td", {}, dt.ms(d.target_ms)),
      dt.el("td", {class: d.on_time === null ? null : d.on_time ? "yes" : "no"}, d.on_time === null ? "…" : d.on_time ? "yes" : "no"),
      dt.el("td", {class: "l"}, full ? dt.el("a", {href: "#explanation", onclick: () => showExplanation(full)}, "explain") : ""));
  }));
  if (explained.length && !pinned) showExplanation(explained[0], false);
}

let pinned = false;
function showExplanation(d, pin = true) {
  pinned = pinned || pin;
  const box = document.getElementById("explanation");
  box.replaceChildren(dt.el("p", {}, `Request ${d.id} at ${new Date(d.t * 1000).toLocaleTimeString()}, attempt ${d.attempt}.`),
    explainView.render(d.explanation));
}

function update(state) {
  updates++;
  if (updates === 1) document.body.dataset.firstUpdateMs = performance.now().toFixed(1);
  document.body.dataset.updates = updates;
  const names = state.instances.map(i => i.name);
  document.getElementById("lead").textContent =
    `Policy ${state.policy}; ${names.length} instances; probe: a ${state.probe_tokens}-token prompt arriving now. Updated ${new Date(state.t * 1000).toLocaleTimeString()}.`;
  document.getElementById("cards").replaceChildren(...state.instances.map(card));
  series(state.series, names);
  decisions(state.decisions, state.explained);
}

dt.events("/duetime/dashboard/events", update, s => dt.status(s));
