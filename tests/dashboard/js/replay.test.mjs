// node --test: the timeline's rebuild of past states (static/kvops/replay.js) against the
// live state the same deltas gave at each moment, without a browser.
import assert from "node:assert/strict";
import test from "node:test";

import { KVState } from "../../../static/kvops/kvstate.js";
import { LiveSync } from "../../../static/kvops/live_sync.js";
import { Replay } from "../../../static/kvops/replay.js";
import { FINISH, GROW, delta, random, randomDelta, snapshot, toSnapshot } from "./kv_fixtures.mjs";

function emptySnapshot({ gpu = 64, cpu = 16, epoch = "e1", ts = 5000 } = {}) {
  const zeros = (n) => ({ state: Array(n).fill(0), ref_cnt: Array(n).fill(0), owner: Array(n).fill(0),
                          hash32: Array(n).fill(0) });
  return { type: "snapshot", engine: "t", epoch, seq: 1, ts, step: 0, block_states: ["free", "used", "cached", "pinned"],
           config: { block_size: 16, num_gpu_blocks: gpu, num_cpu_blocks: cpu }, gpu: zeros(gpu), cpu: zeros(cpu),
           requests: [], eviction_order: [], metrics: {} };
}

// A history as the publisher stores it: the engine's deltas from a snapshot, a keyframe
// (the live state) every `every` deltas; with the live state after each delta.
function history({ deltas = 90, every = 25, seed = 7, start = emptySnapshot() } = {}) {
  const rnd = random(seed);
  const sync = new LiveSync();
  sync.applySnapshot(start);
  const moments = [toSnapshot(sync.state)];
  const windows = [{ keyframe: moments[0], deltas: [] }];
  for (let i = 1; i <= deltas; i++) {
    const d = randomDelta(sync.state, rnd);
    assert.equal(sync.applyDelta(d).ok, true);
    windows[windows.length - 1].deltas.push(d);
    moments.push(toSnapshot(sync.state));
    if (i % every === 0 && i < deltas) windows.push({ keyframe: moments[i], deltas: [] });
  }
  const newest = moments[moments.length - 1].ts;
  const answers = windows.map((w, k) => ({
    window: { start: w.keyframe.ts, end: k + 1 < windows.length ? windows[k + 1].keyframe.ts : null },
    newest, keyframe: w.keyframe, deltas: w.deltas }));
  return { moments, answers };
}

function byIndex(doc) {
  return { ...doc, requests: [...doc.requests].sort((a, b) => a.index - b.index) };
}

function shuffled(values, rnd) {
  const out = [...values];
  for (let i = out.length - 1; i > 0; i--) {
    const j = rnd.int(i + 1);
    [out[i], out[j]] = [out[j], out[i]];
  }
  return out;
}

// Every moment and every moment between two, in an order of the seed's.
function scrubTimes(moments, seed) {
  return shuffled(moments.flatMap((m, i) => (i ? [m.ts, (m.ts + moments[i - 1].ts) / 2] : [m.ts])), random(seed));
}

// Counts the deltas applied to any state while `run` runs.
function countingApplies(run) {
  const apply = KVState.prototype.apply;
  let applied = 0;
  KVState.prototype.apply = function (delta) { applied++; return apply.call(this, delta); };
  try { run(() => { const n = applied; applied = 0; return n; }); } finally { KVState.prototype.apply = apply; }
}

for (const checkpointEvery of [1, 3, 10, 40]) {
  test(`every moment rebuilds to the live state then, scrubbed to in any order (checkpoints every ${checkpointEvery})`, () => {
    const { moments, answers } = history();
    const replay = new Replay({ checkpointEvery });
    for (const answer of answers) replay.add(answer);
    for (const t of scrubTimes(moments, 3)) {
      const shown = replay.seek(t);
      const expected = moments.filter((m) => m.ts <= t).pop();
      assert.deepEqual(byIndex(toSnapshot(shown.state)), byIndex(expected), `at ${t}`);
      assert.equal(shown.at, expected.ts);
      assert.equal(shown.gap, false);
    }
  });
}

