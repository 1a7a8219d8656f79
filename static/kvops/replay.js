// An engine's recent past, rebuilt in the browser from its stored timeline (GET
// /api/engines/<name>/timeline/state/?through=window): windows of one keyframe (a full
// snapshot) and the deltas after it, kept once fetched. The state at a moment is the
// keyframe of the window holding it with the window's deltas up to that moment applied,
// in sequence (live_sync.js's rule: a duplicate is skipped, a gap ends what the window
// can tell). No DOM, no fetch: the page asks for windows and paints what seek() says.
//
// A window keeps the state after every CHECKPOINT_EVERY-th delta (a checkpoint, built
// once when it is added), so a seek restores the checkpoint at or before its moment and
// applies fewer than CHECKPOINT_EVERY deltas, wherever the previous seek was; a seek a
// little forward of the last one applies only the deltas in between. What it returns to
// repaint is what differs from the cells on screen.
import { KVState } from "./kvstate.js";
import { placeDelta } from "./live_sync.js";

// What the map shows of a pool, as seek() last left it: a copy of its per-block
// arrays and whether each block is in the eviction order (a cell marks that, not the
// place, which moves for the whole queue whenever a block leaves it).
class ShownPool {
  constructor(pool, rank) {
    this.state = pool.state.slice();
    this.ref_cnt = pool.ref_cnt.slice();
    this.owner = pool.owner.slice();
    this.hash32 = pool.hash32.slice();
    this.tenant32 = pool.tenant32.slice();
    this.queued = rank ? Uint8Array.from(rank, (r) => (r >= 0 ? 1 : 0)) : null;
  }

  // The block ids whose cells differ in `pool` (with `rank`, its eviction order places)
  // from what was shown; what is shown becomes `pool`. A scan of every block's typed
  // arrays: cheaper than keeping lists of the blocks each delta touched, and exact.
  update(pool, rank) {
    const ids = [];
    const { state, ref_cnt, owner, hash32, tenant32, queued } = this;
    for (let i = 0; i < pool.n; i++) {
      const q = queued !== null && rank[i] >= 0 ? 1 : 0;
      if (state[i] !== pool.state[i] || ref_cnt[i] !== pool.ref_cnt[i] || owner[i] !== pool.owner[i]
          || hash32[i] !== pool.hash32[i] || tenant32[i] !== pool.tenant32[i]
          || (queued !== null && queued[i] !== q)) {
        ids.push(i);
        state[i] = pool.state[i];
        ref_cnt[i] = pool.ref_cnt[i];
        owner[i] = pool.owner[i];
        hash32[i] = pool.hash32[i];
        tenant32[i] = pool.tenant32[i];
        if (queued !== null) queued[i] = q;
      }
    }
    return ids;
  }
}

class Window {
  // spare: states of windows dropped (Replay.add), reused for this one's checkpoints.
  constructor(answer, every, spare = []) {
    this.start = answer.window.start;  // the keyframe's time (Unix seconds)
    this.end = answer.window.end;  // the next keyframe's time; null: the newest window
    this.through = answer.newest;  // the newest moment stored when it was fetched
    const keyframe = new KVState(answer.keyframe);
    this.deltas = [];  // those that follow the keyframe in sequence, up to the first gap
    this.gap = false;  // deltas were missing after the last of them
    let last = keyframe;
    for (const delta of answer.deltas) {
      const place = placeDelta(last, delta);
      if (place === "duplicate") continue;
      if (place === "gap") { this.gap = true; break; }
      this.deltas.push(delta);
      last = delta;
    }
    this.every = every;  // deltas between two checkpoints
    // The states after deltas 0 (the keyframe), every, 2 * every, ...: never applied to,
    // a seek restores one into its own state.
    // A checkpoint takes a spare state's per-block arrays when there is one: a window
    // of fresh ones is megabytes of new buffers, and buffers allocated at that pace make
    // the browser collect garbage in the middle of the next positions.
    this.checkpoints = [keyframe];
    const copy = (from) => {
      const into = spare.pop();
      if (!into || into.gpu.n !== from.gpu.n || into.cpu.n !== from.cpu.n) return from.clone();
      into.restore(from);
      from.disown();  // the two share requests now: the one applied to copies on write
      return into;
    };
    const state = copy(keyframe);
    for (let i = 0; i < this.deltas.length - 1; i++) {
      state.apply(this.deltas[i]);
      if ((i + 1) % every === 0) this.checkpoints.push(copy(state));
    }
    this.working = state;  // (the last deltas' state: spare once the window goes)
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

  // The latest checkpoint at or before `count` deltas: its index.
  checkpointBefore(count) {
    return Math.min(Math.floor(count / this.every), this.checkpoints.length - 1);
  }

  // Apply deltas [from, to) to `state`; returns the request indices whose block tables
  // they changed.
  replay(state, from, to) {
    const tables = new Set();
    for (let i = from; i < to; i++) for (const index of state.apply(this.deltas[i]).tables) tables.add(index);
    return tables;
  }
}

// Windows kept at most: each holds its parsed deltas and a few whole states (its
// checkpoints), so dragging over five minutes must not keep them all.
export const MAX_WINDOWS = 12;
// Deltas between two checkpoints: a seek applies fewer than this many. Each checkpoint
// is a whole state.
export const CHECKPOINT_EVERY = 10;

function shownOf(state) {
  return { gpu: new ShownPool(state.gpu, state.evictRank), cpu: new ShownPool(state.cpu, null) };
}

export class Replay {
  // onScreen: the state the page shows before the first seek (the live one), or null.
  constructor({ maxWindows = MAX_WINDOWS, checkpointEvery = CHECKPOINT_EVERY, onScreen = null } = {}) {
    this.maxWindows = maxWindows;
    this.checkpointEvery = checkpointEvery;
    this.onScreen = onScreen;  // never applied to (live deltas may be, unpainted, meanwhile)
    this.windows = [];  // Window, by start time
    this.cursor = null;  // {window, count (deltas applied), state}: what seek() showed last
    // {gpu, cpu}: ShownPool, the cells on screen: onScreen's now, then as seek() left them.
    this.shown = onScreen ? shownOf(onScreen) : null;
    this.uses = 0;  // a clock of seeks: each window remembers when it was last shown
    this.spare = [];  // states of dropped windows, for the next window's checkpoints
  }

