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
