// radixserve's live view (issue 59). Plain JS, no libraries: polls /dashboard/state once a second,
// draws the scheduler's queues, batches, KV pool and radix tree, plots the last minutes on <canvas>,
// and runs a chat playground on /v1/chat/completions (streaming). Data never goes through
// innerHTML: every text from the server is set with textContent.
"use strict";

const POLL_MS = 1000;
const WINDOW_S = 300; // the plots' time window
const HIT_RATE_WINDOW_S = 10;
const COLORS = { prefill: "#61afef", decode: "#98c379", mixed: "#d19a66", line: "#2a323c", muted: "#8a96a3",
  a: "#61afef", b: "#e5c07b", c: "#c678dd", d: "#98c379" };

const $ = (id) => document.getElementById(id);
const fmt = (x, digits = 0) => (x === null || x === undefined || Number.isNaN(x)) ? "–" : Number(x).toFixed(digits);
const pct = (x) => fmt(100 * x, 1) + " %";

// ---- keys (this tab only) ----------------------------------------------------------------------
function keyInput(id, storageKey) {
  const el = $(id);
  el.value = sessionStorage.getItem(storageKey) || "";
  el.addEventListener("change", () => { sessionStorage.setItem(storageKey, el.value.trim()); poll(); });
  return () => el.value.trim();
}
const apiKey = keyInput("api-key", "radixserve.apiKey");
const adminKey = keyInput("admin-key", "radixserve.adminKey");
function authHeaders(key) { return key ? { Authorization: "Bearer " + key } : {}; }

// ---- history kept by the page (the server keeps the request timeline) ---------------------------
const history = []; // {t, used, cached, waiting, running}

// ---- polling -----------------------------------------------------------------------------------
let polling = false;
let lastState = null;
async function poll() {
  if (polling) return;
  polling = true;
  try {
    const r = await fetch("/dashboard/state", { headers: authHeaders(adminKey() || apiKey()), cache: "no-store" });
    if (!r.ok) {
      let message = r.status + " " + r.statusText;
      try { message = (await r.json()).error.message || message; } catch (e) { /* not JSON */ }
      showError(r.status === 401 || r.status === 403
        ? message + " (enter the key under Keys, top right)" : message);
      setStatus("no data", "bad");
      if (r.status === 401 || r.status === 403) $("keys").open = true;
      return;
    }
    const st = await r.json();
    showError(null);
    lastState = st;
    render(st);
  } catch (e) {
    showError("The server does not answer: " + e.message);
    setStatus("offline", "bad");
  } finally {
    polling = false;
  }
}

function showError(message) {
  const el = $("error");
  el.hidden = !message;
  el.textContent = message || "";
}
function setStatus(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = "pill " + (cls || "");
}

// ---- rendering ---------------------------------------------------------------------------------
function kvOf(replica) {
  const d = replica.dashboard;
  return d ? d.kv : { total: replica.max_total_num_tokens || 0, free: replica.available_tokens || 0,
    evictable: replica.evictable_tokens || 0, protected: replica.protected_tokens || 0, private: 0 };
}

function render(st) {
  $("model").textContent = st.model + " · context " + st.context_len;
  setStatus(st.server_status.toLowerCase(), st.server_status === "Up" ? "ok" : "");
  $("updated").textContent = "updated " + new Date(st.time * 1000).toLocaleTimeString();
  const s = st.scheduler;
  const replicas = st.replicas;
  const sum = (f) => replicas.reduce((a, r) => a + f(r), 0);
  const kv = { total: 0, free: 0, evictable: 0, protected: 0, private: 0 };
  for (const r of replicas) for (const k in kv) kv[k] += kvOf(r)[k] || 0;
  $("c-running").textContent = fmt(sum((r) => r.num_running_reqs || 0));
  $("c-waiting").textContent = fmt(sum((r) => r.num_waiting_reqs || 0));
  $("c-throughput").textContent = fmt(lastSecondsRate(st.timeline, "gen_tokens", 5), 1);
  $("c-hitrate").textContent = s.prompt_tokens ? pct(s.cached_tokens / s.prompt_tokens) : "–";
  $("c-usage").textContent = kv.total ? pct((kv.total - kv.free - kv.evictable) / kv.total) : "–";
  $("c-evicted").textContent = fmt(sum((r) => (r.dashboard || {}).evicted_tokens || 0));
  $("c-retractions").textContent = fmt(sum((r) => r.num_retractions || 0));
  $("dp-note").textContent = st.dp_size > 1 ? "(" + st.dp_size + " DP replicas)" : "";

  history.push({ t: st.time, used: kv.total ? (kv.total - kv.free - kv.evictable) / kv.total : 0,
    cached: kv.total ? kv.evictable / kv.total : 0,
    waiting: sum((r) => r.num_waiting_reqs || 0), running: sum((r) => r.num_running_reqs || 0) });
  while (history.length && history[0].t < st.time - WINDOW_S) history.shift();
  draw(st);
}

