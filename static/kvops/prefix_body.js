// A prefix named one of four ways (a job id, chat messages as JSON, token ids, raw text),
// as typed into a form, made into the body an /api call takes ({job}, {messages},
// {token_ids} or {text}): the engine page's Pin form (pin_form.js) and the overview's
// lookup (prefix_lookup.js) read their text with it. No DOM here.

export const PREFIX_MODES = ["job", "messages", "token_ids", "text"];

// {body}, or {error} in words when the text cannot be one (nothing is sent then).
// `label` names what the mode's text is and `verb` what the form does with it, for the
// error of an empty box ("give the job id to pin").
export function prefixBody(mode, text, label, verb) {
  const t = String(text ?? "").trim();
  if (!PREFIX_MODES.includes(mode)) return { error: `unknown mode ${mode}; one of ${PREFIX_MODES.join(", ")}` };
  if (t === "") return { error: `give the ${label} to ${verb}` };
  if (mode === "job") {
    const id = t.replace(/^#/, "");
    if (!/^[0-9]+$/.test(id) || Number(id) < 1) return { error: `a job id is a positive whole number; got ${t}` };
    return { body: { job: Number(id) } };
  }
  if (mode === "messages") {
    let messages;
    try { messages = JSON.parse(t); } catch {
      return { error: 'chat messages are JSON: a list like [{"role": "system", "content": "…"}]' };
    }
    if (!Array.isArray(messages)) messages = [messages];  // one message alone
    return { body: { messages } };
  }
  if (mode === "token_ids") {
    const parts = t.replace(/^\[|\]$/g, "").split(/[\s,]+/).filter((p) => p !== "");
    if (!parts.every((p) => /^[0-9]+$/.test(p))) return { error: "token ids are whole numbers, separated by commas or spaces" };
    return { body: { token_ids: parts.map(Number) } };
  }
  return { body: { text: String(text) } };  // (as typed: spaces are tokens too)
}
