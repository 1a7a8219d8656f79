// The engine's KV events, newest first: the recent history from Redis on load, then what
// each delta carries (block churn sampled; counts per kind say how many there were).
import { clock, esc } from "./format.js";

const CHURN = new Set(["BlockStored", "BlockRemoved", "BlockEvicted"]);
const KEEP = 400;

export class EventLog {
  constructor(list, rateLine, showChurn, { onRequest }) {
    this.list = list;
    this.rateLine = rateLine;
    this.showChurn = showChurn;
    this.events = [];
    this.counts = {};  // per kind, over the last second
    this.countsSince = performance.now();
    this.scheduled = false;
    showChurn.addEventListener("change", () => this.render());
    list.addEventListener("click", (e) => {
      const link = e.target.closest("[data-request]");
      if (link) onRequest(link.dataset.request);
    });
  }

  load(items) {
    this.events = items.slice(-KEEP);
    this.schedule();
  }

  add(events, counts) {
    if (events && events.length) {
      this.events.push(...events);
      if (this.events.length > KEEP) this.events.splice(0, this.events.length - KEEP);
    }
    for (const [kind, n] of Object.entries(counts || {})) this.counts[kind] = (this.counts[kind] || 0) + n;
    this.schedule();
  }

  schedule() {
    if (this.scheduled) return;
    this.scheduled = true;
    setTimeout(() => { this.scheduled = false; this.render(); }, 250);
  }

  render() {
    const now = performance.now();
    if (now - this.countsSince >= 1000) {
      const secs = (now - this.countsSince) / 1000;
      const parts = Object.entries(this.counts).sort((a, b) => b[1] - a[1])
        .map(([k, n]) => `${esc(k)} ${(n / secs).toFixed(n / secs < 10 ? 1 : 0)}/s`);
      this.rateLine.innerHTML = parts.length ? parts.join(" · ") : "no events in the last second";
      this.counts = {};
      this.countsSince = now;
    }
    const churn = this.showChurn.checked;
    let html = "";
    let shown = 0;
    for (let i = this.events.length - 1; i >= 0 && shown < 200; i--) {
      const e = this.events[i];
      if (!churn && CHURN.has(e.type)) continue;
      shown++;
      const blocks = e.num_blocks ? `${e.pool === "cpu" ? "cpu " : ""}${e.num_blocks} block${e.num_blocks > 1 ? "s" : ""} [${e.block_ids.join(",")}${e.num_blocks > e.block_ids.length ? ",…" : ""}]` : "";
      const who = e.request_id ? `<a href="#" data-request="${esc(e.request_id)}">${esc(e.request_id)}</a> ` : "";
      const extra = [e.num_tokens != null ? `${e.num_tokens} tokens` : "", e.detail ? esc(e.detail) : ""].filter(Boolean).join(" · ");
      html += `<div class="ev"><span class="t">${clock(e.ts)}</span><span class="muted">step ${e.step}</span>
        <span class="evtype ${esc(e.type)}">${esc(e.type)}</span><span>${who}${blocks}${extra ? ` <span class="muted">${extra}</span>` : ""}</span></div>`;
    }
    this.list.innerHTML = html || `<div class="muted">No events yet.</div>`;
  }
}