function draw(st) {
  renderReplicas(st.replicas);
  renderPlots(st);
}

function lastSecondsRate(timeline, field, seconds) {
  const now = Date.now() / 1000;
  let total = 0;
  for (const b of timeline) if (b.t >= Math.floor(now) - seconds) total += b[field];
  return total / seconds;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function renderReplicas(replicas) {
  const box = $("replicas");
  while (box.children.length > replicas.length) box.lastChild.remove();
  replicas.forEach((r, i) => {
    let panel = box.children[i];
    if (!panel) { panel = buildReplicaPanel(); box.appendChild(panel); }
    fillReplicaPanel(panel, r, i, replicas.length);
  });
}

function buildReplicaPanel() {
  const p = el("div", "replica");
  p.appendChild(el("h3"));
  const gauge = el("div", "gauge kv-gauge");
  for (const seg of ["private", "protected", "evictable", "free"]) gauge.appendChild(el("div", "seg-" + seg));
  p.appendChild(gauge);
  const legend = el("div", "legend");
  for (const [seg, label] of [["private", "running (own)"], ["protected", "running (shared, in tree)"],
    ["evictable", "cached in tree"], ["free", "free"]]) {
    const span = el("span"); const swatch = el("i", "seg-" + seg); span.appendChild(swatch);
    span.appendChild(document.createTextNode(label)); span.dataset.seg = seg; legend.appendChild(span);
  }
  p.appendChild(legend);
  p.appendChild(el("div", "kv-line kv-numbers"));
  p.appendChild(el("div", "kv-line extra-pools"));
  const batches = el("canvas", "batches");
  p.appendChild(batches);
  p.appendChild(el("div", "kv-line last-batch"));
  p.appendChild(el("div", "stats"));
  const table = el("table", "prefixes");
  const head = el("tr");
  for (const [h, w] of [["shared prefix (tokens)", "16%"], ["sequences", "12%"], ["in use", "10%"], ["begins with", "62%"]]) {
    const th = el("th", null, h); th.style.width = w; head.appendChild(th);
  }
  const thead = el("thead"); thead.appendChild(head); table.appendChild(thead); table.appendChild(el("tbody"));
  p.appendChild(table);
  return p;
}

function fillReplicaPanel(p, r, i, n) {
  const d = r.dashboard || {};
  const kv = kvOf(r);
  p.querySelector("h3").textContent = n > 1 ? "DP replica " + i : "Replica 0";
  const gauge = p.querySelector(".kv-gauge");
  for (const seg of ["private", "protected", "evictable", "free"]) {
    gauge.querySelector(".seg-" + seg).style.width = (kv.total ? 100 * kv[seg] / kv.total : 0) + "%";
    gauge.dataset[seg] = kv[seg];
  }
  gauge.title = "KV slots: " + kv.total;
  p.querySelector(".kv-numbers").textContent = "KV slots " + kv.total + ": running own " + kv.private +
    ", running shared " + kv.protected + ", cached " + kv.evictable + ", free " + kv.free +
    " · evicted " + (d.evicted_tokens || 0) + " · retractions " + (r.num_retractions || 0) +
    " (" + (r.num_retracted_reqs || 0) + " requests)";
  const extra = [];
  if (r.swa_max_total_num_tokens !== undefined) {
    extra.push("SWA pool: " + (r.swa_used_tokens || 0) + " / " + r.swa_max_total_num_tokens + " slots in use");
  }
  if (r.mamba_pool_size !== undefined) {
    extra.push("state pool: " + (r.mamba_pool_size - (r.available_mamba_slots || 0)) + " / " + r.mamba_pool_size +
      " slots in use (" + (r.evictable_mamba_slots || 0) + " cached snapshots)");
  }
  p.querySelector(".extra-pools").textContent = extra.join(" · ");
  drawBatches(p.querySelector(".batches"), d.recent_batches || []);
  const last = (d.recent_batches || []).slice(-1)[0];
  p.querySelector(".last-batch").textContent = last
    ? "last batch: " + last.kind + " · " + last.num_reqs + " requests · " + last.num_tokens + " tokens · " +
      fmt(last.step_ms, 1) + " ms" : "no batch yet";
  const q = d.queues || {};
  const tree = d.tree || {};
  const stats = p.querySelector(".stats");
  stats.replaceChildren();
  for (const [k, v] of [["waiting", q.waiting ?? r.num_waiting_reqs], ["running", q.running ?? r.num_running_reqs],
    ["chunked prefill", q.chunked], ["grammar queue", r.num_grammar_queue_reqs],
    ["prefill batches", r.num_prefill_batches], ["decode batches", r.num_decode_batches],
    ["mixed batches", r.num_mixed_batches], ["tree nodes", tree.num_nodes], ["tree leaves", tree.num_leaves],
    ["tokens in tree", tree.cached_tokens], ["longest sequence", tree.max_depth],
    ["hit rate", r.prompt_tokens ? pct(r.cached_tokens / r.prompt_tokens) : "–"],
    ["new token ratio", fmt(r.new_token_ratio, 2)]]) {
    const div = el("div"); div.appendChild(document.createTextNode(k + ": "));
    div.appendChild(el("b", null, v === undefined || v === null ? "–" : String(v))); stats.appendChild(div);
  }
  const tbody = p.querySelector(".prefixes tbody");
  tbody.replaceChildren();
  for (const sp of tree.shared_prefixes || []) {
    const tr = el("tr");
    tr.appendChild(el("td", null, String(sp.num_tokens)));
    tr.appendChild(el("td", null, String(sp.num_sequences)));
    tr.appendChild(el("td", null, sp.in_use ? "yes" : "no"));
    // one line for its beginning and, when longer, one for its end (what tells alike prefixes apart)
    const oneLine = (text) => text.replace(/\n/g, "⏎");
    const cell = el("td");
    cell.appendChild(el("div", "preview", (sp.namespace ? "[" + sp.namespace + "] " : "") +
      oneLine(sp.preview ?? sp.head_ids.join(" "))));
    if (sp.tail_ids.length) cell.appendChild(el("div", "preview", "… " + oneLine(sp.preview_tail ?? sp.tail_ids.join(" "))));
    tr.appendChild(cell);
    tbody.appendChild(tr);
  }
  if (!tbody.children.length) {
    const tr = el("tr"); const td = el("td", "muted", "no prefix shared by two cached sequences yet");
    td.colSpan = 4; tr.appendChild(td); tbody.appendChild(tr);
  }
}

// ---- canvas drawing ----------------------------------------------------------------------------
function sizeCanvas(c) {
  const ratio = window.devicePixelRatio || 1;
  const w = Math.max(c.clientWidth, 10), h = Math.max(c.clientHeight, 10);
  if (c.width !== Math.round(w * ratio) || c.height !== Math.round(h * ratio)) {
    c.width = Math.round(w * ratio); c.height = Math.round(h * ratio);
  }
  const ctx = c.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  return { ctx, w, h };
}

function drawBatches(c, batches) {
  const { ctx, w, h } = sizeCanvas(c);
  c.dataset.count = batches.length;
  if (!batches.length) return;
  const maxTokens = Math.max(...batches.map((b) => b.num_tokens), 1);
  const bw = w / 64;
  batches.forEach((b, i) => {
    const bh = Math.max(2, (h - 14) * Math.log1p(b.num_tokens) / Math.log1p(maxTokens));
    ctx.fillStyle = COLORS[b.kind] || COLORS.muted;
    ctx.fillRect(w - (batches.length - i) * bw + 1, h - 12 - bh, bw - 2, bh);
  });
  ctx.font = "10px sans-serif";
  let x = 2;
  for (const [text, color] of [["last " + batches.length + " batches, height: tokens (log) ·", COLORS.muted],
    ["prefill", COLORS.prefill], ["decode", COLORS.decode], ["mixed", COLORS.mixed]]) {
    ctx.fillStyle = color; ctx.fillText(text, x, h - 2); x += ctx.measureText(text).width + 6;
  }
}

// series: [{name, color, points: [[t, v], ...]}]; t in seconds (wall clock)
function drawLines(c, series, opts) {
  const { ctx, w, h } = sizeCanvas(c);
  const now = opts.now, t0 = now - WINDOW_S;
  const pad = { l: 42, r: 8, t: 6, b: 16 };
  let ymax = opts.ymax || 0;
  for (const s of series) for (const [, v] of s.points) ymax = Math.max(ymax, v);
  ymax = ymax > 0 ? niceCeil(ymax) : 1;
  const X = (t) => pad.l + (w - pad.l - pad.r) * (t - t0) / WINDOW_S;
  const Y = (v) => h - pad.b - (h - pad.t - pad.b) * v / ymax;
  ctx.strokeStyle = COLORS.line; ctx.fillStyle = COLORS.muted; ctx.font = "10px sans-serif"; ctx.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const v = ymax * k / 4, y = Y(v);
    ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(w - pad.r, y); ctx.stroke();
    ctx.fillText(shortNum(v), 2, y + 3);
  }
  for (let m = 0; m <= WINDOW_S / 60; m++) {
    const x = X(now - m * 60);
    ctx.fillText(m === 0 ? "now" : "-" + m + " min", Math.min(x - 10, w - 30), h - 3);
  }
  let legendX = pad.l + 4;
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.fillStyle = s.color; ctx.lineWidth = 1.5;
    ctx.beginPath();
    let started = false;
    for (const [t, v] of s.points) {
      if (t < t0) continue;
      if (!started) { ctx.moveTo(X(t), Y(v)); started = true; } else ctx.lineTo(X(t), Y(v));
    }
    ctx.stroke();
    if (s.points.length === 1) ctx.fillRect(X(s.points[0][0]) - 1.5, Y(s.points[0][1]) - 1.5, 3, 3);
    if (series.length > 1) { ctx.fillText(s.name, legendX, pad.t + 10); legendX += ctx.measureText(s.name).width + 10; }
  }
  const main = series[0].points;
  c.dataset.points = main.length;
  c.dataset.last = main.length ? main[main.length - 1][1] : "";
  c.dataset.max = main.length ? Math.max(...main.map((p) => p[1])) : "";
}

