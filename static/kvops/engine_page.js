// The engine page: block maps, requests, charts and events of one engine, live, or as
// they were at a moment of the timeline strip (timeline.js; live updates keep the live
// state current meanwhile, unpainted). Data: a snapshot, then deltas in sequence
// (live_sync.js: a gap or a restart asks for a new snapshot); operator actions go
// through the REST API (a running request's Migrate control among them: migration.js
// says where it may go; the Retention control's form: retention.js; the Pin form's ways
// to name a prefix: pin_form.js). ?request=<id>
// selects a request once it shows; ?at=<time> opens the timeline at that moment (a job's
// KV story links here). window.kvopsPerf keeps timings for tests.
import { api, errorText, newIdempotencyKey } from "./api.js";
import { BlockMap } from "./blockmap.js";
import { blockTipHtml, sharedMark } from "./block_tip.js";
import { timeChart } from "./charts.js";
import { Palette, ownerCss } from "./colors.js";
import { diskTierCaption, diskTierFigures, diskTierNote, hasDiskTier } from "./disk_tier.js";
import { HeaderState } from "./engine_state.js";
import { kvCaption } from "./kv_format.js";
import { EventLog } from "./event_log.js";
import { $, clock, esc, num, pct, toast } from "./format.js";
import { TERMINAL, compactStoryHtml, missesHtml } from "./kv_story.js";
import { MetricsHistory, cumulativeHitRate } from "./metrics.js";
import { LiveSync } from "./live_sync.js";
import { drainText, migrationTargets, migrationText } from "./migration.js";
import { PIN_MODES, pinRequest } from "./pin_form.js";
import { RequestTable } from "./request_table.js";
import { cachedTenantKey, tenantKey, tenantPanelHtml, tenantRows, unnamedTenants } from "./tenant_kv.js";
import { EVICTION_POLICIES, currentRetention, followedForm, pinnedText, retentionForm,
         retentionRequest, retentionText } from "./retention.js";
import { LiveSocket } from "./socket.js";
import { tierWarnings } from "./tier_health.js";
import { TimelineStrip, parseMoment } from "./timeline.js";

const page = JSON.parse($("#engine-data").textContent);
const palette = new Palette();
// (cells up to 40 px: a small pool fills its panel's width instead of a strip of it)
const gpuMap = new BlockMap($("#gpu-map"), $("#gpu-overlay"), palette, { maxHeight: 660, maxCell: 40 });
const cpuMap = new BlockMap($("#cpu-map"), $("#cpu-overlay"), palette, { maxHeight: 260, maxCell: 12 });
const history = new MetricsHistory(600);
// `log` keeps the last few snapshots and resyncs, with why and when (tests, console).
const perf = window.kvopsPerf = { deltas: 0, snapshots: 0, resyncs: 0, applyMs: [], decodeMs: [], log: [],
                                  scrubMs: [], seekMs: [], fetchMs: [], addMs: [], scrubWhole: 0,  // the timeline's (timeline.js)
                                  scrubParts: { maps: 0, table: 0, rest: 0 },
                                  parts: { state: 0, maps: 0, table: 0, rest: 0 },
                                  lastDeltaAt: 0, bytes: () => socket.bytes, frames: () => socket.frames,
                                  reconnects: () => socket.reconnects };
const sync = new LiveSync();
let state = null;  // the KVState on screen: sync.state, or a past one while scrubbing
let heldEvents = [];  // the live deltas' events while scrubbing, logged on the way back
let selected = null;  // request index
let prevCounts = [null, null];  // preemptions, swaps out: the charts' totals follow them
const query = new URLSearchParams(location.search);
let wanted = query.get("request");  // select once it shows up (live, or at the moment opened)
const timeline = new TimelineStrip($("#timeline"), page.name, {
  onShow: (shown) => showPast(shown), onLive: () => backToLive(), current: () => state, perf });
if (query.get("at")) {
  const at = parseMoment(query.get("at"));
  if (at === null) toast(`?at=${query.get("at")} is not a time: give Unix seconds or an ISO 8601 time`, true);
  else timeline.openAt(at);
}
window.kvops = { state: () => state, live: () => sync.state, scrubbing: () => timeline.scrubbing, timeline,
                 selected: () => selected, gpuMap, cpuMap };  // tests, console

// A plain user's view is sealed (kvops/dashboard/visibility.py): no block hashes, and requests of
// other tenants (another user's, or staff's) shown as such; their own by their tenant label.
const othersOf = (r) => Boolean(state?.sealed) && r.tenant !== page.tenant;
const table = new RequestTable($("#requests"), {
  operator: page.operator,
  othersOf,
  onSelect: (index) => select(index, false),
  onAction: (action, requestId, { to }) => (action === "migrate" ? migrate(requestId, to) : requestAction(action, requestId)),
});
const events = new EventLog($("#events"), $("#ev-rate"), $("#show-churn"), {
  onRequest: (requestId) => { const r = state?.requestById(requestId); if (r) select(r.index, true); },
});

