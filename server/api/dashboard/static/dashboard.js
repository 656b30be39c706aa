// The Justitia dashboard: one stream (GET /v1/scheduler/events) read with fetch(), because
// EventSource cannot send an Authorization header; the key stays in sessionStorage and in
// that header, never in a URL. No library: tables and SVG charts are drawn here.
"use strict";

const KEY = "justitia.key";
const MAX_FINISHED = 1000;
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

const state = { t: 0, info: null, counts: null, order: [], rows: new Map(), kv: [], finished: [] };
let controller = null;
let retry = null;
let dirty = false;

// -- the stream ---------------------------------------------------------------------------
async function settings() {
  const r = await fetch("/dashboard/settings.json", { cache: "no-store" });
  return r.ok ? r.json() : { keys: false };
}

async function connect() {
  clearTimeout(retry);
  if (controller) controller.abort();
  const key = sessionStorage.getItem(KEY);
  const { keys } = await settings();
  if (keys && !key) { askForKey(""); return; }
  controller = new AbortController();
  const headers = { Accept: "text/event-stream" };
  if (key) headers.Authorization = "Bearer " + key;
  let response;
  try {
    response = await fetch("/v1/scheduler/events", { headers, signal: controller.signal, cache: "no-store" });
  } catch (err) {
    return reconnect("disconnected");
  }
  if (response.status === 401) {
    sessionStorage.removeItem(KEY);
    askForKey("That key was not accepted.");
    return;
  }
  if (!response.ok) return reconnect("error " + response.status);
  $("auth").hidden = true;
  $("main").hidden = false;
  $("forget").hidden = !key;
  setStatus("live", false);
  await read(response.body.getReader());
}

async function read(reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data) apply(JSON.parse(data));
      }
    }
  } catch (err) {
    if (err.name === "AbortError") return;
  }
  reconnect("disconnected");
}

function reconnect(why) {
  setStatus(why + ", reconnecting…", true);
  retry = setTimeout(connect, 2000);
}

function setStatus(text, bad) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("bad", bad);
}

function askForKey(message) {
  $("main").hidden = true;
  $("auth").hidden = false;
  $("auth-error").textContent = message;
  setStatus("API key needed", true);
  $("key").focus();
}

// -- frames -------------------------------------------------------------------------------
function apply(frame) {
  if (frame.reset) {
    state.rows.clear(); state.order = []; state.kv = []; state.finished = [];
  }
  if (frame.t !== undefined) state.t = frame.t;
  if (frame.info) state.info = frame.info;
  if (frame.counts) state.counts = frame.counts;
  if (frame.order) {
    state.order = frame.order;
    const keep = new Set(frame.order);
    for (const id of state.rows.keys()) if (!keep.has(id)) state.rows.delete(id);
  }
  if (frame.rows) for (const [id, row] of Object.entries(frame.rows)) state.rows.set(id, row);
  if (frame.kv) state.kv = state.kv.concat(frame.kv).slice(-300);
  if (frame.finished) state.finished = state.finished.concat(frame.finished).slice(-MAX_FINISHED);
  if (!dirty) { dirty = true; requestAnimationFrame(render); }
}

function render() {
  dirty = false;
  renderInfo();
  renderQueue();
  renderKv();
  renderThroughput();
  renderReplicas();
  renderFinished();
  document.body.dataset.frames = String(Number(document.body.dataset.frames || 0) + 1);
}

// -- panels -------------------------------------------------------------------------------
const fmt = (x, digits = 1) => (x === null || x === undefined ? "–" : Number(x).toLocaleString("en", { maximumFractionDigits: digits }));
const secs = (x) => (x === null || x === undefined ? "–" : fmt(x, 1) + " s");