function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}
function shortNum(v) {
  if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (v >= 1e3) return (v / 1e3).toFixed(1) + "k";
  return v >= 10 || v === 0 ? v.toFixed(0) : v.toFixed(v >= 1 ? 1 : 2);
}

function renderPlots(st) {
  const now = st.time;
  const first = Math.floor(now) - WINDOW_S;
  const bySecond = new Map(st.timeline.map((b) => [b.t, b]));
  const throughput = [], ttft = [], itl = [], hit = [];
  let windowPrompt = 0, windowCached = 0;
  const windowBuckets = [];
  for (let t = first; t <= Math.floor(now); t++) {
    const b = bySecond.get(t);
    throughput.push([t, b ? b.gen_tokens : 0]);
    if (b && b.ttft_n) ttft.push([t, 1000 * b.ttft_sum / b.ttft_n]);
    if (b && b.itl_n) itl.push([t, 1000 * b.itl_sum / b.itl_n]);
    windowBuckets.push(b);
    if (b) { windowPrompt += b.prompt_tokens; windowCached += b.cached_tokens; }
    if (windowBuckets.length > HIT_RATE_WINDOW_S) {
      const old = windowBuckets.shift();
      if (old) { windowPrompt -= old.prompt_tokens; windowCached -= old.cached_tokens; }
    }
    if (b && b.first_tokens && windowPrompt > 0) hit.push([t, 100 * windowCached / windowPrompt]);
  }
  drawLines($("plot-throughput"), [{ name: "tok/s", color: COLORS.a, points: throughput }], { now });
  drawLines($("plot-ttft"), [{ name: "TTFT", color: COLORS.b, points: ttft }], { now });
  drawLines($("plot-itl"), [{ name: "ITL", color: COLORS.c, points: itl }], { now });
  drawLines($("plot-hitrate"), [{ name: "hit rate", color: COLORS.d, points: hit }], { now, ymax: 100 });
  drawLines($("plot-kv"), [
    { name: "in use", color: "#e06c75", points: history.map((x) => [x.t, 100 * x.used]) },
    { name: "cached", color: COLORS.a, points: history.map((x) => [x.t, 100 * x.cached]) },
  ], { now, ymax: 100 });
  drawLines($("plot-queues"), [
    { name: "running", color: COLORS.d, points: history.map((x) => [x.t, x.running]) },
    { name: "waiting", color: COLORS.b, points: history.map((x) => [x.t, x.waiting]) },
  ], { now });
}

