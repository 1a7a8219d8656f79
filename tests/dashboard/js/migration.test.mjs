// node --test: moving requests between engines as the pages show it
// (static/kvops/migration.js): the engines the Migrate control offers, a move's and a
// drain's answer in words, and the engines a job ran on; without a browser.
import assert from "node:assert/strict";
import test from "node:test";

import { drainText, migrationTargets, migrationText, ranOnText } from "../../../static/kvops/migration.js";

// An engine as GET /api/engines/ lists it.
function engine(name, extra = {}, config = {}) {
  return { name, alive: true, state: "ready", metrics: {}, ...extra,
           config: { model: "/data/models/SmolLM2-135M", block_size: 16,
                     migration_address: `tcp://127.0.0.1:70${name.length}`, ...config } };
}

test("a request may move to the other live, ready engines of its model that receive moves", () => {
  const engines = [
    engine("a"), engine("b"),
    engine("dead", { alive: false }), engine("paused", { state: "paused" }),
    engine("draining", { state: "draining" }), engine("drained", { state: "drained" }),
    engine("other-model", {}, { model: "/data/models/Qwen2-0.5B" }),
    engine("no-link", {}, { migration_address: null }),
  ];
  assert.deepEqual(migrationTargets(engines, "a"), ["b"]);
  assert.deepEqual(migrationTargets(engines, "b"), ["a"]);
});

test("the same model loaded from another path is the same model", () => {
  const engines = [engine("a"), engine("b", {}, { model: "/elsewhere/SmolLM2-135M/" }),
                   engine("c", {}, { model: "SmolLM2-135M:q8" })];
  assert.deepEqual(migrationTargets(engines, "a"), ["b", "c"]);
});

test("the least loaded engine comes first, then by name", () => {
  const engines = [engine("a"), engine("c", { metrics: { running_tokens: 500 } }),
                   engine("d", { metrics: { running_tokens: 100, waiting_tokens: 50 } }),
                   engine("b", { metrics: { running_tokens: 150 } })];
  assert.deepEqual(migrationTargets(engines, "a"), ["b", "d", "c"]);
});

test("the page's own config stands in when the list lacks the engine", () => {
  const engines = [engine("b"), engine("c", {}, { model: "other" })];
  assert.deepEqual(migrationTargets(engines, "a", { model: "/m/SmolLM2-135M" }), ["b"]);
  assert.deepEqual(migrationTargets([], "a", { model: "x" }), []);
});

test("a move's answer in words", () => {
  const result = { request_id: "job-7-1", to: "b", moved: true, staged: true, stages: 2,
                   blocks_sent: 20, blocks_at_stop: 2, blocks_cached: 4, bytes_sent: 655360,
                   pause_ms: 3.14, ms: 12.4, num_blocks: 24 };
  assert.equal(migrationText(result), "moved to b in 12 ms (pause 3.1 ms, 20 blocks sent, 4 cached)");
  assert.equal(migrationText({ ...result, blocks_sent: 1, blocks_cached: 0, ms: 1234.5 }),
               "moved to b in 1,235 ms (pause 3.1 ms, 1 block sent, 0 cached)");
});

test("a drain's answer says what happens to the requests that ran there", () => {
  assert.equal(drainText({ state: "draining", mode: "wait" }), "draining: its requests finish here");
  assert.equal(drainText({ state: "draining", mode: "migrate", to: ["b", "c"] }),
               "draining: its requests move to b, c");
  assert.equal(drainText({ state: "drained", mode: "abort", aborted: ["job-1-1"] }), "drained: 1 request aborted");
  assert.equal(drainText({ state: "drained", mode: "abort", aborted: [] }), "drained: 0 requests aborted");
});

test("the engines a job ran on: nothing for one, each move with its time", () => {
  const clock = (iso) => iso.slice(11, 19);
  const a = { engine: "a", at: "2026-05-01T12:00:00+00:00", reason: "start" };
  assert.equal(ranOnText([], clock), "");
  assert.equal(ranOnText(undefined, clock), "");
  assert.equal(ranOnText([a], clock), "");
  const b = { engine: "b", at: "2026-05-01T12:01:03+00:00", reason: "migration" };
  assert.equal(ranOnText([a, b], clock), "ran on a, then b (moved at 12:01:03)");
  const c = { engine: "c", at: "2026-05-01T12:02:10+00:00", reason: "migration" };
  assert.equal(ranOnText([a, b, c], clock),
               "ran on a, then b (moved at 12:01:03), then c (moved at 12:02:10)");
  assert.equal(ranOnText([a, { engine: "b", at: null, reason: "migration" }], clock), "ran on a, then b");
  const decode = { engine: "d", at: "2026-05-01T12:00:01+00:00", reason: "decode" };
  assert.equal(ranOnText([a, decode], clock), "ran on a, then d (handed over to decode at 12:00:01)");
});
