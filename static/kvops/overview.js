// Overview: a card per engine (metrics over its summary websocket), recent jobs, submit,
// and which engine holds a prefix (prefix_lookup.js).
import { api, errorText } from "./api.js";
import { sparkCaption, sparkline } from "./charts.js";
import { $, esc, num, pct } from "./format.js";
import { followChatMode, jobRow, submitJob } from "./jobs_common.js";
import { cumulativeHitRate } from "./metrics.js";
import { LOOKUP_MODES, TIERS, lookupRequest, lookupTable } from "./prefix_lookup.js";
import { LiveSocket } from "./socket.js";

const SPARK_POINTS = 120;  // metrics points asked for after a load (one a second)
const SPARK_SECONDS = 120;  // what the sparkline spans
const summaries = window.kvopsSummaries = {};  // engine name -> summaries received (tests)

for (const card of document.querySelectorAll(".card[data-engine]")) {
  const name = card.dataset.engine;
  const field = (f) => card.querySelector(`[data-f="${f}"]`);
  const points = [];  // [ts, generated tokens/s], the last SPARK_SECONDS
  let lastSeen = 0;
  const show = (m) => {
    field("kv").textContent = pct(m.kv_usage);
    field("gauge").style.width = `${Math.round(100 * (m.kv_usage || 0))}%`;
    field("running").textContent = num(m.running);
    field("waiting").textContent = num(m.waiting);
    field("swapped").textContent = num(m.swapped);
    field("hit").textContent = pct(cumulativeHitRate(m));
    field("tps").textContent = num(m.generation_tokens_per_s);
  };
  const drawSpark = () => {
    const newest = points.length ? points[points.length - 1][0] : 0;
    const kept = points.findIndex(([ts]) => ts >= newest - SPARK_SECONDS);
    if (kept > 0) points.splice(0, kept);
    const values = points.map(([, v]) => v);
    sparkline(field("spark"), values);
    field("spark-label").textContent = sparkCaption("generated tokens/s", points);
  };
  const status = (text, kind) => { field("status").textContent = text; field("status").className = `pill ${kind}`; };
  const socket = new LiveSocket(`/ws/engines/${encodeURIComponent(name)}/`, {
    onOpen: () => {
      socket.send({ type: "subscribe", level: "summary" });
      socket.send({ type: "history", what: "metrics", count: SPARK_POINTS });
    },
    onMessage: (message) => {
      if (message.type === "hello") {
        const state = message.alive ? (message.metrics?.state || "ready") : message.status;
        status(state, state);
        if (message.metrics && Object.keys(message.metrics).length) show(message.metrics);
      } else if (message.type === "history") {
        points.splice(0, points.length, ...message.items.map((p) => [p.ts, p.generation_tokens_per_s || 0]));
        if (message.items.length) show(message.items[message.items.length - 1]);
        drawSpark();
      } else if (message.type === "summary") {
        lastSeen = performance.now();
        summaries[name] = (summaries[name] || 0) + 1;
        const state = message.metrics?.state || "ready";
        status(state, state);
        show(message.metrics);
        points.push([message.metrics.ts, message.metrics.generation_tokens_per_s || 0]);
        drawSpark();
      }
    },
    onStatus: (s) => { if (s !== "live") status(s, "offline"); },
  });
  setInterval(() => {
    if (lastSeen && performance.now() - lastSeen > 5000) status("not publishing", "stale");
  }, 1000);
}

async function loadJobs() {
  const result = await api("GET", "/api/jobs/?limit=10");
  const body = $("#recent-jobs tbody");
  if (!result.ok) { body.innerHTML = `<tr><td colspan="6" class="error">${esc(result.status)}</td></tr>`; return; }
  body.innerHTML = result.data.results.map(jobRow).join("") || `<tr><td colspan="6" class="muted">No jobs yet.</td></tr>`;
}
loadJobs();
setInterval(loadJobs, 3000);

// chat by default where the engine's model has a chat template (jobs_common.js)
followChatMode($("#quick-submit"), JSON.parse($("#chat-engines").textContent), (mode) => {
  $("#quick-submit").prompt.placeholder = mode === "chat" ? "A message to the model…" : "A prompt for the model to continue…";
});

$("#quick-submit").addEventListener("submit", async (event) => {
  event.preventDefault();
  const form = event.target;
  const body = { max_tokens: Number(form.max_tokens.value) };
  if (form.mode.value === "chat") body.messages = [{ role: "user", content: form.prompt.value }];
  else body.prompt = form.prompt.value;
  if (form.engine.value) body.engine = form.engine.value;
  const out = await submitJob(body);
  $("#quick-result").innerHTML = out.ok
    ? `Job <a href="/jobs/${out.job.id}/">${out.job.id}</a> queued.`
    : `<span class="error">${esc(out.error)}</span>`;
  if (out.ok) { form.prompt.value = ""; loadJobs(); }
});

// Which engine holds this prefix: POST /api/prefix-lookup/, its answer as a table.
const lookupForm = $("#lookup-form");
lookupForm.mode.replaceChildren(...Object.entries(LOOKUP_MODES).map(([mode, m]) => new Option(m.label, mode)));
const showLookupMode = () => { lookupForm.prefix.placeholder = LOOKUP_MODES[lookupForm.mode.value].placeholder; };
lookupForm.mode.onchange = showLookupMode;
showLookupMode();

function showLookup(summary, bad, rows = null) {
  $("#lookup-summary").textContent = summary;
  $("#lookup-summary").className = bad ? "error" : "";
  $("#lookup-table").hidden = !rows?.length;
  const cell = (n, tier) => (n === null ? `<td class="num muted" title="${tier ? "no such tier in this view" : "no answer"}">–</td>` : `<td class="num">${num(n)}</td>`);
  $("#lookup-table tbody").innerHTML = (rows || []).map((r) => (r.error !== undefined
    ? `<tr data-engine="${esc(r.engine)}"><td>${esc(r.engine)}</td><td colspan="5" class="error">${esc(r.error)}</td></tr>`
    : `<tr data-engine="${esc(r.engine)}" data-view="${esc(r.view)}"><td>${esc(r.engine)}</td><td>${esc(r.view)}</td>`
      + TIERS.map((t) => cell(r[t], r.total !== null)).join("") + cell(r.total, false) + "</tr>")).join("");
}

lookupForm.addEventListener("submit", async (event) => {
  event.preventDefault();
  const asked = lookupRequest(lookupForm.mode.value, lookupForm.prefix.value, lookupForm.model.value,
                              lookupForm.user?.value ?? "");
  if (asked.error) { showLookup(asked.error, true); return; }
  showLookup("Looking up…", false);
  const result = await api("POST", "/api/prefix-lookup/", asked.body);
  if (!result.ok) { showLookup(`Look-up failed: ${errorText(result)}`, true); return; }
  const { summary, rows } = lookupTable(result.data);
  showLookup(summary, false, rows);
});
