// A job's KV story (GET /api/jobs/<id>/kv/, built by kvops/dashboard/kv_story_view.py) as HTML: the
// prompt as a strip of blocks coloured by where their K/V came from, the first miss
// marked on it with its reason, the preemptions with their causes, the router's view.
// The job page shows all of it (storyHtml), the engine page's selected request a compact
// version (compactStoryHtml) and its "Misses by reason" panel the bars (missesHtml).
// No DOM and no fetch here: the pages fetch and place the HTML, and
// tests/dashboard/js/kv_story.test.mjs runs this in node.
//
// `reasons` is engine/observe/story.py FIRST_MISS_REASONS (reason -> sentence), which the
// page views hand to the pages: the sentences are kept there only.
import { SOURCE_CSS } from "./colors.js";
import { blockSeconds, clock, esc, num, plural } from "./format.js";

export const SOURCE_WORDS = { gpu: "GPU hit", cpu: "CPU-tier hit", computed: "computed" };
// Why a request was preempted (recompute) or swapped (engine/observe/story.py
// PREEMPTION_REASONS), in words. What each count means: engine/sched/scheduler.py, above
// SchedulerCounters (a preemption recomputes; swaps and moves are counted apart).
export const PREEMPTION_WORDS = {
  kv_full: "the GPU pool ran out of free blocks",
  priority: "a request of higher priority needed its blocks",
  fairness: "a tenant served fewer tokens needed the room (fairness vtc)",
  cache_quota: "its tenant's newer request gave way: the room left was another tenant's cache, kept under its quota",
  operator: "an operator preempted it",
};
export const SWAP_WORDS = {
  out: { kv_full: "swapped out: the GPU pool ran out of free blocks",
         priority: "swapped out: a request of higher priority needed its blocks",
         fairness: "swapped out: a tenant served fewer tokens needed the room (fairness vtc)",
         cache_quota: "swapped out: the room left was another tenant's cache, kept under its quota",
         operator: "an operator swapped it out" },
  // (the scheduler's swap in has no reason: it resumed once blocks were free)
  in: { operator: "an operator swapped it in", resumed: "swapped back in once blocks were free" },
};
// Reasons whose `by` is the request that took the blocks (the others' is an operator).
const BY_A_REQUEST = new Set(["evicted", "kv_full", "priority", "fairness", "cache_quota"]);
// What a plain user sees instead of another user's request id (kvops/dashboard/kv_story_view.py _seal).
const SEALED = "another user's request";
export const TERMINAL = new Set(["finished", "failed", "cancelled"]);

// ISO 8601 -> Unix seconds (to the millisecond: for showing, not for seeking).
function isoSeconds(iso) {
  return Date.parse(iso) / 1000;
}

// The engine page at a moment of its timeline, with the request that took the blocks
// selected when `by` names one the viewer may see. null without a moment.
export function momentHref(engine, at, by, reason) {
  if (!engine || !at) return null;
  const query = new URLSearchParams();
  if (by && by !== SEALED && BY_A_REQUEST.has(reason)) query.set("request", by);
  query.set("at", at);
  return `/engines/${encodeURIComponent(engine)}/?${query}`;
}

// One cell per prompt block, coloured by source; the first miss's cell is ringed.
export function stripHtml(doc, { compact = false } = {}) {
  const bs = doc.block_size;
  const missAt = doc.first_miss ? doc.first_miss.block : null;
  const cells = doc.blocks.map((b) => {
    const first = b.index * bs, last = Math.min((b.index + 1) * bs, doc.prompt_tokens) - 1;
    const miss = b.index === missAt;
    const title = `block ${b.index}: tokens ${first}–${last}, ${SOURCE_WORDS[b.source] ?? b.source}`
      + (b.hash ? `, hash ${b.hash}` : ", partly filled (no hash: always computed)")
      + (miss ? ". The first miss" : "");
    return `<span class="kv-cell src-${esc(b.source)}${miss ? " first-miss" : ""}" data-block="${b.index}"`
      + ` style="--src:${SOURCE_CSS[b.source] ?? "#999"}" title="${esc(title)}"></span>`;
  });
  return `<div class="kv-strip${compact ? " compact" : ""}" aria-label="the prompt's blocks">${cells.join("")}</div>`;
}

export function legendHtml() {
  const item = (source) => `<span><span class="swatch" style="background:${SOURCE_CSS[source]}"></span>${SOURCE_WORDS[source]}</span>`;
  return `<div class="kv-legend">${Object.keys(SOURCE_WORDS).map(item).join("")}
    <span><span class="swatch first-miss"></span>first miss</span></div>`;
}