// --- the live connection --------------------------------------------------------------
const socket = new LiveSocket(`/ws/engines/${encodeURIComponent(page.name)}/`, {
  onOpen: () => {
    sync.subscribed();
    socket.send({ type: "subscribe", level: "full" });
    socket.send({ type: "history", what: "events", count: 300 });
    socket.send({ type: "history", what: "metrics", count: 600 });
  },
  onMessage: (message, meta) => handle(message, meta),
  onStatus: (status) => setConnection(status),
});

function handle(message, meta) {
  switch (message.type) {
    case "hello": stateFromEngine(message.alive ? (message.metrics?.state || "ready") : message.status); break;
    case "snapshot": loadSnapshot(message); break;
    case "delta": applyDelta(message, meta); break;
    case "history":
      if (message.what === "events") events.load(message.items);
      else { history.load(message.items); drawCharts(); }
      break;
    case "block": blockAnswer(message); break;
    case "error": toast(message.message, true); break;
    default: break;
  }
}

function loadSnapshot(snapshot) {
  sync.applySnapshot(snapshot);
  for (const [id, key] of [["#limit-seqs", "max_num_seqs"], ["#limit-tokens", "max_num_batched_tokens"]]) {
    const input = $(id);  // (operators only) the engine's limits now, unless being edited
    if (input && document.activeElement !== input && snapshot.config?.[key] != null) input.value = snapshot.config[key];
  }
  showRetention(currentRetention(snapshot.metrics, snapshot.config));
  perf.snapshots++;
  note({ snapshot: snapshot.seq, epoch: snapshot.epoch, stale: !!snapshot.stale });
  if (!snapshot.stale) socket.healthy();
  setConnection(snapshot.stale ? "stale" : "live");
  if (timeline.scrubbing) return;  // shown on the way back
  state = sync.state;
  showWhole();
}

// Paint the state on screen from scratch (a snapshot, the first moment of a scrub, back to live).
function showWhole() {
  const [keyOf, cachedKey] = colourKeys();
  for (const map of [gpuMap, cpuMap]) [map.keyOf, map.cachedKey] = [keyOf, cachedKey];
  gpuMap.attach(state.gpu, state.evictRank, $("#gpu-wrap").clientWidth);
  cpuMap.attach(state.cpu, null, $("#cpu-wrap").clientWidth);
  $("#gpu-caption").textContent = `${num(state.gpu.n)} blocks of ${state.config.block_size} tokens${kvCaption(state.config)}${groupsCaption(state.config)}${splitCaption(state.config)}`;
  $("#cpu-caption").textContent = state.cpu.n === 0 ? "none: this engine has no CPU pool (no swap space)"
    : `${num(state.cpu.n)} blocks${state.config.cpu_prefix_cache
      ? " · also the prefix cache's second tier: its cached blocks were copied from the GPU" : ""}`;
  $("#disk-tier").hidden = !hasDiskTier(state.config);
  table.setState(state);
  if (selected !== null && !state.requests.has(selected)) selected = null;
  if (selected !== null) select(selected, false);
  pickWanted();
  renderHead();
}

// The engine's state in the header: ready, paused (an operator's pause), dead, ...; the
// operator's button says what it would do. After this page's own command the answer
// wins over deltas still on their way with the old state (engine_state.js).
let engineState = null;
const header = new HeaderState();

function stateFromEngine(s) {
  if (header.fromEngine(s)) showState(s);
}

function stateFromAnswer(s) {
  header.fromAnswer(s);
  showState(s);
}

function showState(s) {
  if (s === engineState) return;
  engineState = s;
  $("#engine-status").className = `pill ${s}`;
  $("#engine-status").textContent = s;
  const toggle = $("#pause-toggle");
  if (toggle) toggle.textContent = s === "paused" ? "Resume" : "Pause";
  const drain = $("#drain-toggle");
  if (drain) {
    drain.textContent = s === "draining" || s === "drained" ? "Undrain" : "Drain";
    $("#drain-mode").hidden = drain.textContent === "Undrain";  // (an undrain has no mode)
  }
}

function applyDelta(delta, meta) {
  if (delta.metrics?.state) {
    stateFromEngine(delta.metrics.state);
    perf.engineState = delta.metrics.state;  // as the engine last said it (tests)
  }
  const started = performance.now();
  const result = sync.applyDelta(delta);
  if (result.needsResync) askResync(result.needsResync);
  if (!result.ok) return;
  showRetention(currentRetention(delta.metrics, sync.state.config));  // (live, also while scrubbing)
  if (result.nowLive) setConnection("live");  // a stored snapshot the engine's deltas follow
  if (timeline.scrubbing) {  // kept, not painted
    heldEvents.push([delta.events, delta.event_counts]);
    if (heldEvents.length > 600) heldEvents.shift();  // the log keeps fewer lines anyway
    if (history.add({ ts: delta.ts, ...delta.metrics })) {  // (the last minutes, not the moment shown)
      drawMisses();
      showTierHealth();
    }
    return;
  }
  const applied = performance.now();
  const [painted, tabled] = paintChanges(result.changed);
  if (delta.metrics.num_preemptions !== prevCounts[0] || delta.metrics.num_swaps_out !== prevCounts[1]) {
    prevCounts = [delta.metrics.num_preemptions, delta.metrics.num_swaps_out];
    drawCharts();
  }
  events.add(delta.events, delta.event_counts);
  if (history.add({ ts: delta.ts, ...delta.metrics })) drawCharts();
  pickWanted();
  void table.body.offsetHeight;  // lay the page out now: the measured time includes it
  const done = performance.now();
  perf.parts.state += applied - started;
  perf.parts.maps += painted - applied;
  perf.parts.table += tabled - painted;
  perf.parts.rest += done - tabled;
  perf.applyMs.push(done - started);
  perf.decodeMs.push(started - meta.received);
  perf.deltas++;
  perf.lastDeltaAt = performance.now();
}

