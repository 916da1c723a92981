// Helpers every duetime page shares: the API with an optional key, server-sent events read
// with fetch (so that a key can go in a header), small DOM and number helpers, uPlot charts
// that follow their container's width. No framework, no build step.
"use strict";
const dt = (() => {
  const KEY = "duetime.key";
  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = sessionStorage.getItem(KEY);
    if (key) h["authorization"] = "Bearer " + key;
    return h;
  }
  function askKey(why) {
    const key = window.prompt((why || "This gateway needs a key.") + " Key:");
    if (key) sessionStorage.setItem(KEY, key.trim());
    return !!key;
  }
  // fetch, asking once for a key on 401/403
  async function api(path, opts) {
    opts = opts || {};
    for (let tries = 0; ; tries++) {
      const resp = await fetch(path, Object.assign({}, opts, {headers: headers(opts.headers)}));
      if ((resp.status === 401 || resp.status === 403) && tries === 0 && askKey(await errorText(resp))) continue;
      return resp;
    }
  }
  async function errorText(resp) {
    try { const b = await resp.clone().json(); return (b.error && b.error.message) || resp.statusText; }
    catch (e) { return resp.status + " " + resp.statusText; }
  }
  // a server-sent-event response read to its end: onData(the event's data) per event, and
  // afterEach() once per chunk read (after its events)
  async function readEvents(resp, onData, afterEach) {
    const reader = resp.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buf += dec.decode(value, {stream: true});
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, cut); buf = buf.slice(cut + 2);
        const data = ev.split("\n").filter(l => l.startsWith("data:")).map(l => l.slice(5).trim()).join("\n");
        if (data) onData(data);
      }
      afterEach && afterEach();
    }
  }
  // server-sent events over fetch: onEvent(parsed JSON) per event; reconnects after a drop
  function events(path, onEvent, onState) {
    let stopped = false, ctl = null;
    async function run() {
      while (!stopped) {
        try {
          ctl = new AbortController();
          const resp = await api(path, {signal: ctl.signal, headers: {accept: "text/event-stream"}});
          if (!resp.ok) throw new Error(await errorText(resp));
          onState && onState("live");
          await readEvents(resp, data => onEvent(JSON.parse(data)));
          onState && onState("reconnecting");
        } catch (e) {
          if (stopped) return;
          onState && onState("disconnected: " + e.message);
        }
        await new Promise(r => setTimeout(r, 1000));
      }
    }
    run();
    return () => { stopped = true; ctl && ctl.abort(); };
  }
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") e.className = v; else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
    }
    for (const k of kids.flat(Infinity)) if (k !== null && k !== undefined) e.append(k instanceof Node ? k : String(k));
    return e;
  }
  const num = (x, d) => (x === null || x === undefined || Number.isNaN(x)) ? "–" :
    Number(x).toLocaleString("en-US", {maximumFractionDigits: d === undefined ? 1 : d, minimumFractionDigits: d === undefined ? 0 : d});
  const ms = x => (x === null || x === undefined) ? "–" : (x >= 10000 ? num(x / 1000, 1) + " s" : num(x, x < 10 ? 2 : x < 100 ? 1 : 0) + " ms");
  const pct = x => (x === null || x === undefined) ? "–" : num(100 * x, 1) + "%";
  // a uPlot chart that keeps its container's width
  function chart(container, opts, data) {
    const width = () => Math.max(200, container.clientWidth - 4);
    const u = new uPlot(Object.assign({width: width(), height: opts.height || 220}, opts), data, container);
    new ResizeObserver(() => u.setSize({width: width(), height: opts.height || 220})).observe(container);
    return u;
  }
  const PALETTE = ["#2f6fd6", "#d6542f", "#1f8a4c", "#8e44ad", "#b7791f", "#16a0a0", "#c0392b", "#555"];
  function nav(active) {
    const links = [["/dashboard", "Dashboard"], ["/playground", "Playground"], ["/demo", "SFS demo"]];
    const h = el("header", {class: "nav"}, el("b", {}, "duetime"),
      links.map(([href, name]) => el("a", {href, class: href === active ? "active" : null}, name)),
      el("span", {class: "status", id: "status"}, ""));
    document.body.prepend(h);
  }
  const status = text => { const s = document.getElementById("status"); if (s) s.textContent = text; };
  return {api, events, readEvents, el, num, ms, pct, chart, PALETTE, nav, status, errorText};
})();