function renderInfo() {
  const i = state.info;
  if (!i) return;
  document.body.classList.toggle("tenant-view", !i.admin);
  $("who").textContent = i.admin ? "admin: every tenant" : "tenant " + i.tenant;
  const tm = i.time_model || {};
  const items = [
    ["policy", i.policy + (i.paused ? " (paused)" : "")],
    ["V (virtual time)", fmt(i.V, 0)],
    ["M (KV capacity)", fmt(i.M, 0) + " tokens"],
    ["tau (iteration)", fmt(i.tau * 1000, 2) + " ms; bound " + fmt(i.bound_tau * 1000, 2) + " ms"],
    ["rate R = M/tau", fmt(i.rate, 0) + " cost/s"],
    ["promises", i.promise + (i.promise_reason ? ": " + i.promise_reason : "")],
    ["GPS backlog", fmt(i.backlog, 0) + " agents"],
    ["time model", (tm.engine ? tm.engine + ", " : "") + (tm.source || "") +
      "; base " + fmt((tm.base_s || 0) * 1000, 3) + " ms, per seq " + fmt((tm.per_seq_s || 0) * 1e6, 1) + " µs"],
    ["predictors", i.predictors && i.predictors.length ? i.predictors.join(", ") : "none trained (cold start)"],
  ];
  const dl = $("info");
  dl.replaceChildren();
  for (const [k, v] of items) {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    dl.append(dt, dd);
  }
}

const COLUMNS = ["pos", "id", "type", "tenant", "state", "req", "predicted", "consumed", "vf", "eta", "fair", "deadline", "risk"];

function renderQueue() {
  const c = state.counts;
  if (c) {
    $("queue-counts").textContent = `${c.live} live (${c.queued} queued, ${c.running} running, ${c.paused ?? 0} paused), showing ${c.shown}; ` +
      `server: ${c.pending_requests} requests waiting, ${c.running_requests} running`;
  }
  const body = $("queue").tBodies[0];
  const rows = [];
  for (const id of state.order) {
    const r = state.rows.get(id);
    if (!r) continue;
    const [pos, type, tenant, st, pending, running, predicted, consumed, vf, eta, fair, deadline, , pausedSince] = r;
    // a paused agent (a tool call): for how long, on the frames' clock
    const shown = st === "paused" && pausedSince != null ? `paused ${Math.max(0, state.t - pausedSince).toFixed(1)} s` : st;
    const atRisk = eta !== null && deadline !== null && eta > deadline;
    const tr = document.createElement("tr");
    tr.dataset.id = id;
    tr.className = st + (atRisk ? " at-risk" : "");
    const cells = [pos, id, type, tenant ?? "", shown, pending + " / " + running, fmt(predicted, 0), fmt(consumed, 0),
      fmt(vf, 0), secs(eta), secs(fair), secs(deadline), atRisk ? "⚠ at risk" : ""];
    cells.forEach((v, k) => {
      const td = document.createElement("td");
      td.className = COLUMNS[k];
      td.textContent = String(v);
      tr.append(td);
    });
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

// -- charts -------------------------------------------------------------------------------
function el(name, attrs, parent) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (parent) parent.append(e);
  return e;
}

function frameOf(svg) {
  const [, , w, h] = svg.getAttribute("viewBox").split(" ").map(Number);
  return { w, h, left: 52, right: 16, top: 8, bottom: 22 };
}

// Round steps (1, 2 or 5 times a power of ten) for a linear axis up to `max`.
function niceStep(max, count = 4) {
  const raw = max / count || 1;
  const p = Math.pow(10, Math.floor(Math.log10(raw)));
  return [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw);
}

// 1, 2, 5 times the powers of ten between lo and hi, for a log axis.
// Over more than two decades, powers of ten only (labels would overlap).
function logTicks(lo, hi) {
  const out = [];
  const steps = Math.log10(hi / lo) > 2 ? [1] : [1, 2, 5];
  for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
    for (const m of steps) { const v = m * Math.pow(10, e); if (v >= lo && v <= hi) out.push(v); }
  }
  return out;
}

function axes(svg, f, xmin, xmax, ymax, xlabel, ylabel) {
  const ystep = niceStep(ymax);
  ymax = Math.ceil(ymax / ystep) * ystep;
  const x = (v) => f.left + ((v - xmin) / (xmax - xmin || 1)) * (f.w - f.left - f.right);
  const y = (v) => f.h - f.bottom - (v / (ymax || 1)) * (f.h - f.top - f.bottom);
  frameLines(svg, f);
  for (let v = 0; v <= ymax + 1e-9; v += ystep) {
    el("text", { x: f.left - 4, y: y(v) + 3, "text-anchor": "end" }, svg).textContent = fmt(v, ystep < 1 ? 1 : 0);
  }
  const xstep = niceStep(xmax - xmin);
  for (let u = Math.ceil(xmin / xstep) * xstep; u <= xmax + 1e-9; u += xstep) {
    el("text", { x: x(u), y: f.h - 6, "text-anchor": "middle" }, svg).textContent = fmt(u, xstep < 1 ? 1 : 0);
  }
  labels(svg, f, xlabel, ylabel);
  return { x, y };
}