// Repaint what changed in the state on screen (a delta, or a move along the timeline):
// the cells, the selected request's path, the table, the header. Returns when the maps
// and the table were done (performance.now()).
function paintChanges(changed) {
  gpuMap.paint(changed.gpu);
  gpuMap.flush();
  cpuMap.paint(changed.cpu);
  cpuMap.flush();
  const painted = performance.now();
  if (selected !== null) {
    const r = state.requests.get(selected);
    if (!r) select(null, false);
    else if (changed.tables.has(selected)) { gpuMap.updateSelection(r.block_table); cpuMap.updateSelection(r.cpu_block_table); }
  }
  table.refresh(changed.structural);
  const tabled = performance.now();
  renderHead();
  if (selected !== null) renderSelected();
  return [painted, tabled];
}

// --- the timeline -------------------------------------------------------------------------
function showPast(shown) {
  const started = performance.now();
  document.body.classList.add("scrubbing");
  let painted = started, tabled = started;
  if (shown.changed === null) {
    state = shown.state;
    showWhole();
  } else {
    if (shown.state !== state) {  // the first move: the same pools' cells, where they differ
      state = shown.state;
      gpuMap.swap(state.gpu, state.evictRank);
      cpuMap.swap(state.cpu, null);
      table.setState(state);
    }
    [painted, tabled] = paintChanges(shown.changed);
  }
  pickWanted();  // (a request that exists only in the past)
  void table.body.offsetHeight;  // lay the page out now: the measured time includes it
  const parts = perf.scrubParts;
  parts.maps += painted - started;
  parts.table += tabled - painted;
  parts.rest += performance.now() - tabled;
}

function backToLive() {
  document.body.classList.remove("scrubbing");
  state = sync.state;
  if (state) showWhole();
  for (const [items, counts] of heldEvents) events.add(items, counts);
  heldEvents = [];
  drawCharts();
}

function note(what) {
  perf.log.push({ at: Math.round(performance.now()), ...what });
  if (perf.log.length > 50) perf.log.shift();
}

// The sync asked for a snapshot again (a gap, or silence): say so to the server.
function askResync(why) {
  perf.resyncs++;
  note({ resync: why });
  socket.send({ type: "resync" });
}

function setConnection(status) {
  const el = $("#conn");
  el.textContent = status;
  el.className = `pill conn ${status === "live" ? "live" : status === "stale" ? "stale" : "offline"}`;
}

// Silence asks for a snapshot again (which also has the server re-join its groups); a
// snapshot that does not come reconnects, with a growing delay (live_sync.js says when).
setInterval(() => {
  if (!socket.open) return;  // the socket reconnects by itself
  const todo = sync.check();
  if (todo?.reconnect) {
    setConnection("reconnecting");
    socket.reconnect();
  } else if (todo?.resync) {
    setConnection("resyncing");
    askResync(todo.resync);
  }
}, 500);

// --- header, charts -------------------------------------------------------------------
const HEAD = [
  ["GPU KV used", (m) => pct(m.kv_usage)], ["CPU swap used", (m) => pct(m.cpu_kv_usage)],
  ["running", (m) => num(m.running)], ["waiting", (m) => num(m.waiting)], ["swapped", (m) => num(m.swapped)],
  ["prefix hit rate", (m) => pct(cumulativeHitRate(m))], ["tokens/s", (m) => num(m.generation_tokens_per_s)],
  ["preemptions", (m) => num(m.num_preemptions)],
  ["swaps out/in", (m) => `${num(m.num_swaps_out)}/${num(m.num_swaps_in)}`],
];
$("#head-stats").innerHTML = HEAD.map(([label]) => `<span class="kv"><b>–</b><span>${label}</span></span>`).join("");
const headValues = [...document.querySelectorAll("#head-stats b")];

function renderHead() {
  const m = state.metrics || {};
  $("#seq").textContent = `step ${num(state.step)} · seq ${state.seq}`;
  HEAD.forEach(([, value], k) => {
    const text = value(m);
    if (headValues[k].textContent !== text) headValues[k].textContent = text;
  });
  $("#req-count").textContent = `${num(table.count)} shown of ${num(state.requests.size)}`;
  if (hasDiskTier(state.config)) renderDiskTier(m);
  renderTenants(m);
}

// KV by tenant: the panel, redrawn when its figures changed; the block maps' "by tenant"
// mode colours a used block by its owner request's tenant (a plain viewer's: theirs or
// others'). page.tenant_names: staff's, the user names of the labels the service knows.
let tenantsShown = "", tenantsMetrics = null;
const namesAsked = new Map();  // label -> when its name was last asked for (ms)
function renderTenants(m) {
  tenantsMetrics = m;
  const html = tenantPanelHtml(tenantRows(m.kv_by_tenant, { mine: page.tenant, names: page.tenant_names ?? {} }));
  if (html !== tenantsShown) $("#tenant-kv").innerHTML = tenantsShown = html;
  if (page.operator) askTenantNames(unnamedTenants(m.kv_by_tenant, page.tenant_names ?? {}, namesAsked, Date.now()));
}

