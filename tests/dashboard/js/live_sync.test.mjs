// node --test: the engine page's live protocol (static/kvops/live_sync.js), without a
// browser: snapshot, deltas in sequence, duplicates, gaps, silence.
import assert from "node:assert/strict";
import test from "node:test";

import { LiveSync, placeDelta } from "../../../static/kvops/live_sync.js";
import { FINISH, GROW, delta, snapshot } from "./kv_fixtures.mjs";

function used(pool) { return [...pool.state].flatMap((s, id) => (s === 1 ? [id] : [])); }

test("a snapshot and the deltas that follow it give the engine's state", () => {
  const sync = new LiveSync();
  sync.applySnapshot(snapshot());
  const grew = sync.applyDelta(GROW);
  assert.equal(grew.ok, true);
  assert.deepEqual([...new Set(grew.changed.gpu)].sort((a, b) => a - b), [0, 1, 3, 4, 6]);  // blocks, eviction order
  assert.deepEqual(used(sync.state.gpu), [2, 3, 5, 6]);
  assert.deepEqual(sync.state.requests.get(1).block_table, [2, 5, 6]);
  assert.deepEqual(sync.state.requests.get(2).block_table, [3]);
  assert.equal(sync.state.requests.get(1).num_output_tokens, 4);
  assert.equal(sync.state.requests.get(1).num_computed_tokens, 24);
  assert.deepEqual([...sync.state.evictRank.slice(0, 5)], [0, -1, -1, -1, 1]);
  assert.equal(sync.applyDelta(FINISH).ok, true);
  assert.deepEqual(used(sync.state.gpu), [3]);
  assert.equal(sync.state.gpu.state[2], 2);  // cached, hash kept
  assert.equal(sync.state.gpu.hash32[2], 7);
  assert.equal(sync.state.gpu.tenant32[2], 3289118412);  // its tenant's key, for the map's colour
  assert.equal(sync.state.gpu.tenant32[5], 0);
  assert.deepEqual([...sync.state.requests.keys()], [2]);
  assert.equal(sync.state.seq, 12);
  assert.equal(sync.state.metrics.seq, 12);
});

test("a gap in sequence numbers asks for a snapshot, and deltas wait for it", () => {
  const sync = new LiveSync();
  sync.applySnapshot(snapshot());
  const result = sync.applyDelta(FINISH);  // 12 after 10: 11 is missing
  assert.equal(result.ok, false);
  assert.deepEqual(result.needsResync, { gap: ["e1", 10], got: ["e1", 12] });
  assert.equal(sync.awaiting, true);
  assert.deepEqual(used(sync.state.gpu), [2, 5]);  // nothing of it applied
  assert.equal(sync.applyDelta(delta(13)).skipped, "awaiting a snapshot");
  assert.equal(sync.state.seq, 10);
  sync.applySnapshot(snapshot({ seq: 11 }));
  assert.equal(sync.applyDelta(FINISH).ok, true);
  assert.equal(sync.state.seq, 12);
});

test("a delta of another publisher run is a gap even when its number follows", () => {
  const sync = new LiveSync();
  sync.applySnapshot(snapshot({ epoch: "old" }));
  const result = sync.applyDelta(delta(11, {}, "new"));
  assert.deepEqual(result.needsResync, { gap: ["old", 10], got: ["new", 11] });
  assert.equal(placeDelta(sync.state, delta(3, {}, "new")), "gap");  // not a duplicate either
});

test("a delta the state already has changes nothing", () => {
  const sync = new LiveSync();
  sync.applySnapshot(snapshot({ seq: 11 }));
  for (const old of [GROW, delta(5)]) {
    const result = sync.applyDelta(old);
    assert.deepEqual(result, { ok: false, skipped: "duplicate" });
  }
  assert.equal(sync.state.requests.has(2), false);
  assert.equal(sync.state.requests.get(1).num_output_tokens, 0);
  assert.equal(sync.awaiting, false);
  assert.equal(sync.applyDelta(FINISH).ok, true);
  sync.applyDelta(FINISH);  // the same one twice
  assert.deepEqual(used(sync.state.gpu), []);
  assert.equal(sync.state.seq, 12);
});

test("deltas before the first snapshot are not applied", () => {
  const sync = new LiveSync();
  sync.subscribed();
  assert.equal(sync.applyDelta(GROW).skipped, "awaiting a snapshot");
  assert.equal(sync.state, null);
});

test("a stored (stale) snapshot becomes live when the engine's next delta follows it", () => {
  const sync = new LiveSync();
  sync.applySnapshot(snapshot({ stale: true }));
  assert.equal(sync.state.stale, true);
  const result = sync.applyDelta(GROW);
  assert.equal(result.nowLive, true);
  assert.equal(sync.state.stale, false);
  assert.equal(sync.applyDelta(FINISH).nowLive, false);
});

test("silence asks for a snapshot; a snapshot that does not come reconnects, once", () => {
  let now = 0;
  const sync = new LiveSync({ now: () => now, staleMs: 3000, snapshotWaitMs: 6000 });
  sync.subscribed();
  now = 5999;
  assert.equal(sync.check(), null);  // waiting, not yet too long
  now = 6001;
  assert.deepEqual(sync.check(), { reconnect: true });
  now = 20000;
  assert.equal(sync.check(), null);  // asked on a connection that is gone: not again
  sync.subscribed();  // reconnected
  sync.applySnapshot(snapshot());
  now = 22000;
  sync.applyDelta(GROW);
  now = 24999;
  assert.equal(sync.check(), null);
  now = 25001;
  assert.deepEqual(sync.check(), { resync: { silentMs: 3001 } });
  assert.equal(sync.awaiting, true);
  now = 31002;
  assert.deepEqual(sync.check(), { reconnect: true });
});

test("a stale snapshot is not resynced for silence (its engine stopped)", () => {
  let now = 0;
  const sync = new LiveSync({ now: () => now });
  sync.applySnapshot(snapshot({ stale: true }));
  now = 60000;
  assert.equal(sync.check(), null);
  assert.equal(sync.awaiting, false);
});

test("a block's place in an eviction queue longer than 32,767 blocks is kept", () => {
  const n = 40000;
  const big = snapshot();
  big.config = { ...big.config, num_gpu_blocks: n };
  big.gpu = { state: new Array(n).fill(0), ref_cnt: new Array(n).fill(0),
              owner: new Array(n).fill(0), hash32: new Array(n).fill(0) };
  big.requests = [];
  big.eviction_order = Array.from({ length: n }, (_, i) => n - 1 - i);  // last block first
  const sync = new LiveSync();
  sync.applySnapshot(big);
  assert.equal(sync.state.evictRank[n - 1], 0);
  assert.equal(sync.state.evictRank[0], n - 1);  // place 39,999: past an int16's range
  assert.ok([...sync.state.evictRank].every((rank) => rank >= 0));
});