// Both axes logarithmic from lo to hi (the finished agents' times span orders of magnitude).
function logAxes(svg, f, lo, hi, xlabel, ylabel) {
  const span = Math.log10(hi) - Math.log10(lo) || 1;
  const x = (v) => f.left + ((Math.log10(Math.max(v, lo)) - Math.log10(lo)) / span) * (f.w - f.left - f.right);
  const y = (v) => f.h - f.bottom - ((Math.log10(Math.max(v, lo)) - Math.log10(lo)) / span) * (f.h - f.top - f.bottom);
  frameLines(svg, f);
  for (const v of logTicks(lo, hi)) {
    el("text", { x: f.left - 4, y: y(v) + 3, "text-anchor": "end" }, svg).textContent = fmt(v, 2);
    el("text", { x: x(v), y: f.h - 6, "text-anchor": "middle" }, svg).textContent = fmt(v, 2);
  }
  labels(svg, f, xlabel, ylabel);
  return { x, y };
}

function frameLines(svg, f) {
  el("line", { x1: f.left, y1: f.h - f.bottom, x2: f.w - f.right, y2: f.h - f.bottom, class: "axis" }, svg);
  el("line", { x1: f.left, y1: f.top, x2: f.left, y2: f.h - f.bottom, class: "axis" }, svg);
}

function labels(svg, f, xlabel, ylabel) {
  el("text", { x: f.w - f.right, y: f.h - f.bottom - 4, "text-anchor": "end" }, svg).textContent = xlabel;
  el("text", { x: f.left + 4, y: f.top + 8 }, svg).textContent = ylabel;
}

function line(svg, points, cls) {
  if (points.length) el("polyline", { points: points.map(([a, b]) => a.toFixed(1) + "," + b.toFixed(1)).join(" "), class: cls }, svg);
}

function renderKv() {
  const svg = $("kv-chart");
  const s = state.kv;
  svg.replaceChildren();
  svg.dataset.samples = String(s.length);
  if (!s.length) return;
  const f = frameOf(svg);
  const t0 = s[0].t, t1 = Math.max(s[s.length - 1].t, t0 + 1);
  const ymax = Math.max(...s.map((p) => Math.max(p.capacity, p.reserved, p.used)), 1);
  const { x, y } = axes(svg, f, t0 - t1, 0, ymax, "seconds ago", "tokens");
  const at = (p) => x(p.t - t1);
  line(svg, s.map((p) => [at(p), y(p.capacity)]), "cap");
  line(svg, s.map((p) => [at(p), y(p.reserved)]), "res");
  line(svg, s.map((p) => [at(p), y(p.used)]), "used");
  const last = s[s.length - 1];
  svg.dataset.reservedMax = String(Math.max(...s.map((p) => p.reserved)));
  svg.dataset.usedMax = String(Math.max(...s.map((p) => p.used)));
  svg.dataset.last = `${last.reserved}/${last.used}/${last.capacity}`;
}

function renderThroughput() {
  const svg = $("tp-chart");
  const s = state.kv;
  svg.replaceChildren();
  if (!s.length) return;
  const f = frameOf(svg);
  const t0 = s[0].t, t1 = Math.max(s[s.length - 1].t, t0 + 1);
  const counted = (p) => (p.replicas || []).filter((r) => r.tokens_per_s !== undefined);
  const replicas = counted(s[s.length - 1]).map((r) => r.id);
  const values = s.flatMap((p) => [p.tokens_per_s, ...counted(p).map((r) => r.tokens_per_s)]);
  const ymax = Math.max(...values, 1);
  const { x, y } = axes(svg, f, t0 - t1, 0, ymax, "seconds ago", "tokens/s");
  line(svg, s.map((p) => [x(p.t - t1), y(p.tokens_per_s)]), "tp");
  const legend = $("tp-legend");
  legend.replaceChildren();
  const total = document.createElement("span"); total.className = "k-res"; total.textContent = "all (finished requests)";
  legend.append(total);
  replicas.forEach((id, k) => {
    const pts = s.map((p) => [p, counted(p).find((r) => r.id === id)]).filter(([, r]) => r)
      .map(([p, r]) => [x(p.t - t1), y(r.tokens_per_s)]);
    line(svg, pts, "tp r" + (k % 4));
    const span = document.createElement("span"); span.className = "r" + (k % 4); span.textContent = id;
    legend.append(span);
  });
}