// Staff: the user names of tenants that came after the page loaded (a label the page
// has no name for), asked again at most every NAMES_ASK_MS while the answer lacks it
// (the service reads the engine's last heartbeat, which may be behind the live state).
async function askTenantNames(labels) {
  if (!labels.length) return;
  for (const label of labels) namesAsked.set(label, Date.now());
  const result = await api("GET", `/api/engines/${encodeURIComponent(page.name)}/tenants/`);
  if (!result.ok) return;
  page.tenant_names = { ...(page.tenant_names ?? {}) };
  for (const row of result.data.tenants) if (row.user) page.tenant_names[row.tenant] = row.user;
  if (tenantsMetrics) renderTenants(tenantsMetrics);
}

// [used cells' key by owner index, cached cells' key by tenant32], or nulls: by request
function colourKeys() {
  return $("#colour-by").value === "tenant"
    ? [(index) => tenantKey(state?.requests.get(index)), cachedTenantKey] : [null, null];
}
$("#colour-by").addEventListener("change", () => {
  if (!state) return;
  gpuMap.colourBy(...colourKeys());
  cpuMap.colourBy(...colourKeys());
});

// The disk tier: counts and a hit share (there may be millions of blocks: no map), as
// of the state on screen. Its figures' boxes are made once; their texts change.
function renderDiskTier(m) {
  const figures = diskTierFigures(m);
  const box = $("#disk-stats");
  if (box.children.length !== figures.length) {
    box.innerHTML = figures.map((f) => `<span class="kv" data-figure="${f.key}"><b></b><span>${f.label}</span></span>`).join("");
  }
  figures.forEach((f, k) => {
    const figure = box.children[k];
    if (figure.firstChild.textContent !== f.text) figure.firstChild.textContent = f.text;
    if (figure.title !== f.title) figure.title = f.title;
  });
  const caption = diskTierCaption(m, state.config), note = diskTierNote(m);
  if ($("#disk-caption").textContent !== caption) $("#disk-caption").textContent = caption;
  if ($("#disk-note").textContent !== note) $("#disk-note").textContent = note;
}

// Warnings about the prefix cache's tiers over the last minutes of metrics this page
// has (tier_health.js): shown above the maps, hidden while there are none.
let tierHealthHtml = "";  // the warnings shown

function showTierHealth() {
  const warnings = tierWarnings(history.points);
  const html = warnings.map((w) => `<li class="${w.kind}" data-tier="${w.tier}">${esc(w.text)}</li>`).join("");
  if (html === tierHealthHtml) return;
  tierHealthHtml = html;
  $("#tier-warnings").innerHTML = html;
  $("#tier-health").hidden = warnings.length === 0;
}

function drawCharts() {
  timeChart($("#chart-kv"), [
    { color: "#2f5bd3", values: history.field("kv_usage") },
    { color: "#8a5cd6", values: history.field("cpu_kv_usage") },
  ], { max: 1, format: (v) => `${Math.round(v * 100)}%` });
  timeChart($("#chart-hit"), [{ color: "#1d8a4e", values: history.hitRate() }],
            { max: 1, format: (v) => `${Math.round(v * 100)}%` });
  timeChart($("#chart-pre"), [
    { color: "#c62f2f", values: history.rate("num_preemptions"), bars: true },
    { color: "#8a5cd6", values: history.rate("num_swaps_out") },
  ], { integer: true });
  drawMisses();
  showTierHealth();
  const last = state?.metrics || history.points[history.points.length - 1] || {};
  $("#now-kv").textContent = pct(last.kv_usage);
  $("#now-hit").textContent = `overall ${pct(cumulativeHitRate(last))}`;
  $("#now-pre").textContent = `${num(last.num_preemptions)} / ${num(last.num_swaps_out)} in total`;
}

// Prompt tokens missed per first-miss reason over the last MISSES_SPAN_S of the metrics
// points this page has (the stored history, then live): the growth of the engine's
// cumulative counters (missed_tokens_by_reason) between them; preemptions by cause too.
const MISSES_SPAN_S = 300;

function drawMisses() {
  const newest = history.points[history.points.length - 1];
  const missed = newest && history.increases("missed_tokens_by_reason", newest.ts - MISSES_SPAN_S);
  if (!missed) {
    $("#misses-span").textContent = "";
    $("#misses").innerHTML = '<p class="muted">Waiting for two metrics samples…</p>';
    return;
  }
  const span = newest.ts - missed.from;
  $("#misses-span").textContent = span >= MISSES_SPAN_S - 1 ? `over the last ${MISSES_SPAN_S / 60} minutes`
    : `since ${clock(missed.from)}, the oldest sample this page has (${Math.round(span)} s)`;
  $("#misses").innerHTML = missesHtml(missed.totals, page.miss_reasons);
  const preempted = history.increases("preemptions_by_reason", missed.from).totals;
  const causes = Object.entries(preempted).filter(([, n]) => n > 0).sort((a, b) => b[1] - a[1]);
  $("#preempted-by").textContent = causes.length
    ? `Preemptions by cause, same span: ${causes.map(([reason, n]) => `${reason} ${num(n)}`).join(" · ")}`
    : "No preemptions in this span.";
}

