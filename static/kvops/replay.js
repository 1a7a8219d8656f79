// An engine's recent past, rebuilt in the browser from its stored timeline (GET
// /api/engines/<name>/timeline/state/?through=window): windows of one keyframe (a full
// snapshot) and the deltas after it, kept once fetched. The state at a moment is the
// keyframe of the window holding it with the window's deltas up to that moment applied,
// in sequence (live_sync.js's rule: a duplicate is skipped, a gap ends what the window
// can tell). No DOM, no fetch: the page asks for windows and paints what seek() says.
import { KVState, ungap } from "./kvstate.js";
import { placeDelta } from "./live_sync.js";

// What a delta can change: block ids per pool (with its eviction order), request indices.
function touchedBy(delta) {
  const gpu = delta.gpu ? ungap(delta.gpu.ids) : [];
  if (delta.eviction_order) append(gpu, delta.eviction_order);
  const requests = [];
  const r = delta.requests || {};
  for (const entry of r.upsert || []) requests.push(entry.index);
  append(requests, r.removed || []);
  if (r.progress) append(requests, ungap(r.progress.index));
  for (const ops of Object.values(delta.tables || {})) {
    for (const op of [...ops.append, ...ops.set]) requests.push(op[0]);
  }
  return { gpu, cpu: delta.cpu ? ungap(delta.cpu.ids) : [], requests };
}

function append(to, from) {  // (push(...from) runs out of stack on a whole pool's ids)
  for (let i = 0; i < from.length; i++) to.push(from[i]);
}

function cellDiffers(a, b, i) {
  return a.state[i] !== b.state[i] || a.ref_cnt[i] !== b.ref_cnt[i] || a.owner[i] !== b.owner[i]
    || a.hash32[i] !== b.hash32[i];
}

// Block ids where two pools' per-block arrays differ.
function differing(a, b) {
  const ids = [];
  for (let i = 0; i < a.state.length; i++) if (cellDiffers(a, b, i)) ids.push(i);
  return ids;
}

// What a pool looks like on the map: its per-block arrays and places in the eviction order.
function looks(pool, rank) {
  return { state: pool.state.slice(), ref_cnt: pool.ref_cnt.slice(), owner: pool.owner.slice(),
           hash32: pool.hash32.slice(), rank: rank ? rank.slice() : null };
}

// Of the candidate ids (repeats allowed), those whose cell looks different now: a move
// touches the same blocks many times, and most of them end up as they were.
function differingAmong(before, pool, rank, candidates) {
  const seen = new Uint8Array(pool.n);
  const ids = [];
  for (const id of candidates) {
    if (seen[id]) continue;
    seen[id] = 1;
    if (cellDiffers(before, pool, id) || (rank && before.rank[id] !== rank[id])) ids.push(id);
  }
  return ids;
}

class Window {
  constructor(answer) {
    this.start = answer.window.start;  // the keyframe's time (Unix seconds)
    this.end = answer.window.end;  // the next keyframe's time; null: the newest window
    this.through = answer.newest;  // the newest moment stored when it was fetched
    this.keyframe = new KVState(answer.keyframe);  // never applied to: states are clones
    this.deltas = [];  // those that follow the keyframe in sequence, up to the first gap
    this.gap = false;  // deltas were missing after the last of them
    let last = this.keyframe;
    for (const delta of answer.deltas) {
      const place = placeDelta(last, delta);
      if (place === "duplicate") continue;
      if (place === "gap") { this.gap = true; break; }
      this.deltas.push(delta);
      last = delta;
    }
    this.touched = this.deltas.map(touchedBy);
    this.used = 0;  // Replay.uses when last added or shown
  }

  holds(t) {
    return t >= this.start && (this.end === null ? t <= this.through : t < this.end);
  }

  // How many of the deltas happened at or before t.
  countUpTo(t) {
    let lo = 0, hi = this.deltas.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (this.deltas[mid].ts <= t) lo = mid + 1; else hi = mid;
    }
    return lo;
  }

  // Add what deltas [from, to) can change to `changed`.
  collect(changed, from, to) {
    for (let i = from; i < to; i++) {
      const t = this.touched[i];
      append(changed.gpu, t.gpu);
      append(changed.cpu, t.cpu);
      for (const index of t.requests) changed.tables.add(index);
    }
  }
}

