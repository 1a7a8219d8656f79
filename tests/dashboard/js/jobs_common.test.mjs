// node --test: chat or completion on the submit forms, and the hint for a completion that
// ended at once (static/kvops/jobs_common.js).
import assert from "node:assert/strict";
import test from "node:test";

import { asChatBody, chatByDefault, endedAtOnce } from "../../../static/kvops/jobs_common.js";

test("chat is the default where the chosen engine's model, or any for 'any', has a chat template", () => {
  const chat = { inst: true, raw: false, far: null };
  assert.equal(chatByDefault(chat, "inst"), true);
  assert.equal(chatByDefault(chat, "raw"), false);
  assert.equal(chatByDefault(chat, "far"), false);  // not readable here: as it was
  assert.equal(chatByDefault(chat, ""), true);
  assert.equal(chatByDefault({ raw: false }, ""), false);
});

test("a completion that stopped with at most a token ended at once; a chat or a length never", () => {
  const job = { status: "finished", finish_reason: "stop", num_output_tokens: 1, prompt: "Hi", messages: null };
  assert.equal(endedAtOnce(job), true);
  assert.equal(endedAtOnce({ ...job, num_output_tokens: 0 }), true);
  assert.equal(endedAtOnce({ ...job, num_output_tokens: 2 }), false);
  assert.equal(endedAtOnce({ ...job, finish_reason: "length" }), false);
  assert.equal(endedAtOnce({ ...job, status: "running" }), false);
  assert.equal(endedAtOnce({ ...job, messages: [{ role: "user", content: "Hi" }] }), false);
});

test("resubmitting as chat makes the prompt the user's turn and keeps the settings", () => {
  const job = { prompt: "Why is the sky blue?", priority: 3, engine: "a", requested_engine: "",
                params: { max_tokens: 64, temperature: 0.5, top_p: 1, stop: ["\n\n"], seed: null, n: 1 } };
  assert.deepEqual(asChatBody(job), {
    messages: [{ role: "user", content: "Why is the sky blue?" }], priority: 3, engine: "a",
    max_tokens: 64, temperature: 0.5, top_p: 1, stop: ["\n\n"] });
});