// --- selection ------------------------------------------------------------------------
function select(index, reveal) {
  selected = index;
  table.selected = index;
  const r = index === null ? null : state.requests.get(index);
  gpuMap.select(r ? r.block_table : null);
  cpuMap.select(r && r.cpu_block_table.length ? r.cpu_block_table : null);
  if (reveal && r) table.reveal(index);
  table.renderRows();
  renderSelected();
}

function pickWanted() {
  if (!wanted || !state) return;
  const r = state.requestById(wanted);
  if (!r) return;
  wanted = null;
  if (!table.shows(r)) {  // (a finished one, say): asked for by name, so it shows
    $("#req-filter").value = "all";
    table.setFilter("all", $("#req-search").value);
  }
  select(r.index, true);
}

// A model with a block table per layer group (sliding and global layers): a block holds
// one group's layers, and a request's blocks are its tables' in every group (the table
// shown is the global group's).
function groupsCaption(config) {
  const windows = config.kv_group_windows || [];
  if (windows.length < 2) return "";
  const sliding = windows.filter((w) => w);
  return ` · a table per layer group: ${windows.length - sliding.length} global, ${sliding.length} sliding (window ${num(Math.max(...sliding))}); a request's sliding-group blocks are drawn as its own, its table shows the global group's`;
}

// A model split across tensor-parallel ranks: how many, and what each rank holds.
function splitCaption(config) {
  const ranks = config.rank_memory || [];
  if ((config.tensor_parallel_size || 1) < 2) return "";
  const mib = (b) => `${num(Math.round(b / 1048576))} MiB`;
  const each = ranks.map((r) => `rank ${r.rank} (${r.device}): ${mib(r.weight_bytes)} weights + ${mib(r.kv_bytes)} KV`);
  return ` · split over ${config.tensor_parallel_size} ranks, each holding its heads' share of every block: ${each.join("; ")}`;
}

function chips(ids, poolName) {
  const p = state[poolName];
  return ids.map((id, k) => `<span class="chip" style="--c:${ownerCss(p.owner[id])}" title="logical block ${k}, ref ${p.ref_cnt[id]}">${id}${p.ref_cnt[id] > 1 ? `<span class="chip-shared">${sharedMark(p.ref_cnt[id])}</span>` : ""}</span>`).join("");
}

// The panel's head and details are drawn again with every change; the Migrate control
// between them (operators) is kept, so that a choice made in it stays.
function renderSelected() {
  const r = selected === null ? null : state.requests.get(selected);
  renderMove(r);
  if (!r) {
    $("#selected-head").innerHTML = `<h3>Selected request</h3><p class="muted">Click a request in the table, or a block on the map, to follow its block table.</p>`;
    $("#selected-detail").innerHTML = "";
    return;
  }
  const shared = r.block_table.filter((id) => state.gpu.ref_cnt[id] > 1).length;
  $("#selected-head").innerHTML = `<h3>Selected request</h3>
    <p><span class="mono">${esc(r.request_id)}</span> <span class="pill ${esc(r.status)}">${esc(r.status)}</span>
    ${othersOf(r) ? '· <span class="muted">another user\'s request</span>'
    : r.job_id ? `· <a href="/jobs/${esc(r.job_id)}/">job ${esc(r.job_id)}</a>` : ""}
    <button class="small secondary" id="unselect" style="float:right">clear</button></p>
    ${page.operator && r.job_id ? `<button class="small secondary" id="pin-job" title="pin the prompt this job ran (as the engine saw it, under its cache salt)">Pin this job's prefix</button>` : ""}`;
  $("#selected-detail").innerHTML = `<p class="muted">${num(r.num_computed_tokens)} tokens computed, ${num(r.num_cached_tokens)} from the prefix cache;
    ${r.block_table.length} GPU blocks (${shared} shared), ${r.cpu_block_table.length} CPU blocks.</p>
    <div class="muted" style="font-size:12px">GPU block table, in order (×2, ×3: shared by that many)</div>
    <div class="chips">${chips(r.block_table, "gpu") || '<span class="muted">none</span>'}</div>
    ${r.cpu_block_table.length ? `<div class="muted" style="font-size:12px;margin-top:6px">CPU block table</div><div class="chips">${chips(r.cpu_block_table, "cpu")}</div>` : ""}
    <div id="selected-story">${storyOf(r)}</div>`;
  $("#unselect").onclick = () => select(null, false);
  const pinJob = $("#pin-job");
  if (pinJob) pinJob.onclick = () => prefixAction("pin", { job: Number(r.job_id) }, null);
}

// The selected request's job's KV story (GET /api/jobs/<id>/kv/), for a viewer who may
// see the job (staff, or its owner: another user's request shows none). Fetched when
// the selection names another job, and again when the request's status changes until
// the story fetched is its ended job's (then it is whole).
const story = { job: null, status: null, doc: null, html: "" };

