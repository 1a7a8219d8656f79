// The engine page's "What if" panel (templates/kvops/_what_if.html, operators only):
// start a replay of this engine's recent jobs under another configuration, follow its
// progress, and show both replays side by side. A run is followed by polling its
// resource once a second until it has ended.
import { api, errorText } from "./api.js";
import { leverChart, timeChart } from "./charts.js";
import { esc } from "./format.js";
import {
  commonTimeline, comparisonRows, fidelityText, requestBody, sweepSeries, sweepSuggestion, sweepTable,
  traceSummary,
} from "./what_if_report.js";

const panel = document.getElementById("what-if");
const form = document.getElementById("wi-form");
const statusLine = document.getElementById("wi-status");
const progress = document.getElementById("wi-progress");
const runButton = document.getElementById("wi-run");
const collection = `/api/engines/${encodeURIComponent(panel.dataset.engine)}/what-if/`;
const POLL_MS = 1000;
const COLORS = { baseline: "#2f5bd3", alternative: "#e07b00" };
let followed = null;  // id of the run on screen
let shown = null;  // that run, as last read (tests, console)
window.kvopsWhatIf = { run: () => shown };

// A lever chosen to sweep with no values yet: suggest some, from the engine's value
// (its field's placeholder).
document.getElementById("wi-sweep-lever").addEventListener("change", (event) => {
  const values = document.getElementById("wi-sweep-values");
  const lever = event.target.value;
  if (!lever || values.value.trim()) return;
  values.value = sweepSuggestion(lever, form.elements[lever]?.placeholder);
});

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  const values = Object.fromEntries(new FormData(form).entries());
  runButton.disabled = true;
  const answer = await api("POST", collection, requestBody(values));
  runButton.disabled = false;
  if (!answer.ok) {
    setStatus(`Not started: ${errorText(answer)}`, true);
    return;
  }
  follow(answer.data.id);
});

async function follow(id) {
  followed = id;
  const answer = await api("GET", `${collection}${id}/`);
  if (followed !== id) return;  // another run was started meanwhile
  if (!answer.ok) {
    setStatus(`Run ${id} could not be read: ${errorText(answer)}`, true);
    return;
  }
  show(answer.data);
  if (answer.data.status === "queued" || answer.data.status === "running") {
    setTimeout(() => follow(id), POLL_MS);
  }
}

function setStatus(text, bad = false) {
  statusLine.textContent = text;
  statusLine.className = bad ? "error" : "muted";
}

function show(run) {
  shown = run;
  panel.dataset.status = run.status;
  const unfinished = run.status === "queued" || run.status === "running";
  progress.hidden = !unfinished;
  progress.value = run.progress;
  if (run.status === "failed") setStatus(`Run ${run.id} failed: ${run.error}`, true);
  else if (unfinished) {
    setStatus(`Run ${run.id} ${run.status}` + (run.status === "running"
      ? ` (${Math.round(100 * run.progress)}%)` : "") + (run.note ? ` — ${run.note}` : ""));
  } else setStatus(`Run ${run.id}, asked by ${run.user ?? "?"} at ${new Date(run.created_at).toLocaleTimeString()}`);
  document.getElementById("wi-trace").textContent = traceSummary(run.trace);
  const finished = run.status === "finished";
  const fidelity = finished ? fidelityText(run.baseline) : { missed: false, text: "" };
  const line = document.getElementById("wi-fidelity");
  line.textContent = fidelity.text;
  line.className = fidelity.missed ? "error" : "muted";
  line.hidden = !fidelity.text;
  const swept = finished ? sweepSeries(run) : null;
  document.getElementById("wi-results").hidden = !finished || swept !== null;
  document.getElementById("wi-sweep").hidden = swept === null;
  if (swept) drawSweep(run, swept);
  else if (finished) drawResults(run);
}

function drawSweep(run, series) {
  const table = sweepTable(run);
  document.querySelector("#wi-sweep-table thead").innerHTML = `<tr><th></th>${
    table.columns.map((c) => `<th class="num">${esc(c)}</th>`).join("")}</tr>`;
  document.querySelector("#wi-sweep-table tbody").innerHTML = table.rows.map((row) =>
    `<tr data-row="${esc(row.label)}"><td>${esc(row.label)}</td>${
      row.cells.map((c) => `<td class="num">${esc(c)}</td>`).join("")}</tr>`).join("");
  for (const span of panel.querySelectorAll(".wi-lever")) span.textContent = series.label;
  const flat = (v) => series.values.map(() => v);
  const reference = "#5d6678";
  leverChart(document.getElementById("wi-chart-sweep-hit"), [
    { label: "engine's configuration", color: reference, values: flat(series.baseline.hitRate), dashed: true },
    { label: "replayed", color: COLORS.baseline, values: series.hitRate },
  ], series.values, { max: 1, format: (v) => `${Math.round(100 * v)}%` });
  const ms = (v) => (v >= 1 ? `${v.toFixed(1)} s` : `${Math.round(1000 * v)} ms`);
  leverChart(document.getElementById("wi-chart-sweep-ttft"), [
    { label: "engine's p50", color: COLORS.baseline, values: flat(series.baseline.ttftP50), dashed: true },
    { label: "engine's p99", color: COLORS.alternative, values: flat(series.baseline.ttftP99), dashed: true },
    { label: "p50", color: COLORS.baseline, values: series.ttftP50 },
    { label: "p99", color: COLORS.alternative, values: series.ttftP99 },
  ], series.values, { format: ms });
}

function drawResults(run) {
  let section = null;
  const html = [];
  for (const row of comparisonRows(run)) {
    if (row.section !== section) {
      section = row.section;
      html.push(`<tr><th colspan="4">${esc(section)}</th></tr>`);
    }
    html.push(`<tr data-row="${esc(row.label)}"><td>${esc(row.label)}</td>`
      + `<td class="num" data-run="baseline">${esc(row.baseline)}</td>`
      + `<td class="num" data-run="alternative">${esc(row.alternative)}</td>`
      + `<td class="num">${esc(row.change)}</td></tr>`);
  }
  document.querySelector("#wi-table tbody").innerHTML = html.join("");
  for (const [canvas, key, options] of [
    ["wi-chart-kv", "gpu", { max: 1, format: (v) => `${Math.round(100 * v)}%` }],
    ["wi-chart-waiting", "waiting", { integer: true }]]) {
    const line = commonTimeline(run.baseline.timeline, run.alternative.timeline, key);
    timeChart(document.getElementById(canvas), [
      { label: "engine's configuration", color: COLORS.baseline, values: line.baseline },
      { label: "alternative", color: COLORS.alternative, values: line.alternative },
    ], { ...options, xLabel: `0 to ${line.end.toFixed(1)} s, simulated` });
  }
}

// The latest run of this engine, if any, when the page opens.
(async () => {
  const answer = await api("GET", collection);
  if (answer.ok && answer.data.length && followed === null) {
    const latest = answer.data[0];
    if (latest.status === "queued" || latest.status === "running") follow(latest.id);
    else show(latest);
  }
})();