test("a window's checkpoints are the live states after every checkpointEvery-th delta", () => {
  const { moments, answers } = history({ deltas: 90, every: 25 });
  const replay = new Replay({ checkpointEvery: 7 });
  for (const answer of answers) replay.add(answer);
  assert.equal(replay.windows.length, 4);
  replay.windows.forEach((w, k) => {
    const first = k * 25;  // the keyframe's moment
    assert.equal(w.checkpoints.length, Math.ceil(w.deltas.length / 7), `window ${k}`);
    w.checkpoints.forEach((state, c) => {
      assert.deepEqual(byIndex(toSnapshot(state)), byIndex(moments[first + c * 7]), `window ${k}, checkpoint ${c}`);
    });
  });
  replay.seek(moments[60].ts);  // seeking applies deltas to its own state, not to a checkpoint
  assert.deepEqual(byIndex(toSnapshot(replay.windows[2].checkpoints[1])), byIndex(moments[57]));
});

test("a seek applies fewer deltas than checkpointEvery, and a step forward only the ones in between", () => {
  const { moments, answers } = history({ deltas: 90, every: 45 });
  const replay = new Replay({ checkpointEvery: 8 });
  for (const answer of answers) replay.add(answer);
  countingApplies((applied) => {
    for (const t of scrubTimes(moments, 9)) {
      replay.seek(t);
      assert.ok(applied() < 8, `at ${t}`);
    }
    replay.seek(moments[46].ts);  // a delta into the second window
    applied();
    replay.seek(moments[52].ts);  // its checkpoint would have taken 7
    assert.equal(applied(), 6);
    replay.seek(moments[56].ts);  // past the next checkpoint (after 8), still fewer than 8 on
    assert.equal(applied(), 4);
  });
});

// `changed` (a seek's) names exactly the blocks whose cells differ between the two
// snapshots, and every request whose block tables differ.
function assertRepaints(changed, before, after) {
  const queued = (doc, id) => doc.eviction_order.includes(id);  // a cell marks that, not the place
  for (const pool of ["gpu", "cpu"]) {
    const repainted = new Set(changed[pool]);
    assert.equal(repainted.size, changed[pool].length, "each block once");
    for (let id = 0; id < after[pool].state.length; id++) {
      const differs = ["state", "ref_cnt", "owner", "hash32"].some((k) => after[pool][k][id] !== before[pool][k][id])
        || (pool === "gpu" && queued(after, id) !== queued(before, id));
      assert.equal(repainted.has(id), differs, `${pool} block ${id}: repainted exactly when it changed`);
    }
  }
  const tables = (doc) => new Map(doc.requests.map((r) => [r.index, JSON.stringify([r.block_table, r.cpu_block_table])]));
  const was = tables(before), now = tables(after);
  for (const [index, t] of now) {
    if (was.has(index) && was.get(index) !== t) assert.ok(changed.tables.has(index), `table of ${index}`);
  }
}

test("a move repaints every block and table that changed", () => {
  const { moments, answers } = history({ seed: 11 });
  const replay = new Replay();
  for (const answer of answers) replay.add(answer);
  let before = null;
  let moves = 0;
  for (const m of shuffled(moments, random(5))) {
    const shown = replay.seek(m.ts);
    const after = toSnapshot(shown.state);
    if (shown.changed !== null) {
      moves++;
      assertRepaints(shown.changed, before, after);
    }
    before = after;
  }
  assert.ok(moves > moments.length / 2);
});