function storyOf(r) {
  const job = r.job_id && !othersOf(r) ? String(r.job_id) : null;
  if (job === null) return "";
  const whole = story.job === job && story.doc && TERMINAL.has(story.doc.status);
  if (story.job !== job || (!whole && story.status !== r.status)) loadStory(job, r.status);
  return story.html;
}

async function loadStory(job, status) {
  if (story.job !== job) Object.assign(story, { doc: null, html: '<p class="muted">Loading its KV story…</p>' });
  Object.assign(story, { job, status });
  const result = await api("GET", `/api/jobs/${encodeURIComponent(job)}/kv/`);
  if (story.job !== job || story.status !== status) return;  // asked again meanwhile
  story.doc = result.ok ? result.data : null;
  story.html = result.ok ? compactStoryHtml(result.data, page.miss_reasons)
    : `<p class="muted">No KV story: ${esc(errorText(result))}</p>`;
  const box = $("#selected-story");
  if (box) box.innerHTML = story.html;
}

// --- hover and click on the maps --------------------------------------------------------
// The tooltip shows what the state on screen says of the block at once; resting on a
// live block asks the engine the rest (`block`: its holders' text, idle time and place
// in the eviction order; block_tip.js), redrawn when the answer comes if still hovered.
const tooltip = $("#tooltip");
const ASK_AFTER_MS = 150;  // of rest on one block
const hovered = { pool: null, id: -1, facts: null, timer: null, at: null };

function showTip() {
  if (hovered.id < 0 || !state) return;
  tooltip.innerHTML = blockTipHtml(state, hovered.pool, hovered.id, hovered.facts, othersOf);
  tooltip.style.display = "block";
  const { x: cx, y: cy } = hovered.at;
  const right = cx < window.innerWidth / 2;  // open toward the wider side
  const x = right ? Math.min(cx + 14, window.innerWidth - tooltip.offsetWidth - 8)
                  : Math.max(8, cx - 14 - tooltip.offsetWidth);
  const y = Math.min(cy + 14, window.innerHeight - tooltip.offsetHeight - 8);
  tooltip.style.left = `${x}px`;
  tooltip.style.top = `${y}px`;
}

function hover(poolName, id, event) {
  hovered.at = { x: event.clientX, y: event.clientY };
  if (poolName !== hovered.pool || id !== hovered.id) {
    clearTimeout(hovered.timer);
    Object.assign(hovered, { pool: poolName, id, facts: null, timer: null });
    // (a past moment of the timeline: the engine can only say what is now)
    if (id >= 0 && !timeline.scrubbing) {
      hovered.timer = setTimeout(() => socket.send({ type: "block", pool: poolName, id }), ASK_AFTER_MS);
    }
  }
  if (id < 0) { tooltip.style.display = "none"; return; }
  showTip();
}

function blockAnswer(message) {
  if (message.pool !== hovered.pool || message.id !== hovered.id || timeline.scrubbing) return;
  if (message.error) { toast(`block ${message.id}: ${message.error}`, true); return; }
  hovered.facts = message.facts;
  showTip();
}

for (const [map, poolName] of [[gpuMap, "gpu"], [cpuMap, "cpu"]]) {
  map.canvas.addEventListener("mousemove", (event) => {
    if (!state) return;
    const id = map.blockAt(event);
    map.setHover(id);
    hover(poolName, id, event);
  });
  map.canvas.addEventListener("mouseleave", (event) => { map.setHover(-1); hover(poolName, -1, event); });
  map.canvas.addEventListener("click", (event) => {
    if (!state) return;
    const id = map.blockAt(event);
    const owner = id >= 0 ? state[poolName].owner[id] : 0;
    select(owner && state.requests.has(owner) ? owner : null, true);
  });
}

window.addEventListener("resize", () => {
  if (!state) return;
  gpuMap.attach(state.gpu, state.evictRank, $("#gpu-wrap").clientWidth);
  cpuMap.attach(state.cpu, null, $("#cpu-wrap").clientWidth);
  if (selected !== null) select(selected, false);
});

$("#req-filter").addEventListener("change", () => { table.setFilter($("#req-filter").value, $("#req-search").value); renderHead(); });
$("#req-search").addEventListener("input", () => { table.setFilter($("#req-filter").value, $("#req-search").value); renderHead(); });

// --- operator actions -------------------------------------------------------------------
// What a drain does with the requests running there, by its mode (the header's chooser).
const DRAIN_MODES = {
  wait: "the running ones finish here",
  migrate: "the running ones move, with their KV caches, to the other engines of its model",
  abort: "the running ones are aborted now (their jobs end as cancelled)",
};
const LABELS = { preempt: "Preempt", "swap-out": "Swap out", "swap-in": "Swap in", abort: "Abort",
                 evict: "Evict", reset: "Reset", pin: "Pin", unpin: "Unpin" };

function confirmAction(text) {
  const dialog = $("#confirm");
  $("#confirm-text").textContent = text;
  dialog.showModal();
  return new Promise((resolve) => dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true }));
}

// POST an operator action; its answer goes to the Engine answer panel (in a line, then
// whole) and a toast. `key`: an Idempotency-Key; `describe`: the answer's result in words.
async function act(path, body, what, { key = null, describe = null } = {}) {
  const result = await api("POST", path, body, key ? { "Idempotency-Key": key } : {});
  const said = !result.ok ? errorText(result)
    : describe && result.data?.result ? describe(result.data.result) : "done";
  showAnswer(`${what}: ${said}`, result.ok, `HTTP ${result.status}\n${JSON.stringify(result.data, null, 2)}`);
  loadActions();
  return result;
}

