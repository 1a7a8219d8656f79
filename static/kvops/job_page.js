// A job: its tokens as they stream (websocket /ws/jobs/<id>/), facts and timings (REST),
// A job: its tokens as they stream (websocket /ws/jobs/<id>/), facts and timings (REST),
// while it runs its request's block table (asked of the engine once a second), once it
// ended the blocks it held at its end (its KV story's record: the engine's is gone), and
// its KV story (REST, kv_story.js: read on load and whenever its status changes). A job
// moved between engines while it ran says which, and when (migration.js ranOnText). The
// connection's pill shows while the job is live: its socket closes once the job's end
// has come (the job stream's last message). Operators may pin the prompt it ran on its
// engine. A completion an instruct model ended at once gets a hint and a button to run
// it again as a chat.
import { api, errorText } from "./api.js";
import { ownerCss } from "./colors.js";
import { $, esc, num, plural, seconds, toast, when } from "./format.js";
import { SOURCE_WORDS, TERMINAL, storyHtml } from "./kv_story.js";
import { asChatBody, endedAtOnce, submitJob } from "./jobs_common.js";
import { ranOnText } from "./migration.js";
import { LiveSocket } from "./socket.js";

const page = JSON.parse($("#job-data").textContent);
let job = null;
let lastStatus = null;

async function loadJob() {
  const result = await api("GET", `/api/jobs/${page.id}/`);
  if (!result.ok) { toast(errorText(result), true); return; }
  job = result.data;
  renderFacts();
}

function renderFacts() {
  const p = job.params || {};
  const engineLink = job.engine ? `<a href="/engines/${esc(job.engine)}/">${esc(job.engine)}</a>` : "–";
  const requestLink = job.engine && job.request_id
    ? `<a href="/engines/${esc(job.engine)}/?request=${encodeURIComponent(job.request_id)}" title="show its blocks on the engine's map">${esc(job.request_id)}</a>` : "–";
  const rows = [
    ["owner", esc(job.owner)], ["source", esc(job.source)], ["engine", engineLink], ["request", requestLink],
    ...(job.engines?.length > 1 ? [["engines", `<span id="ran-on">${esc(ranOnText(job.engines))}</span>`]] : []),
    ["routing", esc(job.routing?.policy ?? "–")], ["attempts", job.attempts], ["priority", job.priority],
    ["sampling", esc(`max_tokens ${p.max_tokens}, temperature ${p.temperature}, top_p ${p.top_p}` +
                     (p.top_k ? `, top_k ${p.top_k}` : "") + (p.seed != null ? `, seed ${p.seed}` : ""))],
    ["prompt tokens", num(job.num_prompt_tokens)], ["cached tokens", num(job.num_cached_tokens)],
    ["output tokens", num(job.num_output_tokens)], ["preemptions", num(job.num_preemptions)],
    ["finish reason", esc(job.finish_reason || "–")],
  ];
  $("#facts").innerHTML = rows.map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("");
  const t = (iso) => (iso ? new Date(iso).getTime() / 1000 : null);
  const queued = t(job.queued_at), started = t(job.started_at), first = t(job.first_token_at), done = t(job.finished_at);
  const gen = first && done ? done - first : null;
  $("#timings").innerHTML = [
    ["queued", when(job.queued_at)], ["started", when(job.started_at)],
    ["first token", when(job.first_token_at)], ["finished", when(job.finished_at)],
    ["waited in queue", started ? seconds(started - queued) : "–"],
    ["time to first token", first && started ? seconds(first - started) : "–"],
    ["generation", gen !== null ? seconds(gen) : "–"],
    ["tokens/s", gen ? num(job.num_output_tokens / gen, 1) : "–"],
  ].map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("");
  $("#cancel").hidden = TERMINAL.has(job.status);
  renderChatHint();
  const pin = $("#pin-job");
  if (pin) {  // (operators): once the job has an engine, whose prefix cache holds its prompt
    pin.hidden = !job.engine;
    pin.title = job.engine ? `pin the prompt this job ran on engine ${job.engine}, as the engine saw it (its chat rendered, under its cache salt)` : "";
  }
}

// A completion on an instruct model (its engine's has a chat template) that ended at
// once: say why, and offer it again as a chat.
function renderChatHint() {
  const box = $("#chat-hint");
  const show = page.chat_template && endedAtOnce(job);
  box.hidden = !show;
  if (!show || box.childElementCount) return;
  box.innerHTML = `The model ended at once: an instruct model usually needs chat mode (its chat
    template wraps the prompt as a user's turn). <button class="small" id="as-chat">Resubmit as chat</button>`;
  $("#as-chat").onclick = async () => {
    const out = await submitJob(asChatBody(job));
    if (out.ok) location.href = `/jobs/${out.job.id}/`;
    else toast(out.error, true);
  };
}