test("the first seek says what differs from the state on screen, and leaves that state alone", () => {
  const { moments, answers } = history({ seed: 13 });
  const live = new KVState(moments[moments.length - 2]);
  const replay = new Replay({ onScreen: live });
  live.apply(answers[answers.length - 1].deltas.at(-1));  // a live delta, kept unpainted while scrubbing
  for (const answer of answers) replay.add(answer);
  const shown = replay.seek(moments[40].ts);
  assert.notEqual(shown.state, live);
  assert.notEqual(shown.changed, null);
  assertRepaints(shown.changed, moments[moments.length - 2], toSnapshot(shown.state));  // against what was painted
  assert.deepEqual(byIndex(toSnapshot(shown.state)), byIndex(moments[40]));
  assert.deepEqual(byIndex(toSnapshot(live)), byIndex(moments[moments.length - 1]));
  const next = replay.seek(moments[12].ts);
  assert.equal(next.state, shown.state);
  assertRepaints(next.changed, moments[40], moments[12]);
  const other = new Replay({ onScreen: new KVState(emptySnapshot({ gpu: 32 })) });
  other.add(answers[0]);
  assert.equal(other.seek(moments[3].ts).changed, null);  // pools of other sizes: painted whole
});

test("a gap in a window's deltas ends what it tells", () => {
  const replay = new Replay();
  const after = delta(14);
  replay.add({ window: { start: 1001, end: null }, newest: after.ts, keyframe: snapshot(),
               deltas: [GROW, FINISH, after, delta(15)] });
  const past = replay.seek(after.ts);
  assert.equal(past.state.seq, 12);
  assert.equal(past.at, FINISH.ts);
  assert.equal(past.gap, true);
  const before = replay.seek(FINISH.ts);
  assert.equal(before.state.seq, 12);
  assert.equal(before.gap, false);
  assert.equal(replay.seek(GROW.ts).state.seq, 11);
});

test("a delta the keyframe or the window already has is skipped", () => {
  const replay = new Replay();
  replay.add({ window: { start: 1001, end: null }, newest: FINISH.ts, keyframe: snapshot(),
               deltas: [delta(10), GROW, GROW, FINISH] });
  const live = new LiveSync();
  live.applySnapshot(snapshot());
  for (const d of [GROW, FINISH]) {
    live.applyDelta(d);
    assert.deepEqual(toSnapshot(replay.seek(d.ts).state), toSnapshot(live.state));
  }
  assert.equal(replay.seek(GROW.ts).state.requests.get(1).num_computed_tokens, 24);  // 4 tokens, once
});

test("the window on screen fetched again (the newest, grown) keeps the state on screen", () => {
  const { moments, answers } = history({ deltas: 30, every: 10 });
  const replay = new Replay({ checkpointEvery: 4 });
  const newest = answers[2];
  replay.add({ ...newest, newest: moments[25].ts, deltas: newest.deltas.slice(0, 5) });
  const first = replay.seek(moments[25].ts);
  assert.equal(replay.seek(moments[26].ts), null);
  replay.add(newest);
  for (const i of [26, 30, 21, 28]) {
    const shown = replay.seek(moments[i].ts);
    assert.equal(shown.state, first.state);
    assert.notEqual(shown.changed, null);
    assert.deepEqual(byIndex(toSnapshot(shown.state)), byIndex(moments[i]), `moment ${i}`);
  }
});

test("a moment no fetched window holds is null", () => {
  const { moments, answers } = history({ deltas: 30, every: 10 });
  const replay = new Replay();
  replay.add(answers[1]);  // deltas 10..19 of the history
  assert.equal(replay.seek(moments[9].ts), null);  // before its keyframe
  assert.notEqual(replay.seek(moments[10].ts), null);
  assert.notEqual(replay.seek(moments[19].ts), null);
  assert.equal(replay.seek(moments[20].ts), null);  // the next window's keyframe
  replay.add(answers[2]);  // the newest: up to what was stored when fetched
  assert.equal(replay.seek(moments[30].ts).state.seq, moments[30].seq);
  assert.equal(replay.seek(moments[30].ts + 1), null);
});

test("after a restart with other pool sizes, the state is a new one, painted whole", () => {
  const first = history({ deltas: 5, every: 10 });
  const second = history({ deltas: 5, every: 10, start: emptySnapshot({ gpu: 32, epoch: "e2", ts: 6000 }) });
  const replay = new Replay();
  replay.add({ ...first.answers[0], window: { start: first.answers[0].window.start, end: 6000 } });
  replay.add(second.answers[0]);
  const a = replay.seek(first.moments[5].ts);
  assert.equal(a.changed, null);
  const b = replay.seek(second.moments[3].ts);
  assert.equal(b.changed, null);
  assert.equal(b.state.gpu.n, 32);
  assert.notEqual(b.state, a.state);
  assert.notEqual(replay.seek(second.moments[4].ts).changed, null);  // same sizes: repainted in place
});