// A line in the Engine answer panel (with `details` under it) and a toast: an action's
// answer, or why a form was not sent.
function showAnswer(line, ok, details = "") {
  const answer = $("#answer");
  if (answer) {
    answer.className = `answer ${ok ? "ok" : "bad"}`;
    answer.textContent = details ? `${line}\n${details}` : line;
  }
  toast(line, !ok);
}

async function requestAction(action, requestId) {
  if (!(await confirmAction(`${LABELS[action]} request ${requestId} on engine ${page.name}?`))) return;
  await act(`/api/engines/${encodeURIComponent(page.name)}/requests/${encodeURIComponent(requestId)}/${action}/`,
            {}, `${LABELS[action]} ${requestId}`);
}

// --- moving a request to another engine ---------------------------------------------------
// The engines a running request may move to, from the engine list (read every
// DESTINATIONS_MS): the table's rows and the selected request's panel offer them.
const DESTINATIONS_MS = 5000;
const moves = {
  to: [],  // engine names, the least loaded first (migration.js migrationTargets)
  why: "",  // why there are none, in words
  busy: false,  // the panel's move is being answered
  last: null,  // the last move asked for from this page: {request, ok, text}
  keys: new Map(),  // "request→engine" -> the Idempotency-Key of a move not answered yet
};

async function loadDestinations() {
  const result = await api("GET", "/api/engines/");
  if (result.ok) {
    moves.to = migrationTargets(result.data, page.name, page.config);
    moves.why = moves.to.length ? "" : "no other engine can take it now: none is alive, ready, "
      + "serving this engine's model and able to receive moving requests";
  } else {
    moves.to = [];
    moves.why = `the engines could not be read: ${errorText(result)}`;
  }
  table.setDestinations(moves.to);
  if (state) renderMove(selected === null ? null : state.requests.get(selected));
}

// The selected request's Migrate control: shown while it runs, with the answer to the
// last move asked for it from here. Its chooser is rebuilt only when the engines change.
function renderMove(r) {
  const box = $("#selected-move");
  if (!box) return;  // (not an operator)
  box.hidden = !r || r.status !== "running";
  const answer = $("#move-answer");
  answer.hidden = !r || moves.last?.request !== r.request_id;
  if (!answer.hidden) {
    answer.className = `answer ${moves.last.ok ? "ok" : "bad"}`;
    answer.textContent = moves.last.text;
  }
  const chooser = $("#move-to");
  if ([...chooser.options].map((o) => o.value).join("\n") !== moves.to.join("\n")) {
    const chosen = chooser.value;
    chooser.replaceChildren(...moves.to.map((name) => new Option(name, name, false, name === chosen)));
  }
  chooser.disabled = moves.to.length === 0;
  $("#move").disabled = moves.to.length === 0 || moves.busy;
  $("#move-none").textContent = moves.why;
}

async function migrate(requestId, to) {
  if (!to) { toast(`Migrate ${requestId}: ${moves.why || "choose the engine to move it to"}`, true); return; }
  if (!(await confirmAction(`Move request ${requestId} from engine ${page.name} to ${to}, with its KV cache? It runs on there.`))) return;
  // The key stays until an answer comes: asked again after a dropped connection, the
  // move happens once and the second call gets the first one's answer.
  const attempt = `${requestId}→${to}`;
  if (!moves.keys.has(attempt)) moves.keys.set(attempt, newIdempotencyKey());
  moves.busy = true;
  renderMove(selected === null ? null : state.requests.get(selected));
  const result = await act(`/api/engines/${encodeURIComponent(page.name)}/requests/${encodeURIComponent(requestId)}/migrate/`,
                           { to, staged: true }, `Migrate ${requestId}`, { key: moves.keys.get(attempt), describe: migrationText });
  if (result.status !== 0) moves.keys.delete(attempt);
  moves.busy = false;
  moves.last = { request: requestId, ok: result.ok, text: result.ok ? migrationText(result.data.result) : errorText(result) };
  loadDestinations();  // (redraws the panel)
}

// --- retention: what the prefix cache keeps (operators) -----------------------------------
// The engine's eviction policy and pin budget follow its live metrics; a field the
// operator has changed keeps the change until Apply (retention.js followedForm).
const retention = {
  now: null,  // the engine's retention as last heard (retention.js currentRetention)
  filled: null,  // the form as this page last filled it: {eviction_policy, percent}
};

function retentionFields() {
  return { eviction_policy: $("#retention-policy").value, percent: $("#retention-budget").value };
}

function showRetention(now) {
  if (!page.operator) return;
  retention.now = now;
  const form = followedForm(retentionFields(), retention.filled, now);
  if ($("#retention-policy").value !== form.eviction_policy) $("#retention-policy").value = form.eviction_policy;
  if ($("#retention-budget").value !== form.percent) $("#retention-budget").value = form.percent;
  retention.filled = retentionForm(now);
  const text = pinnedText(now);
  if ($("#retention-pinned").textContent !== text) $("#retention-pinned").textContent = text;
}

