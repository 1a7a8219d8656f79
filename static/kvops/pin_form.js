// The engine page's Pin form: the four ways to name a prefix to pin or unpin (POST
// /api/engines/<name>/prefix-cache/pin/ and unpin/, docs/api.md "Pinning a prefix"),
// what each one is for, and the body the form's text makes in each; no DOM here
// (tests/dashboard/js/pin_form.test.mjs). The text is read by prefix_body.js.

import { prefixBody } from "./prefix_body.js";

// A chat job's cached blocks are its chat rendered through the model's template: its
// system prompt pasted as raw text finds none of them. Hence the job first.
export const PIN_MODES = {
  job: {
    label: "job id",
    placeholder: "A job's id, e.g. 1234: pins the prompt that job ran, as the engine saw it "
      + "(a chat rendered through the model's template, under the job's cache salt).",
  },
  messages: {
    label: "chat messages (JSON)",
    placeholder: '[{"role": "system", "content": "You are…"}]: rendered through the model\'s '
      + "chat template as a chat job's prompt, without the generation prompt, so it pins the "
      + "start every chat beginning with these messages shares.",
  },
  token_ids: {
    label: "token ids",
    placeholder: "Token ids, e.g. 1, 504, 28 (or a JSON list): pinned as given.",
  },
  text: {
    label: "raw text",
    placeholder: "Text tokenized as it is, with no chat template: it matches completion jobs' "
      + "prompts, not chat jobs' (pin those by job or by chat messages).",
  },
};

// The body of a pin or unpin for the form's mode and text: {body}, or {error} in words
// when the text cannot be one (nothing is sent then).
export function pinRequest(mode, text) {
  if (!(mode in PIN_MODES)) return { error: `unknown mode ${mode}; one of ${Object.keys(PIN_MODES).join(", ")}` };
  return prefixBody(mode, text, PIN_MODES[mode].label, "pin");
}