function cachedHtml(doc) {
  const c = doc.cached_tokens;
  const cached = c.gpu + c.cpu + c.disk;
  return `<span class="kv-cached"><b>${num(cached)}</b> of ${plural(doc.prompt_tokens, "prompt token")} cached `
    + `(GPU ${num(c.gpu)} · CPU ${num(c.cpu)} · disk ${num(c.disk)}), <b>${num(doc.prompt_tokens - cached)}</b> computed</span>`;
}

function missHtml(doc, reasons) {
  const miss = doc.first_miss;
  if (!miss && !doc.blocks.some((b) => b.hash)) {  // (a full block has a hash)
    return `<div class="kv-miss no-full-block"><b>No full block</b>: the prompt's ${plural(doc.prompt_tokens, "token")}`
      + ` fill no block of ${num(doc.block_size)}, so nothing could be found cached: all were computed.</div>`;
  }
  if (!miss) {
    return `<div class="kv-miss none"><b>No miss</b>: every full block of the prompt was found cached.</div>`;
  }
  const href = momentHref(doc.engine, miss.at, miss.by, miss.reason);
  return `<div class="kv-miss" data-reason="${esc(miss.reason)}" data-block="${miss.block}">
    <b>First miss</b> at block ${miss.block}: <b class="mono">${esc(miss.reason)}</b>
    <span class="muted">(${esc(reasons[miss.reason] ?? "no sentence for this reason")})</span>
    <div class="kv-detail">${esc(miss.detail)}</div>
    ${href ? `<a class="moment" href="${esc(href)}">see it on engine ${esc(doc.engine)}'s timeline at ${clock(isoSeconds(miss.at))}</a>` : ""}
  </div>`;
}

// The story's preemptions (recompute), swaps (out and in) and moves in one table, in
// time order, each row named for what it was (data-kind: preemption, swap-out, swap-in,
// move).
function eventRows(doc) {
  const rows = [
    ...doc.preemptions.map((p) => ({ at: p.at, kind: "preemption", reason: p.reason, by: p.by,
      words: PREEMPTION_WORDS[p.reason] ?? "", needed: p.needed_blocks, free: p.free_blocks,
      cost: p.recomputed_tokens ? `${plural(p.recomputed_tokens, "token")} recomputed` : "" })),
    ...(doc.swaps ?? []).map((s) => ({ at: s.at, kind: `swap-${s.direction}`, reason: s.reason, by: s.by,
      words: SWAP_WORDS[s.direction]?.[s.reason ?? "resumed"] ?? "", needed: s.needed_blocks, free: s.free_blocks,
      cost: `${plural(s.blocks, "block")} swapped ${s.direction}` })),
    ...(doc.moves ?? []).map((m) => ({ at: m.at, kind: "move", reason: null, by: m.from,
      words: `moved here from engine ${m.from}`, needed: null, free: null,
      cost: m.blocks_sent ? `${plural(m.blocks_sent, "block")} sent` : "" })),
  ];
  return rows.sort((a, b) => (a.at ?? "").localeCompare(b.at ?? ""));
}

const KIND_WORDS = { preemption: "preempted (recompute)", "swap-out": "swapped out", "swap-in": "swapped in", move: "moved" };

function preemptionsHtml(doc) {
  const events = eventRows(doc);
  if (!events.length) return `<p class="muted kv-preemptions">No preemptions, swaps or moves.</p>`;
  const rows = events.map((e) => {
    const href = e.kind === "move" ? null : momentHref(doc.engine, e.at, e.by, e.reason);
    return `<tr data-kind="${e.kind}" data-reason="${esc(e.reason ?? "")}"><td class="muted">${e.at ? clock(isoSeconds(e.at)) : "–"}</td>
      <td><b>${KIND_WORDS[e.kind]}</b>${e.reason ? ` <b class="mono">${esc(e.reason)}</b>` : ""}<br><span class="muted">${esc(e.words)}</span></td>
      <td class="mono">${esc(e.by ?? "–")}</td>
      <td>${e.needed == null ? "–" : `${num(e.needed)} needed, ${num(e.free)} free`}</td>
      <td>${e.cost || "–"}</td>
      <td>${href ? `<a class="moment" href="${esc(href)}">timeline</a>` : ""}</td></tr>`;
  });
  return `<table class="list kv-preemptions"><thead><tr><th>at</th><th>what</th><th>by</th>
    <th>blocks</th><th>cost</th><th></th></tr></thead><tbody>${rows.join("")}</tbody></table>`;
}

// Swaps out and in, as the engine page's header shows them ("1/1").
function swapsText(doc) {
  const swaps = doc.swaps ?? [];
  const out = swaps.filter((s) => s.direction === "out").length;
  return `${num(out)}/${num(swaps.length - out)}`;
}

// The counts as the engine page's header and request rows show them.
export function countsText(doc) {
  return `${plural(doc.preemptions.length, "preemption")} (recompute) · swaps out/in ${swapsText(doc)}`
    + ((doc.moves ?? []).length ? ` · ${plural(doc.moves.length, "move")}` : "");
}

function routingRows(doc) {
  const r = doc.routing;
  const engine = (name) => `<a href="/engines/${encodeURIComponent(name)}/">${esc(name)}</a>`;
  if (r.hit_tokens === null) {
    return [["routing", `${esc(r.policy ?? "–")}: looked at no cached prefixes`],
            ["engine chosen", r.engine ? engine(r.engine) : "–"]];
  }
  const best = r.best_engine === null ? "none held any of its prefix"
    : r.best_engine === r.engine ? `${engine(r.best_engine)} (the one chosen)`
    : `${engine(r.best_engine)}, holding ${num(r.best_hit_tokens)} tokens of its prefix`;
  return [["routing", esc(r.policy ?? "–")],
          ["engine chosen", `${r.engine ? engine(r.engine) : "–"}, holding ${num(r.hit_tokens)} tokens of its prefix`],
          ["best engine", best]];
}

// The KV blocks it held x the seconds it held them, by pool (what GET /api/usage/ bills).
function heldText(held) {
  if (!held) return "not counted (its story was told before the engine counted them)";
  return `${blockSeconds(held.gpu ?? 0)} block-seconds on the GPU pool · ${blockSeconds(held.cpu ?? 0)} on the CPU pool (swapped out)`;
}

// The job page's panel: everything the story says.
export function storyHtml(doc, reasons) {
  if (!doc.told) return `<p class="muted kv-untold">No KV story yet: ${esc(doc.detail)}.</p>`;
  const m = doc.moments;
  const at = (iso) => (iso ? clock(isoSeconds(iso)) : "–");
  const facts = [
    ...routingRows(doc),
    ["copy on write", `${plural(doc.copy_on_write, "block")} copied before a write (shared with another request)`],
    ["window", `${plural(doc.window_freed, "block")} given back by a sliding window`],
    ["KV held", heldText(doc.block_seconds)],
    ["moments", `admitted ${at(m.admitted)} · first token ${at(m.first_token)} · ended ${at(m.ended)}`],
  ];
  return `<p class="kv-summary">${plural(doc.prompt_tokens, "prompt token")} in ${plural(doc.blocks.length, "block")}
      of ${plural(doc.block_size, "token")} on engine ${esc(doc.engine)}: ${cachedHtml(doc)}.</p>
    ${stripHtml(doc)}${legendHtml()}${missHtml(doc, reasons)}
    <dl class="facts">${facts.map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("")}</dl>
    <h4>Preemptions, swaps and moves <span class="muted kv-counts" style="text-transform:none">${countsText(doc)}</span></h4>
    ${preemptionsHtml(doc)}`;
}

// The engine page's selected request: the strip, cached tokens, the first miss and how
// many preemptions, with a link to the job's page for the rest.
export function compactStoryHtml(doc, reasons) {
  const head = `<div class="muted" style="font-size:12px">KV story of <a href="/jobs/${esc(doc.job)}/">job ${esc(doc.job)}</a></div>`;
  if (!doc.told) return `<div class="kv-compact">${head}<p class="muted kv-untold">${esc(doc.detail)}.</p></div>`;
  const causes = {};
  for (const p of doc.preemptions) causes[p.reason] = (causes[p.reason] ?? 0) + 1;
  const listed = Object.entries(causes).map(([reason, n]) => `${esc(reason)} ${n}`).join(", ");
  return `<div class="kv-compact">${head}${stripHtml(doc, { compact: true })}
    <p>${cachedHtml(doc)}</p>${missHtml(doc, reasons)}
    <p class="kv-preemption-count">preemptions: <b>${doc.preemptions.length}</b>${listed ? ` (${listed})` : ""}
      · swaps out/in <b>${swapsText(doc)}</b></p></div>`;
}

// The engine page's "Misses by reason": totals {reason: prompt tokens}, a bar each,
// largest first, the reason in words.
export function missesHtml(totals, reasons) {
  const rows = Object.entries(totals).filter(([, n]) => n > 0).sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
  if (!rows.length) return `<p class="muted">No prompt tokens missed in this span.</p>`;
  const top = rows[0][1];
  return `<div class="bars">${rows.map(([reason, n]) => `<div class="bar-row" data-reason="${esc(reason)}" data-tokens="${n}">
      <span><b class="mono">${esc(reason)}</b> <span class="muted">${esc(reasons[reason] ?? "")}</span></span>
      <span class="bar"><span style="width:${(100 * n / top).toFixed(1)}%"></span></span>
      <span class="num">${num(n)}</span></div>`).join("")}</div>`;
}