  // An answer of timeline/state/?through=window (a window fetched again replaces itself).
  // Over maxWindows, the one shown longest ago goes (never the one on screen).
  add(answer) {
    const window = new Window(answer, this.checkpointEvery, this.spare);
    window.used = ++this.uses;
    this.windows = this.windows.filter((w) => w.start !== window.start);
    this.windows.push(window);
    this.windows.sort((a, b) => a.start - b.start);
    // The state on screen stays, but the next seek rebuilds it from this window's checkpoints.
    if (this.cursor?.window?.start === window.start) this.cursor.window = null;
    while (this.windows.length > this.maxWindows) {
      const onScreen = this.cursor?.window;
      const stalest = this.windows.filter((w) => w !== onScreen && w !== window)
        .reduce((a, b) => (b.used < a.used ? b : a));
      this.windows = this.windows.filter((w) => w !== stalest);
      this.spare.push(...stalest.checkpoints.slice(1), stalest.working);  // (not the keyframe: decoded anew)
      this.spare.length = Math.min(this.spare.length, 2 * (stalest.checkpoints.length + 1));
    }
  }

  windowAt(t) {
    return this.windows.find((w) => w.holds(t)) || null;
  }

  // The time of the first state stored at or after t: t itself when a state was stored
  // then, else the next delta of the window holding t, else the next window's keyframe
  // (t when no state was stored after it). null when no window fetched holds t. What
  // happened at t (an event's time) shows in the state stored at the end of its step,
  // which is this one; the state at t is the one before.
  firstFrom(t) {
    const window = this.windowAt(t);
    if (!window) return null;
    const count = window.countUpTo(t);
    if (t === window.start || (count > 0 && window.deltas[count - 1].ts === t)) return t;
    if (count < window.deltas.length) return window.deltas[count].ts;
    return window.end ?? t;
  }

  // The state at time t, or null when no window fetched holds t. Returns {state, changed,
  // at, gap}: `changed` is what differs from the state on screen (the last seek's, or
  // onScreen on the first): {gpu, cpu: the block ids whose cells look different, tables:
  // request indices whose block tables may differ, structural}; null when the pools have
  // other sizes (paint it whole). `state` is one object from the first seek on, applied
  // to in place (the first seek's is new). `at` is the time of the last change applied;
  // `gap`: the history has a gap between `at` and t, so the state is the one just before.
  seek(t) {
    const window = this.windowAt(t);
    if (!window) return null;
    window.used = ++this.uses;
    const count = window.countUpTo(t);
    const at = count ? window.deltas[count - 1].ts : window.start;
    const gap = window.gap && count === window.deltas.length && t > at;
    const base = window.checkpointBefore(count);
    const from = base * window.every;
    const checkpoint = window.checkpoints[base];
    const c = this.cursor;
    const before = c ? c.state : this.onScreen;
    if (!before || before.gpu.n !== checkpoint.gpu.n || before.cpu.n !== checkpoint.cpu.n) {
      const state = checkpoint.clone();
      window.replay(state, from, count);
      this.cursor = { window, count, state };
      this.shown = shownOf(state);
      return { state, changed: null, at, gap };
    }
    let state, tables;
    if (c && c.window === window && c.count <= count && count - c.count < window.every) {
      // On from what is shown: fewer than `every` deltas too, and no restore (which copies
      // every request).
      state = c.state;
      tables = window.replay(state, c.count, count);
    } else {
      tables = new Set(before.requests.keys());  // any table may differ: those before and after
      if (c) {
        state = c.state;
        state.restore(checkpoint);
      } else {
        state = checkpoint.clone();
      }
      window.replay(state, from, count);
      for (const index of state.requests.keys()) tables.add(index);
    }
    this.cursor = { window, count, state };
    const changed = { gpu: this.shown.gpu.update(state.gpu, state.evictRank),
                      cpu: this.shown.cpu.update(state.cpu, null), tables, structural: true };
    return { state, changed, at, gap };
  }
}
