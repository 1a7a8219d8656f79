// Job lists and job submission, shared by the overview and the jobs page.
import { api, errorText } from "./api.js";
import { esc, num, when } from "./format.js";

export function jobRow(job) {
  const prompt = job.prompt || (job.messages || []).map((m) => `${m.role}: ${m.content}`).join(" | ");
  return `<tr><td><a href="/jobs/${job.id}/">${job.id}</a></td>
    <td><span class="pill ${esc(job.status)}">${esc(job.status)}</span></td>
    <td>${job.engine ? `<a href="/engines/${esc(job.engine)}/">${esc(job.engine)}</a>` : '<span class="muted">–</span>'}</td>
    <td title="${esc(prompt)}">${esc(prompt.slice(0, 80))}${prompt.length > 80 ? "…" : ""}</td>
    <td class="num">${num(job.num_output_tokens)}</td><td class="muted">${when(job.queued_at)}</td></tr>`;
}

// POST /api/jobs/; returns {ok, job | error}.
export async function submitJob(body) {
  const result = await api("POST", "/api/jobs/", body);
  return result.ok ? { ok: true, job: result.data } : { ok: false, error: errorText(result) };
}

// --- chat or completion ---------------------------------------------------------------
// chat: engine name -> its model has a chat template (true), has none (false), or is not
// readable by the web server (null). An instruct model wants chat mode: a raw prompt
// often ends it at once.
export function chatByDefault(chat, engine) {
  return engine ? chat[engine] === true : Object.values(chat).some((has) => has === true);
}

// A form's mode radios (name=mode, values chat and prompt) follow its engine chooser
// (name=engine) until the user picks a mode; onMode(mode) shows the mode's fields.
export function followChatMode(form, chat, onMode) {
  let chosen = false;
  const set = (mode) => {
    for (const radio of form.querySelectorAll("input[name=mode]")) radio.checked = radio.value === mode;
    onMode(mode);
  };
  const follow = () => { if (!chosen) set(chatByDefault(chat, form.engine.value) ? "chat" : "prompt"); };
  for (const radio of form.querySelectorAll("input[name=mode]")) {
    radio.addEventListener("change", () => { chosen = true; onMode(form.mode.value); });
  }
  form.engine.addEventListener("change", follow);
  follow();
}

// A completion that ended at once: finished on a stop (the model's end of sequence) with
// at most one token. On an instruct model this is the raw prompt's doing.
export function endedAtOnce(job) {
  return job.status === "finished" && !job.messages?.length && job.finish_reason === "stop"
    && job.num_output_tokens <= 1;
}

// The body that submits a completion job again as a chat: its prompt the user's turn,
// its sampling settings, priority and engine kept.
export function asChatBody(job) {
  const p = job.params || {};
  const out = { messages: [{ role: "user", content: job.prompt }], priority: job.priority ?? 0 };
  for (const key of ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop"]) {
    if (p[key] !== undefined && p[key] !== null) out[key] = p[key];
  }
  const engine = job.requested_engine || job.engine;
  if (engine) out.engine = engine;
  return out;
}