// n > 1: every sample's text and finish reason, once the job has ended.
function showSamples(samples) {
  $("#samples-panel").hidden = samples.length === 0;
  const box = $("#samples");
  box.replaceChildren(...samples.map((s, i) => {
    const div = document.createElement("div");
    div.className = "output sample";
    div.style.cssText = "min-height:0;margin-bottom:6px";
    const label = document.createElement("b");
    label.textContent = String(i);
    const reason = document.createElement("span");
    reason.className = "muted";
    reason.textContent = ` ${s.finish_reason || ""} `;
    div.append(label, reason, document.createTextNode(s.text));
    return div;
  }));
}

function showState(message) {
  const status = message.status;
  $("#status").textContent = status;
  $("#status").className = `pill ${status}`;
  const out = $("#output");
  const atBottom = out.scrollTop + out.clientHeight >= out.scrollHeight - 4;
  out.textContent = message.text ?? "";
  if (!TERMINAL.has(status)) out.insertAdjacentHTML("beforeend", '<span class="caret"></span>');
  if (atBottom) out.scrollTop = out.scrollHeight;
  $("#out-count").textContent = plural(message.num_output_tokens, "token");
  showSamples(message.samples || []);
  $("#error").textContent = message.error || "";
  if (job) {  // the live counts, until the row is read again
    for (const k of ["num_output_tokens", "num_cached_tokens", "num_preemptions", "engine", "request_id", "engines"]) {
      if (message[k] !== undefined && message[k] !== "") job[k] = message[k];
    }
    renderFacts();
  }
  if (status !== lastStatus || message.finished) loadJob();
  if (status !== lastStatus) loadStory();  // admitted, or ended (or changed since the first read)
  lastStatus = status;
  if (TERMINAL.has(status)) endLive();
}

// The job ended: nothing more comes on its socket, and it is no longer live.
let ended = false;
function endLive() {
  if (ended) return;
  ended = true;
  $("#conn")?.remove();
  socket.close();
}

// The story as the job's row has it. Reads may overlap: only the latest one is shown.
// The row may lag the live status: a running job's story is written with its next
// progress, an ended one's with its end; such a read is tried again a second later.
let storyReads = 0;
const STORY_RETRIES = 5;

async function loadStory(retry = 0) {
  const read = ++storyReads;
  const result = await api("GET", `/api/jobs/${page.id}/kv/`);
  if (read !== storyReads) return;
  const body = $("#kv-story-body");
  if (!result.ok) { body.innerHTML = `<p class="error">${esc(errorText(result))}</p>`; return; }
  body.innerHTML = storyHtml(result.data, page.miss_reasons);
  const over = TERMINAL.has(result.data.status);
  $("#kv-story-when").textContent = `as of ${new Date().toLocaleTimeString(undefined, { hour12: false })}`
    + (over ? " (the job has ended: the story is whole)"
      : result.data.status === "running" ? " (running: the story grows until the job ends)" : "");
  if (over) showFinalBlocks(result.data);
  const behind = (TERMINAL.has(lastStatus ?? "") && !TERMINAL.has(result.data.status))
    || (lastStatus === "running" && !result.data.told);
  if (behind && retry < STORY_RETRIES) setTimeout(() => loadStory(retry + 1), 1000);
}

// A logical block's chip: its id, its tokens and where its K/V came from in the title.
function chip(id, k, bs, colour, more = "") {
  return `<span class="chip" style="--c:${colour}" title="logical block ${k}: tokens ${k * bs}–${(k + 1) * bs - 1}${more}">${id}</span>`;
}