// ---- chat playground ---------------------------------------------------------------------------
const chat = { messages: [], controller: null };

function addMessage(role, text) {
  const div = el("div", "msg " + role);
  div.appendChild(el("span", "text", text));
  $("chat-log").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function numberInput(id, fallback) {
  const v = parseFloat($(id).value);
  return Number.isFinite(v) ? v : fallback;
}

async function sendChat(text) {
  const system = $("chat-system").value.trim();
  chat.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  const bubbleText = bubble.querySelector(".text");
  bubble.dataset.state = "streaming";
  const body = {
    model: lastState ? lastState.model : undefined,
    messages: (system ? [{ role: "system", content: system }] : []).concat(chat.messages),
    stream: true, stream_options: { include_usage: true },
    temperature: numberInput("chat-temperature", 0.7), top_p: numberInput("chat-top-p", 1),
    max_tokens: Math.round(numberInput("chat-max-tokens", 128)),
  };
  chat.controller = new AbortController();
  $("chat-send").disabled = true; $("chat-stop").disabled = false;
  const t0 = performance.now();
  let tFirst = null, answer = "", usage = null, chunks = 0;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", signal: chat.controller.signal,
      headers: Object.assign({ "Content-Type": "application/json" }, authHeaders(apiKey())),
      body: JSON.stringify(body),
    });
    if (!r.ok) {
      let message = r.status + " " + r.statusText;
      try { message = (await r.json()).error.message || message; } catch (e) { /* not JSON */ }
      throw new Error(message);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const msg = JSON.parse(data);
          if (msg.error) throw new Error(msg.error.message);
          if (msg.usage) usage = msg.usage;
          const delta = (msg.choices && msg.choices[0] && msg.choices[0].delta) || {};
          const piece = delta.content || ""; // (a --reasoning-parser's reasoning_content is not shown)
          if (piece) {
            if (tFirst === null) tFirst = performance.now();
            chunks += 1;
            answer += piece;
            bubbleText.textContent = answer;
            bubble.scrollIntoView({ block: "end" });
          }
        }
      }
    }
    chat.messages.push({ role: "assistant", content: answer });
    if (!answer) bubbleText.textContent = "(empty answer)";
    bubble.appendChild(el("span", "meta", answerStats(usage, t0, tFirst, performance.now(), chunks)));
    bubble.dataset.state = "done";
  } catch (e) {
    chat.messages.pop(); // the question goes unanswered: not part of the conversation
    bubble.classList.add("error");
    bubbleText.textContent = answer + (e.name === "AbortError" ? " [stopped]" : "Error: " + e.message);
    bubble.dataset.state = "error";
  } finally {
    chat.controller = null;
    $("chat-send").disabled = false; $("chat-stop").disabled = true;
  }
}

function answerStats(usage, t0, tFirst, tEnd, chunks) {
  const tokens = usage ? usage.completion_tokens : chunks;
  const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : null;
  const parts = [];
  if (usage) parts.push("cached " + cached + " / " + usage.prompt_tokens + " prompt tokens");
  parts.push(tokens + " tokens");
  if (tFirst !== null) {
    parts.push("TTFT " + fmt(tFirst - t0, 0) + " ms");
    const decodeS = (tEnd - tFirst) / 1000;
    parts.push(fmt(tokens > 1 && decodeS > 0 ? (tokens - 1) / decodeS : tokens / ((tEnd - t0) / 1000), 1) + " tok/s");
  }
  return parts.join(" · ");
}

$("chat-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || chat.controller) return;
  $("chat-input").value = "";
  sendChat(text);
});
$("chat-input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("chat-form").requestSubmit(); }
});
$("chat-stop").addEventListener("click", () => { if (chat.controller) chat.controller.abort(); });
$("chat-clear").addEventListener("click", () => { chat.messages = []; $("chat-log").replaceChildren(); });

window.addEventListener("resize", () => { if (lastState) draw(lastState); });
poll();
setInterval(poll, POLL_MS);
