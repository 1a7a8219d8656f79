// What the tooltip of a hovered block says: from the state on screen (its state, ref
// count, holders and their places in their tables, its hash), then, once the engine
// answered the page's `block` question (docs/live-protocol.md), what only the engine
// knows: each holder's text (the viewer's own requests' and, for staff, everyone's),
// how long ago its last holder let it go, and its place among the free cached blocks
// in the evictor's order. Pure: the page passes the state and the answer.
import { esc, num } from "./format.js";

const HOLDERS_SHOWN = 6;

// 1st, 2nd, 3rd, 4th … 11th, 12th, 13th … 21st
export function ordinal(n) {
  const tens = n % 100, ones = n % 10;
  const suffix = tens >= 11 && tens <= 13 ? "th" : ["th", "st", "nd", "rd"][ones] ?? "th";
  return `${num(n)}${suffix}`;
}

// Shared at a count: "×2", "×3" (nothing when one holds it).
export function sharedMark(refCnt) {
  return refCnt > 1 ? `×${refCnt}` : "";
}

// "3 s", "4 min", "2 h": how long ago, coarse enough to read at a glance.
export function agoText(s) {
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

// The tokens a holder's block covers: tokens [start, end) of its sequence, as the engine
// counts them (Reporter._holders): the blocks a sliding window gave back come first.
export function tokenRange(request, position, blockSize) {
  const start = (position + (request.window_freed_blocks || 0)) * blockSize;
  return [start, start + blockSize];
}

// The tooltip's HTML. facts: the engine's answer for this block (null until it comes);
// othersOf(request): true for another user's request (its text is never shown).
export function blockTipHtml(state, poolName, id, facts, othersOf) {
  const p = state[poolName];
  const kind = state.blockStates[p.state[id]];
  const refCnt = p.ref_cnt[id];
  const lines = [`<b>${poolName.toUpperCase()} block ${id}</b> · ${esc(kind)}`,
                 `ref count ${refCnt}${refCnt > 1 ? ` (shared ${sharedMark(refCnt)})` : ""}`];
  const texts = new Map((facts?.holders || []).map((h) => [h.request_id, h]));
  const holders = state.holders(poolName, id);
  for (const h of holders.slice(0, HOLDERS_SHOWN)) {
    const r = h.request;
    const known = texts.get(r.request_id);
    const [start, end] = known ? known.tokens : tokenRange(r, h.position, state.config.block_size);
    const who = othersOf(r) ? "another user's request" : r.job_id ? `job ${esc(r.job_id)}` : "no job";
    lines.push(`<span class="muted">held by</span> ${esc(r.request_id)} (${who}): tokens ${num(start)}–${num(end - 1)}`);
    if (known && known.text !== null && known.text !== undefined) {
      lines.push(`<span class="tip-text">“${esc(known.text)}”</span>`);
    }
  }
  if (holders.length > HOLDERS_SHOWN) lines.push(`<span class="muted">and ${holders.length - HOLDERS_SHOWN} more</span>`);
  if (kind === "cached") lines.push(`<span class="muted">held by</span> the prefix cache (no request holds it)`);
  if (kind === "pinned") lines.push(`<span class="muted">held by</span> a pin${holders.length ? " and its requests" : ""}`);
  if (facts) {
    lines.push(facts.idle_s === null ? "in use now" : `last used ${agoText(facts.idle_s)} ago`);
    if (facts.eviction) {
      lines.push(`${ordinal(facts.eviction.place)} to be evicted of ${num(facts.eviction.of)} cached`);
    }
  } else if (poolName === "gpu" && kind === "cached" && state.evictRank[id] >= 0) {
    lines.push(`next from the free queue: #${state.evictRank[id] + 1} (its data will be evicted)`);
  }
  if (state.sealed) {
    lines.push(`<span class="muted">hash: shown to operators (your own requests' on their job pages)</span>`);
  } else {
    lines.push(p.hash32[id] ? `hash <span class="mono">${p.hash32[id].toString(16).padStart(8, "0")}…</span>` : `<span class="muted">no hash (not in the prefix cache)</span>`);
  }
  return lines.join("<br>");
}
