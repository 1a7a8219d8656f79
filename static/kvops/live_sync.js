// The live protocol of the engine page (docs/live-protocol.md) without the page: start
// from a snapshot, apply the deltas that follow it in sequence, skip the ones it already
// has, ask for a snapshot again on a gap or when the engine goes silent. No DOM, no
// socket: the page sends what this says to send and paints what it says changed.
import { KVState } from "./kvstate.js";

// The publisher sends a delta at least once a second, idle or not. Nothing for STALE_MS
// (Redis restarted, say): ask for a snapshot again. No snapshot SNAPSHOT_WAIT_MS after
// asking: reconnect (the server waits 3 s for the engine, then sends the stored one).
export const STALE_MS = 3000;
export const SNAPSHOT_WAIT_MS = 6000;

// Where a delta stands against a state ({epoch, seq}: a KVState, or the last delta
// applied): "next" (apply it), "duplicate" (the state has it already) or "gap" (deltas
// are missing between them, or the publisher restarted).
export function placeDelta(at, delta) {
  if (delta.epoch !== at.epoch) return "gap";
  if (delta.seq <= at.seq) return "duplicate";
  return delta.seq === at.seq + 1 ? "next" : "gap";
}

export class LiveSync {
  constructor({ now = () => performance.now(), staleMs = STALE_MS, snapshotWaitMs = SNAPSHOT_WAIT_MS } = {}) {
    this.now = now;  // a clock in ms (tests pass their own)
    this.staleMs = staleMs;
    this.snapshotWaitMs = snapshotWaitMs;
    this.state = null;  // KVState, from the last snapshot and the deltas since
    this.awaiting = true;  // a snapshot is on its way: deltas wait for it
    this.askedAt = null;  // when that snapshot was asked for (null: not asked on this connection)
    this.heardAt = now();  // when the last delta or live snapshot came
  }

  // The connection (re)opened and the page subscribed: a snapshot is on its way.
  subscribed() {
    this.awaiting = true;
    this.askedAt = this.now();
  }

  // A snapshot (a stale one too: the last stored state of a stopped engine). Returns the
  // new state.
  applySnapshot(snapshot) {
    this.state = new KVState(snapshot);
    this.awaiting = false;
    this.askedAt = null;
    if (!this.state.stale) this.heardAt = this.now();
    return this.state;
  }

  // A delta. Applied: {ok: true, changed (KVState.apply's), nowLive (the state was a
  // stale snapshot that the engine's deltas follow: it is current now)}. Not applied:
  // {ok: false, skipped: why} when it changes nothing, or {ok: false, needsResync: why}
  // when a snapshot must be asked for (the deltas then wait for it).
  applyDelta(delta) {
    this.heardAt = this.now();
    if (!this.state || this.awaiting) return { ok: false, skipped: "awaiting a snapshot" };
    const place = placeDelta(this.state, delta);
    if (place === "duplicate") return { ok: false, skipped: "duplicate" };
    if (place === "gap") {
      const why = { gap: [this.state.epoch, this.state.seq], got: [delta.epoch, delta.seq] };
      this.resyncing();
      return { ok: false, needsResync: why };
    }
    const nowLive = this.state.stale;
    this.state.stale = false;
    return { ok: true, changed: this.state.apply(delta), nowLive };
  }

  // A snapshot was asked for: deltas wait for it.
  resyncing() {
    this.awaiting = true;
    this.askedAt = this.now();
  }

  // Called now and then while the connection is open. {reconnect: true} when the snapshot
  // asked for has not come in time; {resync: why} when the engine went silent (the
  // snapshot is then awaited); null when all is well. A stale state is left alone: the
  // engine's next delta, when it comes back, is a gap, and that resyncs.
  check() {
    const now = this.now();
    if (this.awaiting) {
      if (this.askedAt !== null && now - this.askedAt > this.snapshotWaitMs) {
        this.askedAt = null;
        return { reconnect: true };
      }
      return null;
    }
    if (!this.state.stale && now - this.heardAt > this.staleMs) {
      const why = { silentMs: Math.round(now - this.heardAt) };
      this.resyncing();
      return { resync: why };
    }
    return null;
  }
}
