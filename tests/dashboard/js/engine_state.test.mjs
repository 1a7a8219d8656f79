// node --test: the engine page header's state (static/kvops/engine_state.js), without a
// browser: after an operator's answer, deltas sent before the engine applied it do not
// flip the header back.
import assert from "node:assert/strict";
import test from "node:test";

import { HeaderState } from "../../../static/kvops/engine_state.js";

function clock() {
  const c = { t: 0, now: () => c.t };
  return c;
}

test("deltas set the header while no answer waits", () => {
  const h = new HeaderState({ now: clock().now });
  assert.ok(h.fromEngine("ready"));
  assert.ok(h.fromEngine("paused"));
  assert.equal(h.shown, "paused");
});

test("after a pause is answered, stale ready deltas wait until one says paused", () => {
  const c = clock();
  const h = new HeaderState({ holdMs: 5000, now: c.now });
  h.fromEngine("ready");
  h.fromAnswer("paused");
  assert.equal(h.shown, "paused");
  c.t = 100;
  assert.ok(!h.fromEngine("ready"));  // sent before the pause was applied
  assert.equal(h.shown, "paused");
  assert.ok(h.fromEngine("paused"));  // the engine agrees: deltas rule again
  assert.ok(h.fromEngine("ready"));  // (another operator resumed)
  assert.equal(h.shown, "ready");
});

test("the hold ends after holdMs even if the engine never says the answered state", () => {
  const c = clock();
  const h = new HeaderState({ holdMs: 5000, now: c.now });
  h.fromAnswer("paused");
  c.t = 4999;
  assert.ok(!h.fromEngine("ready"));
  c.t = 5000;
  assert.ok(h.fromEngine("ready"));
  assert.equal(h.shown, "ready");
  c.t = 5001;
  assert.ok(h.fromEngine("paused"));  // no hold left
});

test("a drain is reached by drained as well as draining", () => {
  const c = clock();
  const h = new HeaderState({ now: c.now });
  h.fromAnswer("draining");
  assert.ok(!h.fromEngine("ready"));
  assert.ok(h.fromEngine("drained"));  // an idle engine drains at once
  assert.equal(h.shown, "drained");
  h.fromAnswer("ready");  // undrain
  assert.ok(!h.fromEngine("drained"));
  assert.ok(h.fromEngine("ready"));
});
