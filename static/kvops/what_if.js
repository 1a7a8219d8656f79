// The engine page's "What if" panel (templates/kvops/_what_if.html, operators only):
// start a replay of this engine's recent jobs under another configuration, follow its
// progress, and show both replays side by side. A run is followed by polling its
// resource once a second until it has ended.
import { api, errorText } from "./api.js";
import { timeChart } from "./charts.js";
import { esc } from "./format.js";
import { commonTimeline, comparisonRows, fidelityText, requestBody, traceSummary } from "./what_if_report.js";

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
  document.getElementById("wi-results").hidden = !finished;
  if (finished) drawResults(run);
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