// The blocks the job held at its end, as its KV story recorded them (hits and computed
// blocks alike): the engine has given them back, so it is asked nothing.
function showFinalBlocks(doc) {
  const box = $("#blocks");
  const final = doc.final_blocks;
  $("#blocks-when").textContent = "at its end";
  if (!final) {
    box.innerHTML = `<span class="muted" id="blocks-unknown">${doc.told
      ? "Its KV story does not record the blocks it held at its end (it ended before they were recorded)."
      : `No record of the blocks it held at its end: ${esc(doc.detail)}.`}</span>`;
    return;
  }
  const bs = doc.block_size || 16;
  const source = (k) => (doc.blocks[k] ? `, prompt block: ${SOURCE_WORDS[doc.blocks[k].source] ?? doc.blocks[k].source}` : "");
  const gpu = final.gpu.map((id, k) => chip(id, k, bs, "#7d8799", source(k))).join("");
  const cpu = final.cpu.map((id, k) => chip(id, k, bs, "#8a5cd6")).join("");
  box.innerHTML = `<p style="margin:0 0 6px" id="final-blocks">The request ended holding ${plural(final.gpu.length, "GPU block")}`
    + `${final.cpu.length ? ` and ${plural(final.cpu.length, "CPU block")}` : ""}; they went back to the pool`
    + ` (cached ones stay findable for prefix hits).</p>
    <div class="muted" style="font-size:12px">GPU, logical block order</div>
    <div class="chips" id="gpu-chips">${gpu || '<span class="muted">none (it held only CPU blocks, or none)</span>'}</div>
    ${cpu ? `<div class="muted" style="font-size:12px;margin-top:6px">CPU swap</div><div class="chips">${cpu}</div>` : ""}`;
}

function showBlocks(message) {
  if (ended) return;  // (an answer that crossed the end: the record is shown instead)
  const r = message.request;
  if (!r) {
    $("#blocks").innerHTML = '<span class="muted">Not on an engine yet.</span>';
    return;
  }
  const bs = message.block_size || 16;
  const hashes = r.block_hashes || [];  // the GPU blocks' hash prefixes: the owner's to see
  const hashOf = (k) => (hashes[k] ? `, hash ${hashes[k]}…` : "");
  const chips = (ids, gpu = true) => ids.map((id, k) => chip(id, k, bs, ownerCss(r.index), gpu ? hashOf(k) : "")).join("");
  $("#blocks").innerHTML = `<p style="margin:0 0 6px"><span class="pill ${esc(r.status)}">${esc(r.status)}</span>
      ${plural(r.num_computed_tokens, "token")} in ${plural(r.block_table.length, "GPU block")}${r.cpu_block_table.length ? `, ${plural(r.cpu_block_table.length, "CPU block")}` : ""}
      · <a href="/engines/${esc(message.engine)}/?request=${encodeURIComponent(r.request_id)}">on the block map</a></p>
    <div class="muted" style="font-size:12px">GPU, logical block order</div>
    <div class="chips" id="gpu-chips">${chips(r.block_table) || '<span class="muted">none (swapped out or waiting)</span>'}</div>
    ${r.cpu_block_table.length ? `<div class="muted" style="font-size:12px;margin-top:6px">CPU swap</div><div class="chips">${chips(r.cpu_block_table, false)}</div>` : ""}`;
  $("#blocks-when").textContent = `as of ${new Date().toLocaleTimeString(undefined, { hour12: false })}`;
}

const socket = new LiveSocket(`/ws/jobs/${page.id}/`, {
  onMessage: (message) => {
    if (message.type === "job") showState(message);
    else if (message.type === "blocks") showBlocks(message);
    else if (message.type === "error") console.warn("kvops:", message.message);
  },
  onStatus: (s) => {
    const pill = $("#conn");  // (a job that had ended when the page was made has none)
    if (ended || !pill) return;
    pill.textContent = s;
    pill.className = `pill conn ${s === "live" ? "live" : "offline"}`;
  },
});

setInterval(() => { if (lastStatus === "running") socket.send({ type: "blocks" }); }, 1000);

$("#cancel").onclick = async () => {
  const result = await api("POST", `/api/jobs/${page.id}/cancel/`);
  toast(result.ok ? "Cancel requested" : errorText(result), !result.ok);
  loadJob();
};
// Operators: pin the prompt this job ran on its engine (POST .../prefix-cache/pin/ {job}).
const pinButton = $("#pin-job");
if (pinButton) {
  pinButton.onclick = async () => {
    if (!job?.engine) return;
    const result = await api("POST", `/api/engines/${encodeURIComponent(job.engine)}/prefix-cache/pin/`, { job: page.id });
    const r = result.data?.result;
    const line = result.ok
      ? `Pinned on ${job.engine}: ${num(r.block_ids.length)} blocks (${num(r.num_tokens)} tokens), ${num(r.num_newly_pinned)} newly pinned`
      : `Pin on ${job.engine}: ${errorText(result)}`;
    const answer = $("#pin-answer");
    answer.hidden = false;
    answer.className = `answer ${result.ok ? "ok" : "bad"}`;
    answer.textContent = line;
    toast(line, !result.ok);
  };
}
loadJob();
loadStory();
