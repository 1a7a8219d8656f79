// node --test: the overview's prefix lookup (static/kvops/prefix_lookup.js): the body
// each mode makes, and the answer as a table and a sentence.
import assert from "node:assert/strict";
import test from "node:test";

import { LOOKUP_MODES, lookupRequest, lookupTable } from "../../../static/kvops/prefix_lookup.js";

test("four modes, raw text first; each reads its text as the Pin form does", () => {
  assert.deepEqual(Object.keys(LOOKUP_MODES), ["text", "messages", "token_ids", "job"]);
  assert.deepEqual(lookupRequest("text", " two words "), { body: { text: " two words " } });
  assert.deepEqual(lookupRequest("token_ids", "[1, 2 3]"), { body: { token_ids: [1, 2, 3] } });
  assert.deepEqual(lookupRequest("job", "#12", "m", " alice "), { body: { job: 12, model: "m", user: "alice" } });
  const system = { role: "system", content: "Be brief." };
  assert.deepEqual(lookupRequest("messages", JSON.stringify(system)), { body: { messages: [system] } });
  assert.match(lookupRequest("text", "  ").error, /give the raw text to look up/);
  assert.match(lookupRequest("job", "x").error, /positive whole number/);
  assert.match(lookupRequest("prompt", "x").error, /unknown mode prompt/);
});

const tiers = (gpu, cpu, disk) => ({ gpu, cpu, disk, total: gpu + (cpu || 0) + (disk || 0) });

test("two rows an engine, the tiers a view has not as null, errors on a row of their own", () => {
  const answer = { model: null, user: "alice", salted: true, engines: [
    { engine: "a", block_size: 16, num_prompt_tokens: 70, errors: [],
      router: tiers(32, 16, null), engine_cache: tiers(32, 16, 0) },
    { engine: "b", block_size: 16, num_prompt_tokens: 70, errors: ["engine: b did not answer within 5 s"],
      router: tiers(0, 0, null), engine_cache: null },
  ] };
  const { summary, rows } = lookupTable(answer);
  assert.equal(summary, "a holds the longest cached prefix under alice's cache salt: 48 of 70 tokens.");
  assert.deepEqual(rows, [
    { engine: "a", view: "router's index", gpu: 32, cpu: 16, disk: null, total: 48 },
    { engine: "a", view: "engine's answer", gpu: 32, cpu: 16, disk: 0, total: 48 },
    { engine: "b", view: "router's index", gpu: 0, cpu: 0, disk: null, total: 0 },
    { engine: "b", view: "engine's answer", gpu: null, cpu: null, disk: null, total: null },
    { engine: "b", error: "engine: b did not answer within 5 s" },
  ]);
});

test("nothing held, and no engine at all, said in words", () => {
  const none = { model: null, user: "admin", salted: false, engines: [
    { engine: "a", block_size: 16, num_prompt_tokens: 20, errors: [],
      router: tiers(0, 0, null), engine_cache: tiers(0, null, null) }] };
  assert.equal(lookupTable(none).summary,
               "No engine holds a full block of it in the shared (unsalted) cache (20 tokens; blocks of 16).");
  const empty = { model: "m", user: "bob", salted: true, engines: [] };
  assert.deepEqual(lookupTable(empty), { summary: "No live engine serves model m: there is nothing to look up.", rows: [] });
});
