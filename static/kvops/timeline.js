// The engine page's timeline strip: drag back over the engine's stored history and the
// page shows its KV state at that moment; the right end, or "Back to live", returns. The
// slider spans what GET /api/engines/<name>/timeline/ holds; a position's window (a
// keyframe and its deltas) is fetched once, whole, and replay.js rebuilds every position
// in it locally, so dragging does not ask the server per pixel. The page paints.
import { api, errorText } from "./api.js";
import { $, clock } from "./format.js";
import { Replay } from "./replay.js";

const INDEX_EVERY_MS = 5000;  // how often the span is read again while live

// A moment as a URL gives it (?at=): Unix seconds, or an ISO 8601 time (UTC unless it
// says; its fraction of a second kept whole, past the milliseconds Date.parse keeps).
// null when it is neither.
export function parseMoment(text) {
  const value = String(text ?? "").trim();
  if (value === "") return null;
  if (/^[0-9]+(\.[0-9]*)?$/.test(value)) return Number(value);
  const parts = value.match(/^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:?\d\d)?$/i);
  if (!parts) return null;
  const zone = (parts[3] ?? "Z").toUpperCase().replace(/^([+-]\d\d)(\d\d)$/, "$1:$2");
  const whole = Date.parse(`${parts[1]}${zone}`);
  if (Number.isNaN(whole)) return null;
  return whole / 1000 + (parts[2] ? Number(`0${parts[2]}`) : 0);
}

function ago(seconds) {
  const s = Math.max(0, Math.round(seconds));
  return `−${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

export class TimelineStrip {
  constructor(root, engine, { onShow, onLive, current, perf }) {
    this.path = `/api/engines/${encodeURIComponent(engine)}/timeline/`;
    this.range = $("#timeline-range", root);
    this.oldestLabel = $("#timeline-oldest", root);
    this.atLabel = $("#timeline-at", root);
    this.liveButton = $("#timeline-live", root);
    this.onShow = onShow;  // (seek()'s answer): paint that state
    this.onLive = onLive;  // paint the live state again
    this.current = current;  // () => the state on screen (KVState or null): the first move repaints what differs
    this.perf = perf;  // kvopsPerf: scrubMs, seekMs (per position shown), fetchMs, addMs (per window), scrubWhole
    this.span = null;  // {oldest, newest} of the stored history (Unix seconds)
    this.scrubbing = false;
    this.anchor = null;  // while scrubbing: the time at the slider's right end
    this.want = null;  // the time asked for last
    this.replay = null;  // while scrubbing
    this.loading = false;
    this.range.addEventListener("input", () => this.moved());
    this.liveButton.addEventListener("click", () => this.goLive());
    this.readSpan();
    setInterval(() => { if (!this.scrubbing) this.readSpan(); }, INDEX_EVERY_MS);
  }

  async readSpan() {
    const result = await api("GET", this.path);
    if (!result.ok) { this.say(`history: ${errorText(result)}`, "offline"); return; }
    if (this.scrubbing) return;
    const { oldest, newest } = result.data;
    this.span = oldest === null || newest === null ? null : { oldest, newest };
    const seconds = this.span ? Math.max(0.1, newest - oldest) : 0.1;
    this.range.min = String(-Math.round(seconds * 10) / 10);
    this.range.disabled = !this.span;
    this.oldestLabel.textContent = this.span ? ago(seconds) : "no history yet";
  }

  moved() {
    const offset = Number(this.range.value);
    if (offset >= 0 || !this.span) { this.goLive(); return; }
    this.begin();
    this.want = Math.max(this.span.oldest, this.anchor + offset);
    this.show();
  }

  begin() {
    if (this.scrubbing) return;
    this.scrubbing = true;
    this.anchor = this.span.newest;  // fixed while scrubbing: the slider must not slide
    this.replay = new Replay({ onScreen: this.current() });
    this.liveButton.style.visibility = "visible";
  }

  // Open the timeline at moment t (Unix seconds), as a link from a job's KV story asks
  // (?at=): the first state stored at or after t, in which what happened at t shows
  // (replay.js firstFrom). Says so on the strip when the history does not hold t.
  async openAt(t) {
    await this.readSpan();
    if (this.scrubbing) return;  // the slider was moved meanwhile: it wins
    if (!this.span || t < this.span.oldest || t > this.span.newest) {
      const held = this.span ? `it holds ${clock(this.span.oldest)} to ${clock(this.span.newest)}` : "it holds nothing yet";
      this.say(`${clock(t)}: not in the stored history (${held})`, "offline");
      return;
    }
    this.begin();
    const replay = this.replay;
    this.want = null;  // (set by the slider if it moves meanwhile)
    this.loading = true;
    this.say("loading…", "stale");
    const result = await api("GET", `${this.path}state/?at=${t}&through=window`);
    this.loading = false;
    if (!this.scrubbing || replay !== this.replay) return;  // back to live meanwhile
    if (!result.ok) { this.say(errorText(result), "offline"); return; }
    replay.add(result.data);
    if (this.want === null) {
      this.want = replay.firstFrom(t) ?? t;
      this.range.value = String(Math.max(Number(this.range.min), this.want - this.anchor));
    }
    this.show();
  }

  show() {
    const started = performance.now();
    const shown = this.replay.seek(this.want);
    if (shown === null) { this.fetch(this.want); return; }
    const sought = performance.now();
    this.onShow(shown);
    this.perf.scrubMs.push(performance.now() - started);
    this.perf.seekMs.push(sought - started);
    if (shown.changed === null) this.perf.scrubWhole++;
    this.say(`${clock(shown.at)} · ${ago(this.anchor - shown.at)}${shown.gap ? " (the history has a gap here)" : ""}`, "stale");
  }

  // The window holding t, whole; then show what is wanted by then (the slider moved on).
  async fetch(t) {
    if (this.loading) return;  // its answer shows the latest position
    this.loading = true;
    this.say("loading…", "stale");
    const replay = this.replay;
    const started = performance.now();
    const result = await api("GET", `${this.path}state/?at=${t}&through=window`);
    this.loading = false;
    if (!this.scrubbing || replay !== this.replay) return;  // back to live meanwhile
    this.perf.fetchMs.push(performance.now() - started);
    if (!result.ok) { this.say(errorText(result), "offline"); return; }
    const adding = performance.now();
    replay.add(result.data);  // its checkpoints built: no position waits for them
    this.perf.addMs.push(performance.now() - adding);
    if (replay.windowAt(t) === null) { this.say(`no stored state at ${clock(t)}`, "offline"); return; }
    this.show();
  }

  goLive() {
    const was = this.scrubbing;
    this.scrubbing = false;
    this.replay = null;
    this.range.value = "0";
    this.liveButton.style.visibility = "hidden";
    this.say("live", "live");
    if (was) this.onLive();
    this.readSpan();
  }

  say(text, kind) {  // (the label keeps its width: the full text is its tooltip)
    this.atLabel.textContent = text;
    this.atLabel.title = text;
    this.atLabel.className = `pill conn ${kind}`;
  }
}
