// node --test: the engine page's Pin form (static/kvops/pin_form.js): the four ways to
// name a prefix, what each placeholder says, and the body each mode's text makes.
import assert from "node:assert/strict";
import test from "node:test";

import { PIN_MODES, pinRequest } from "../../../static/kvops/pin_form.js";

test("four modes, the job first; the placeholders say which pins what chat jobs cached", () => {
  assert.deepEqual(Object.keys(PIN_MODES), ["job", "messages", "token_ids", "text"]);
  assert.match(PIN_MODES.job.placeholder, /the prompt that job ran, as the engine saw it/);
  assert.match(PIN_MODES.messages.placeholder, /chat template/);
  assert.match(PIN_MODES.text.placeholder, /not chat jobs' \(pin those by job or by chat messages\)/);
});

test("a job id", () => {
  assert.deepEqual(pinRequest("job", " 1234 "), { body: { job: 1234 } });
  assert.deepEqual(pinRequest("job", "#7"), { body: { job: 7 } });
  assert.match(pinRequest("job", "seven").error, /positive whole number/);
  assert.match(pinRequest("job", "0").error, /positive whole number/);
  assert.match(pinRequest("job", "").error, /give the job id/);
});

test("chat messages as JSON: a list, or one message alone", () => {
  const system = { role: "system", content: "You are terse." };
  assert.deepEqual(pinRequest("messages", JSON.stringify([system])), { body: { messages: [system] } });
  assert.deepEqual(pinRequest("messages", JSON.stringify(system)), { body: { messages: [system] } });
  assert.match(pinRequest("messages", "You are terse.").error, /chat messages are JSON/);
});

test("token ids by commas, spaces or as a JSON list", () => {
  assert.deepEqual(pinRequest("token_ids", "1, 504,28"), { body: { token_ids: [1, 504, 28] } });
  assert.deepEqual(pinRequest("token_ids", "[1, 2]"), { body: { token_ids: [1, 2] } });
  assert.deepEqual(pinRequest("token_ids", "1 2\n3"), { body: { token_ids: [1, 2, 3] } });
  assert.match(pinRequest("token_ids", "1, x").error, /whole numbers/);
});

test("raw text is sent as typed, its spaces kept", () => {
  assert.deepEqual(pinRequest("text", " You are terse. "), { body: { text: " You are terse. " } });
  assert.match(pinRequest("text", "   ").error, /give the raw text/);
  assert.match(pinRequest("nope", "x").error, /unknown mode/);
});
