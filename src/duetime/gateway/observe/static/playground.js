// The playground: one chat request with the client's choices (x-duetime-policy,
// x-duetime-ttft-ms, x-duetime-lambda, x-duetime-task) and x-duetime-explain: 1; the answer is
// read as it streams, and the response headers say where it went and why.
"use strict";
dt.nav("/playground");
const $ = id => document.getElementById(id);

async function loadChoices() {
  const [models, choices] = await Promise.all([dt.api("/v1/models"), dt.api("/duetime/policies")]);
  if (models.ok) for (const m of (await models.json()).data) if (m.id !== "auto") $("model").append(dt.el("option", {value: m.id}, m.id));
  if (choices.ok) {
    const c = await choices.json();
    for (const p of c.policies) $("policy").append(dt.el("option", {value: p.name, title: p.summary}, p.name + (p.name === c.default ? " (default)" : "")));
    for (const t of c.tasks) $("task").append(dt.el("option", {value: t}, t));
    $("lambda").placeholder = "default " + c.lambda;
  }
  document.body.dataset.ready = "1";
}

function request() {
  const headers = {"content-type": "application/json", "x-duetime-explain": "1"};
  const pick = (id, h) => { const v = $(id).value.trim(); if (v) headers[h] = v; };
  pick("policy", "x-duetime-policy"); pick("target", "x-duetime-ttft-ms");
  pick("lambda", "x-duetime-lambda"); pick("task", "x-duetime-task");
  const body = {model: $("model").value, messages: [{role: "user", content: $("prompt").value}],
    max_tokens: Number($("max_tokens").value) || 64, stream: true};
  return {headers, body};
}

function facts(list) {
  $("facts").replaceChildren(...list.map(([k, v, id]) => dt.el("span", {id}, k + " ", dt.el("b", {}, v))));
}

async function send(ev) {
  ev.preventDefault();
  $("send").disabled = true; $("error").textContent = ""; $("answer").textContent = "";
  const {headers, body} = request();
  const t0 = performance.now();
  let tFirst = null, tokens = 0;
  try {
    const resp = await dt.api("/v1/chat/completions", {method: "POST", headers, body: JSON.stringify(body)});
    if (!resp.ok) throw new Error(await dt.errorText(resp));
    const h = resp.headers;
    const show = () => facts([
      ["instance", h.get("x-duetime-instance"), "f-instance"], ["model", h.get("x-duetime-model"), "f-model"],
      ["forecast TTFT", dt.ms(Number(h.get("x-duetime-forecast-ttft-ms")) || null), "f-forecast"],
      ["observed TTFT", tFirst === null ? "…" : dt.ms(tFirst), "f-observed"],
      ["target", dt.ms(Number(h.get("x-duetime-ttft-target-ms"))), "f-target"],
      ["tokens", tokens, "f-tokens"]]);
    show();
    const e = h.get("x-duetime-explain");
    $("why").replaceChildren(explainView.render(e ? JSON.parse(e) : null));
    await dt.readEvents(resp, data => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "stream error");
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        if (tFirst === null) tFirst = performance.now() - t0;
        tokens++;
        $("answer").textContent += delta.content;
      }
    }, show);
    show();
    document.body.dataset.answered = String(Number(document.body.dataset.answered || 0) + 1);
  } catch (e) {
    $("error").textContent = "Error: " + e.message;
  } finally {
    $("send").disabled = false;
  }
}

async function dryRun() {
  $("error").textContent = "";
  const {headers, body} = request();
  const resp = await dt.api("/duetime/route", {method: "POST", headers, body: JSON.stringify(body)});
  if (!resp.ok) { $("error").textContent = "Error: " + await dt.errorText(resp); return; }
  const e = await resp.json();
  $("why").replaceChildren(dt.el("p", {class: "muted"}, `Dry run: nothing was sent; it would be admitted ${e.admission.replace("_", " ")}.`), explainView.render(e));
  document.body.dataset.dryRuns = String(Number(document.body.dataset.dryRuns || 0) + 1);
}

$("form").addEventListener("submit", send);
$("dry").addEventListener("click", dryRun);
loadChoices();
