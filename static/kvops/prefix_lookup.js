// The overview's "Which engine holds this prefix?" box (POST /api/prefix-lookup/,
// docs/api.md "Looking up a prefix"): its four ways to name a prefix, the body a form
// makes, and the answer as a table of engine x view -> leading cached tokens per tier,
// with a sentence saying what it found. No DOM here
// (tests/dashboard/js/prefix_lookup.test.mjs); overview.js draws it.
import { prefixBody } from "./prefix_body.js";

export const LOOKUP_MODES = {
  text: {
    label: "raw text",
    placeholder: "Text as a completion job's prompt: tokenized as it is, with no chat template "
      + "(a chat job's cache holds its rendered chat: look those up by chat messages or job).",
  },
  messages: {
    label: "chat messages (JSON)",
    placeholder: '[{"role": "system", "content": "You are…"}]: rendered through each engine\'s '
      + "chat template as a chat job's prompt, without the generation prompt.",
  },
  token_ids: { label: "token ids", placeholder: "Token ids, e.g. 1, 504, 28 (or a JSON list)." },
  job: {
    label: "job id",
    placeholder: "A job's id, e.g. 1234: the prompt that job ran, as the engine saw it, under "
      + "its owner's cache salt.",
  },
};

export const TIERS = ["gpu", "cpu", "disk"];
const VIEWS = [["router", "router's index"], ["engine_cache", "engine's answer"]];

// The lookup's body for the form: {body}, or {error} in words (nothing is sent then).
// `model` and `user` (staff: whose cache salt) are left out when empty.
export function lookupRequest(mode, text, model = "", user = "") {
  if (!(mode in LOOKUP_MODES)) return { error: `unknown mode ${mode}; one of ${Object.keys(LOOKUP_MODES).join(", ")}` };
  const asked = prefixBody(mode, text, LOOKUP_MODES[mode].label, "look up");
  if (asked.error) return asked;
  const body = { ...asked.body };
  if (String(model).trim()) body.model = String(model).trim();
  if (String(user).trim()) body.user = String(user).trim();
  return { body };
}

// The answer as {summary, rows}: a row per engine and view ({engine, view, gpu, cpu, disk,
// total}; null: a tier that view has not, or no answer) and one per engine whose errors
// say why a view is missing ({engine, error}).
export function lookupTable(answer) {
  const rows = [];
  for (const e of answer.engines) {
    for (const [key, view] of VIEWS) {
      const v = e[key] || {};
      rows.push({ engine: e.engine, view, gpu: v.gpu ?? null, cpu: v.cpu ?? null,
                  disk: v.disk ?? null, total: v.total ?? null });
    }
    if (e.errors.length) rows.push({ engine: e.engine, error: e.errors.join("; ") });
  }
  return { summary: summary(answer), rows };
}

function summary(answer) {
  const where = answer.salted ? `under ${answer.user}'s cache salt` : "in the shared (unsalted) cache";
  if (!answer.engines.length) {
    return `No live engine serves ${answer.model ? `model ${answer.model}` : "any model"}: there is nothing to look up.`;
  }
  const held = (e) => e.engine_cache?.total ?? e.router?.total ?? 0;
  const best = answer.engines.reduce((a, b) => (held(b) > held(a) ? b : a));
  if (!held(best)) {
    const n = best.num_prompt_tokens;
    return `No engine holds a full block of it ${where}` + (n == null ? "." : ` (${n} tokens; blocks of ${best.block_size}).`);
  }
  return `${best.engine} holds the longest cached prefix ${where}: ${held(best)} of ${best.num_prompt_tokens} tokens.`;
}