// Windows kept at most: at 65,536 blocks each holds a few MB once parsed, so dragging
// over five minutes must not keep them all.
export const MAX_WINDOWS = 12;

export class Replay {
  constructor({ maxWindows = MAX_WINDOWS } = {}) {
    this.maxWindows = maxWindows;
    this.windows = [];  // Window, by start time
    this.cursor = null;  // {window, count (deltas applied), state}: what seek() showed last
    this.uses = 0;  // a clock of seeks: each window remembers when it was last shown
  }

  // An answer of timeline/state/?through=window (a window fetched again replaces itself).
  // Over maxWindows, the one shown longest ago goes (never the one on screen).
  add(answer) {
    const window = new Window(answer);
    window.used = ++this.uses;
    this.windows = this.windows.filter((w) => w.start !== window.start);
    this.windows.push(window);
    this.windows.sort((a, b) => a.start - b.start);
    if (this.cursor && this.cursor.window.start === window.start) this.cursor = null;
    while (this.windows.length > this.maxWindows) {
      const onScreen = this.cursor?.window;
      const stalest = this.windows.filter((w) => w !== onScreen && w !== window)
        .reduce((a, b) => (b.used < a.used ? b : a));
      this.windows = this.windows.filter((w) => w !== stalest);
    }
  }

  windowAt(t) {
    return this.windows.find((w) => w.holds(t)) || null;
  }

  // The state at time t, or null when no window fetched holds t. Returns {state, changed,
  // at, gap}: `changed` is null when `state` is another object than last time (paint it
  // whole), else what to repaint ({gpu, cpu: the block ids whose cells look different,
  // tables: request indices, structural}); `at` is the time of the last change applied;
  // `gap`: the history has a gap between `at` and t, so the state is the one just before.
  seek(t) {
    const window = this.windowAt(t);
    if (!window) return null;
    window.used = ++this.uses;
    const count = window.countUpTo(t);
    const at = count ? window.deltas[count - 1].ts : window.start;
    const gap = window.gap && count === window.deltas.length && t > at;
    const c = this.cursor;
    if (!c || c.state.gpu.n !== window.keyframe.gpu.n || c.state.cpu.n !== window.keyframe.cpu.n) {
      const state = window.keyframe.clone();
      for (let i = 0; i < count; i++) state.apply(window.deltas[i]);
      this.cursor = { window, count, state };
      return { state, changed: null, at, gap };
    }
    const state = c.state;
    const changed = { gpu: [], cpu: [], tables: new Set(), structural: true };
    const before = { gpu: looks(state.gpu, state.evictRank), cpu: looks(state.cpu, null) };
    if (c.window === window && count >= c.count) {  // forward in a window: only what comes next
      for (let i = c.count; i < count; i++) {
        const step = state.apply(window.deltas[i]);
        append(changed.gpu, step.gpu);
        append(changed.cpu, step.cpu);
        for (const index of step.tables) changed.tables.add(index);
      }
    } else {
      // Back to a keyframe. The cells that may differ between the state shown and the one
      // wanted: those either run of deltas touched, and those where the keyframes differ.
      c.window.collect(changed, 0, c.count);
      if (c.window !== window) {
        window.collect(changed, 0, count);
        append(changed.gpu, differing(c.window.keyframe.gpu, window.keyframe.gpu));
        append(changed.cpu, differing(c.window.keyframe.cpu, window.keyframe.cpu));
        for (const index of state.requests.keys()) changed.tables.add(index);
        for (const index of window.keyframe.requests.keys()) changed.tables.add(index);
      }
      append(changed.gpu, state.restore(window.keyframe));
      for (let i = 0; i < count; i++) state.apply(window.deltas[i]);
    }
    changed.gpu = differingAmong(before.gpu, state.gpu, state.evictRank, changed.gpu);
    changed.cpu = differingAmong(before.cpu, state.cpu, null, changed.cpu);
    this.cursor = { window, count, state };
    return { state, changed, at, gap };
  }
}