// The engine's replicas (Ray Serve's, or an --engine-url server), as last sampled: the
// panel stays hidden for an in-process engine.
function renderReplicas() {
  const last = state.kv.length ? state.kv[state.kv.length - 1] : null;
  const replicas = (last && last.replicas) || [];
  $("replicas-panel").hidden = !replicas.length;
  if (!replicas.length) return;
  const serving = replicas.filter((r) => r.state === "serving");
  $("replica-counts").textContent = `${serving.length} serving of ${replicas.length}; M = ` +
    fmt(serving.reduce((m, r) => m + r.capacity, 0), 0) + " tokens";
  const rows = replicas.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.id = r.id;
    tr.className = r.state;
    [r.id, r.state, fmt(r.capacity, 0), fmt(r.reserved, 0), String(r.in_flight), fmt(r.used, 0)].forEach((v, k) => {
      const td = document.createElement("td");
      if (k < 2) td.className = "left";
      td.textContent = v;
      tr.append(td);
    });
    return tr;
  });
  $("replicas").tBodies[0].replaceChildren(...rows);
}

function renderFinished() {
  const fin = state.finished;
  $("finished-count").textContent = state.counts ? `${state.counts.finished} so far; last ${fin.length} drawn` : "";
  const svg = $("finished-plot");
  svg.replaceChildren();
  svg.dataset.points = String(fin.length);
  const f = frameOf(svg);
  // Log-log: ETAs of a second and deadlines of many minutes on one plot; points below the
  // diagonal finished earlier than promised.
  const all = fin.flatMap(([, , jct, eta, dl]) => [jct, eta, dl]).filter((v) => v !== null && v > 0);
  const lo = Math.pow(10, Math.floor(Math.log10(Math.max(Math.min(...all, 1), 0.1))));
  const hi = Math.pow(10, Math.ceil(Math.log10(Math.max(...all, 1) * 1.01)));
  const { x, y } = logAxes(svg, f, lo, hi, "promised (s, log): first ETA, deadline", "JCT (s, log)");
  el("line", { x1: x(lo), y1: y(lo), x2: x(hi), y2: y(hi), class: "diag" }, svg);
  let kept = 0;
  for (const [id, type, jct, eta, deadline] of fin) {
    if (eta !== null) el("circle", { cx: x(eta), cy: y(jct), r: 2.6, class: "eta" }, svg).append(title(`${id} (${type}): JCT ${fmt(jct, 2)} s, first ETA ${fmt(eta, 2)} s`));
    if (deadline !== null) {
      el("rect", { x: x(deadline) - 2.5, y: y(jct) - 2.5, width: 5, height: 5, class: "dl" }, svg).append(title(`${id}: deadline ${fmt(deadline, 2)} s`));
      if (jct <= deadline) kept++;
    }
  }
  svg.dataset.kept = String(kept);
  renderHistogram(fin.map((r) => r[2]));
}

function title(text) {
  const t = document.createElementNS(SVG, "title");
  t.textContent = text;
  return t;
}

function renderHistogram(jcts) {
  const svg = $("jct-hist");
  svg.replaceChildren();
  svg.dataset.count = String(jcts.length);
  if (!jcts.length) return;
  const f = frameOf(svg);
  const bins = 20;
  const hi = Math.max(...jcts) || 1;
  const counts = new Array(bins).fill(0);
  for (const v of jcts) counts[Math.min(bins - 1, Math.floor((v / hi) * bins))]++;
  const { x, y } = axes(svg, f, 0, hi, Math.max(4, ...counts), "JCT (s)", "agents");
  counts.forEach((n, k) => {
    const x0 = x((k * hi) / bins), x1 = x(((k + 1) * hi) / bins);
    el("rect", { x: x0 + 0.5, y: y(n), width: Math.max(x1 - x0 - 1, 0.5), height: y(0) - y(n), class: "bar" }, svg);
  });
}

// -- start ----------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("auth-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    $("key").value = "";
    connect();
  });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    if (controller) controller.abort();
    askForKey("");
    $("forget").hidden = true;
  });
  connect();
});