async function applyRetention() {
  if (!retention.now) {
    showAnswer("Retention: the engine's settings have not come yet; try again once the page is live", false);
    return;
  }
  const asked = retentionRequest(retentionFields(), retention.now);
  if (asked.error) { showAnswer(`Retention: ${asked.error}`, false); return; }
  const result = await act(`/api/engines/${encodeURIComponent(page.name)}/retention/`, asked.body, "Retention",
                           { describe: retentionText });
  if (result.ok) {
    retention.filled = retentionFields();  // the engine took the form: it follows the engine again
    showRetention(result.data.result);
  }
}

async function prefixAction(action, body, question) {
  if (question && !(await confirmAction(question))) return;
  await act(`/api/engines/${encodeURIComponent(page.name)}/prefix-cache/${action}/`, body, `${LABELS[action]} (prefix cache)`);
}

if (page.operator) {
  $("#pause-toggle").onclick = async () => {
    const action = engineState === "paused" ? "resume" : "pause";
    if (action === "pause" && !(await confirmAction(`Pause engine ${page.name}? No step runs until you resume it; its requests keep their place and their KV blocks.`))) return;
    const result = await act(`/api/engines/${encodeURIComponent(page.name)}/${action}/`, {}, `${action === "pause" ? "Pause" : "Resume"} ${page.name}`);
    if (result.ok) stateFromAnswer(result.data?.result?.state || (action === "pause" ? "paused" : "ready"));
  };
  $("#drain-toggle").onclick = async () => {
    const path = (action) => `/api/engines/${encodeURIComponent(page.name)}/${action}/`;
    if (engineState === "draining" || engineState === "drained") {
      const result = await act(path("undrain"), {}, `Undrain ${page.name}`);
      if (result.ok) stateFromAnswer(result.data?.result?.state || "ready");
      return;
    }
    const mode = $("#drain-mode").value;
    if (!(await confirmAction(`Drain engine ${page.name}? No new jobs are routed to it; ${DRAIN_MODES[mode]}.`))) return;
    const result = await act(path("drain"), { mode }, `Drain ${page.name}`, { describe: drainText });
    if (result.ok) stateFromAnswer(result.data?.result?.state || "draining");
  };
  $("#move").onclick = () => {
    const r = selected === null ? null : state.requests.get(selected);
    if (r) migrate(r.request_id, $("#move-to").value);
  };
  loadDestinations();
  setInterval(loadDestinations, DESTINATIONS_MS);
  $("#limit-apply").onclick = async () => {
    const body = {};
    const seqs = $("#limit-seqs").value.trim(), tokens = $("#limit-tokens").value.trim();
    if (seqs !== "") body.max_num_seqs = Number(seqs);
    if (tokens !== "") body.max_num_batched_tokens = Number(tokens);
    await act(`/api/engines/${encodeURIComponent(page.name)}/limits/`, body, "Batch limits");
  };
  $("#retention-policy").replaceChildren(...Object.entries(EVICTION_POLICIES).map(
    ([policy, what]) => new Option(`${policy}: ${what}`, policy)));
  retention.filled = retentionFields();
  $("#retention-apply").onclick = applyRetention;
  $("#evict").onclick = () => {
    const n = $("#evict-n").value.trim();
    prefixAction("evict", n === "" ? {} : { num_blocks: Number(n) },
                 `Evict ${n === "" ? "every" : n} cached block${n === "1" ? "" : "s"} at ref count 0?`);
  };
  $("#reset").onclick = () => prefixAction("reset", {}, "Reset the prefix cache (forget every cached block, unpin all)?");
  $("#pin-mode").replaceChildren(...Object.entries(PIN_MODES).map(([mode, m]) => new Option(m.label, mode)));
  const showPinMode = () => { $("#pin-prompt").placeholder = PIN_MODES[$("#pin-mode").value].placeholder; };
  $("#pin-mode").onchange = showPinMode;
  showPinMode();
  const pinForm = (action) => {
    const asked = pinRequest($("#pin-mode").value, $("#pin-prompt").value);
    if (asked.error) showAnswer(`${LABELS[action]}: ${asked.error}`, false);
    else prefixAction(action, asked.body, null);
  };
  $("#pin").onclick = () => pinForm("pin");
  $("#unpin").onclick = () => pinForm("unpin");
}

async function loadActions() {
  const result = await api("GET", "/api/actions/?limit=100");
  const body = $("#actions tbody");
  if (!result.ok) { body.innerHTML = `<tr><td class="error">${esc(errorText(result))}</td></tr>`; return; }
  const rows = result.data.results.filter((a) => a.engine === page.name).slice(0, 12);
  body.innerHTML = rows.map((a) => `<tr><td class="muted">${new Date(a.created_at).toLocaleTimeString(undefined, { hour12: false })}</td>
    <td>${esc(a.user ?? "–")}</td><td><b>${esc(a.action)}</b> <span class="mono">${esc(a.target)}</span></td>
    <td><span class="pill ${a.ok ? "finished" : "failed"}">${a.status_code}</span></td></tr>`).join("")
    || `<tr><td class="muted">No operator actions on this engine yet.</td></tr>`;
}
loadActions();
setInterval(loadActions, 10000);
