// The engine's KV events, newest first: the recent history from Redis on load, then what
// each delta carries (block churn sampled; counts per kind say how many there were).
import { clock, esc } from "./format.js";

const CHURN = new Set(["BlockStored", "BlockRemoved", "BlockEvicted"]);
const KEEP = 400;  // events kept in memory
const SHOWN = 200;  // lines in the list
const SHOWN_IDS = 8;  // block ids per line (the event may list more)

export class EventLog {
  constructor(list, rateLine, showChurn, { onRequest }) {
    this.list = list;
    this.rateLine = rateLine;
    this.showChurn = showChurn;
    this.events = [];  // oldest first, at most KEEP
    this.fresh = [];  // arrived since the last render
    this.counts = {};  // per kind, since countsSince
    this.countsSince = performance.now();
    this.scheduled = false;
    showChurn.addEventListener("change", () => this.renderAll());
    list.addEventListener("click", (e) => {
      const link = e.target.closest("[data-request]");
      if (link) { e.preventDefault(); onRequest(link.dataset.request); }
    });
  }

  load(items) {
    this.events = items.slice(-KEEP);
    this.fresh = [];
    this.renderAll();
  }

  add(events, counts) {
    if (events && events.length) {
      this.events.push(...events);
      this.fresh.push(...events);
      if (this.events.length > KEEP) this.events.splice(0, this.events.length - KEEP);
    }
    for (const [kind, n] of Object.entries(counts || {})) this.counts[kind] = (this.counts[kind] || 0) + n;
    if (this.scheduled) return;
    this.scheduled = true;
    setTimeout(() => { this.scheduled = false; this.renderFresh(); }, 250);
  }

  lines(events) {  // newest first
    const churn = this.showChurn.checked;
    let html = "";
    for (let i = events.length - 1; i >= 0; i--) {
      if (churn || !CHURN.has(events[i].type)) html += line(events[i]);
    }
    return html;
  }

  renderAll() {
    this.list.innerHTML = this.lines(this.events) || `<div class="muted">No events yet.</div>`;
    this.trim();
  }

  renderFresh() {
    const html = this.lines(this.fresh.slice(-SHOWN));
    this.fresh = [];
    if (html) {
      if (this.list.firstElementChild && !this.list.firstElementChild.classList.contains("ev")) this.list.innerHTML = "";
      this.list.insertAdjacentHTML("afterbegin", html);
      this.trim();
    }
    this.renderRate();
  }

  trim() {
    while (this.list.childElementCount > SHOWN) this.list.lastElementChild.remove();
  }

  renderRate() {
    const now = performance.now();
    if (now - this.countsSince < 1000) return;
    const secs = (now - this.countsSince) / 1000;
    const parts = Object.entries(this.counts).sort((a, b) => b[1] - a[1])
      .map(([k, n]) => `${esc(k)} ${(n / secs).toFixed(n / secs < 10 ? 1 : 0)}/s`);
    this.rateLine.innerHTML = parts.length ? parts.join(" · ") : "no events in the last second";
    this.counts = {};
    this.countsSince = now;
  }
}

function line(e) {
  const ids = e.block_ids.slice(0, SHOWN_IDS);
  const blocks = e.num_blocks ? `${e.pool === "cpu" ? "cpu " : ""}${e.num_blocks} block${e.num_blocks > 1 ? "s" : ""} [${ids.join(",")}${e.num_blocks > ids.length ? ",…" : ""}]` : "";
  const who = e.request_id ? `<a href="#" data-request="${esc(e.request_id)}">${esc(e.request_id)}</a> ` : "";
  const extra = [e.num_tokens != null ? `${e.num_tokens} tokens` : "", e.detail ? esc(e.detail) : ""].filter(Boolean).join(" · ");
  return `<div class="ev"><span class="t">${clock(e.ts)}</span><span class="muted">step ${e.step}</span>
    <span class="evtype ${esc(e.type)}">${esc(e.type)}</span><span>${who}${blocks}${extra ? ` <span class="muted">${extra}</span>` : ""}</span></div>`;
}
