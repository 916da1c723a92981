// Renders a routing decision's explanation (POST /duetime/route, the x-duetime-explain header,
// the dashboard's decisions) as a table: one row per candidate, the chosen one highlighted,
// only the columns the policy filled.
"use strict";
const explainView = (() => {
  const COLS = [
    ["instance", "instance", v => v, "l"], ["model", "model", v => v, "l"],
    ["forecast_ttft_ms", "forecast TTFT", dt.ms], ["forecast_e2e_ms", "forecast e2e", dt.ms],
    ["target_ms", "target", dt.ms], ["feasible", "meets target", v => v === null ? "–" : v ? "yes" : "no"],
    ["quality", "quality", v => dt.num(v, 3)], ["success", "P(success)", v => dt.num(v, 3)],
    ["cost", "cost (USD)", v => v === null ? "–" : v.toExponential(2)],
    ["utility", "utility", v => dt.num(v, 4)], ["score", "score", v => dt.num(v, 4)],
    ["running", "running", v => v], ["waiting", "waiting", v => v],
    ["kv_usage", "KV use", dt.pct], ["cached_blocks", "cached blocks", v => v],
  ];
  function render(e) {
    if (!e) return dt.el("p", {class: "muted"}, "No explanation for this decision.");
    // (a score that is one of the columns, such as utility, is not shown twice)
    const named = COLS.some(([k]) => k === e.score);
    const used = COLS.filter(([k]) => !(k === "score" && named) &&
      e.candidates.some(c => c[k] !== null && c[k] !== undefined));
    const head = dt.el("tr", {}, used.map(([k, name, , cls]) => dt.el("th", {class: cls}, k === "score" && e.score ? e.score : name)));
    const cell = (c, [k, , fmt, cls]) => {
      const verdict = k === "feasible" && c[k] !== null ? (c[k] ? "yes" : "no") : null;
      return dt.el("td", {class: [cls, verdict].filter(Boolean).join(" ") || null}, fmt(c[k]));
    };
    const rows = e.candidates.map(c => dt.el("tr", {class: c.chosen ? "chosen" : null, "data-instance": c.instance},
      used.map(col => cell(c, col))));
    const note = dt.el("p", {class: "muted"}, dt.el("b", {}, e.policy), " chose ", dt.el("b", {}, e.chosen), ": ", e.rule,
      e.score ? ` (ranked by ${e.score}, ${e.better} wins)` : "", e.truncated ? ` — ${e.truncated} more candidates left out` : "");
    return dt.el("div", {class: "explain"}, note, dt.el("table", {}, dt.el("thead", {}, head), dt.el("tbody", {}, rows)));
  }
  return {render};
})();