test("at most maxWindows windows are kept: the one shown longest ago goes", () => {
  const { moments, answers } = history({ deltas: 50, every: 10 });  // five windows
  const replay = new Replay({ maxWindows: 3 });
  for (const k of [0, 1, 2]) replay.add(answers[k]);
  replay.seek(moments[5].ts);  // window 0 shown: window 1 is now the stalest
  replay.seek(moments[25].ts);  // window 2
  replay.add(answers[3]);
  assert.deepEqual(replay.windows.map((w) => w.start), [0, 2, 3].map((k) => answers[k].window.start));
  replay.add(answers[4]);  // window 0 goes; 2 is on screen, 4 just came
  assert.deepEqual(replay.windows.map((w) => w.start), [2, 3, 4].map((k) => answers[k].window.start));
  assert.equal(replay.seek(moments[5].ts), null);
  assert.equal(replay.seek(moments[45].ts).state.seq, moments[45].seq);
});

test("states share the requests a delta leaves alone, and never change a checkpoint's or a delta's", () => {
  const keyframe = new KVState(snapshot());
  const before = toSnapshot(keyframe);
  const grow = structuredClone(GROW);
  grow.requests.upsert[0].block_table = [3];  // an upsert that carries its table
  grow.tables.gpu.set = [];
  const kept = structuredClone(grow);
  const state = keyframe.clone();
  state.apply(grow);
  assert.deepEqual(grow, kept, "the delta is as it was");
  const later = state.clone();  // a checkpoint, shared with the state
  state.apply(delta(12, { tables: { gpu: { append: [[2, 4]], set: [] } },
                          requests: { progress: { index: [2], computed: [1], output: [1] } } }));
  assert.deepEqual(grow, kept, "a later append went into a copy of the upserted table");
  assert.deepEqual(toSnapshot(keyframe), before, "the keyframe is as it was");
  assert.deepEqual(later.requests.get(2).block_table, [3]);
  assert.deepEqual(state.requests.get(2).block_table, [3, 4]);
  // Request 1 took no part in delta 12: one object serves both states
  assert.equal(state.requests.get(1), later.requests.get(1));
  assert.notEqual(state.requests.get(2), later.requests.get(2));
  state.restore(later);  // a restore copies no request
  assert.equal(state.requests.get(2), later.requests.get(2));
  assert.deepEqual(state.requests.get(2).block_table, [3]);
});

test("a dropped window's states are the next windows' checkpoints, and every moment still rebuilds right", () => {
  const { moments, answers } = history({ deltas: 120, every: 20 });  // six windows
  const replay = new Replay({ maxWindows: 2, checkpointEvery: 5 });
  const seen = new Set();  // every checkpoint's GPU state array so far
  let reused = 0;
  answers.forEach((answer, k) => {
    replay.add(answer);
    const window = replay.windowAt(answer.window.start);
    for (const state of window.checkpoints.slice(1)) {
      if (seen.has(state.gpu.state)) reused++;
      seen.add(state.gpu.state);
    }
    window.checkpoints.forEach((state, c) => {
      assert.deepEqual(byIndex(toSnapshot(state)), byIndex(moments[20 * k + 5 * c]), `window ${k}, checkpoint ${c}`);
    });
    for (const t of scrubTimes(moments.slice(20 * k, 20 * k + 20), k)) {
      const expected = moments.filter((m) => m.ts <= t).pop();
      assert.deepEqual(byIndex(toSnapshot(replay.seek(t).state)), byIndex(expected), `at ${t}`);
    }
  });
  assert.ok(reused >= 3 * 3, `windows 2-5 took their checkpoints from dropped ones (${reused})`);
});
