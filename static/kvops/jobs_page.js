// Jobs: the list (filters, pages, refreshed every few seconds) and the submit form (chat
// or completion: chat by default for an instruct model).
import { api, errorText } from "./api.js";
import { $, esc } from "./format.js";
import { followChatMode, jobRow, submitJob } from "./jobs_common.js";

const PAGE = 50;
let offset = 0;

async function load() {
  const params = new URLSearchParams({ limit: PAGE, offset });
  if ($("#f-status").value) params.set("status", $("#f-status").value);
  if ($("#f-engine").value) params.set("engine", $("#f-engine").value);
  if ($("#f-mine")?.checked) params.set("mine", "1");
  const result = await api("GET", `/api/jobs/?${params}`);
  const body = $("#jobs tbody");
  if (!result.ok) { body.innerHTML = `<tr><td colspan="6" class="error">${esc(errorText(result))}</td></tr>`; return; }
  const { count, results } = result.data;
  body.innerHTML = results.map(jobRow).join("") || `<tr><td colspan="6" class="muted">No jobs match.</td></tr>`;
  $("#count").textContent = `${count} job${count === 1 ? "" : "s"}`;
  $("#page-info").textContent = count ? `${offset + 1}–${Math.min(offset + PAGE, count)} of ${count}` : "";
  $("#newer").disabled = offset === 0;
  $("#older").disabled = offset + PAGE >= count;
}

for (const id of ["#f-status", "#f-engine", "#f-mine"]) $(id)?.addEventListener("change", () => { offset = 0; load(); });
$("#newer").onclick = () => { offset = Math.max(0, offset - PAGE); load(); };
$("#older").onclick = () => { offset += PAGE; load(); };
load();
setInterval(load, 3000);

// --- the form ------------------------------------------------------------------------
const form = $("#submit");

function addMessage(role = "user", content = "") {
  const row = document.createElement("div");
  row.className = "chat-row";
  row.innerHTML = `<select><option>system</option><option>user</option><option>assistant</option></select>
    <textarea rows="2"></textarea><button type="button" class="secondary small" title="remove">×</button>`;
  row.querySelector("select").value = role;
  row.querySelector("textarea").value = content;
  row.querySelector("button").onclick = () => row.remove();
  $("#chat-rows").appendChild(row);
}
addMessage("system", "You are a helpful assistant.");
addMessage("user", "");
$("#add-message").onclick = () => addMessage();

// chat by default where the engine's model has a chat template (jobs_common.js)
followChatMode(form, JSON.parse($("#chat-engines").textContent), (mode) => {
  $("#prompt-box").hidden = mode === "chat";
  $("#chat-box").hidden = mode !== "chat";
});

function body() {
  const out = { max_tokens: Number(form.max_tokens.value), temperature: Number(form.temperature.value),
                top_p: Number(form.top_p.value), priority: Number(form.priority.value) };
  if (form.top_k.value) out.top_k = Number(form.top_k.value);
  if (form.seed.value) out.seed = Number(form.seed.value);
  const stop = form.stop.value.split("\n").filter((s) => s.length);
  if (stop.length) out.stop = stop;
  if (form.engine.value) out.engine = form.engine.value;
  if (form.mode.value === "chat") {
    out.messages = [...document.querySelectorAll(".chat-row")].map((row) => ({
      role: row.querySelector("select").value, content: row.querySelector("textarea").value }));
  } else {
    out.prompt = form.prompt.value;
  }
  return out;
}

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  $("#submit-error").textContent = "";
  const out = await submitJob(body());
  if (out.ok) location.href = `/jobs/${out.job.id}/`;
  else $("#submit-error").textContent = out.error;
});
