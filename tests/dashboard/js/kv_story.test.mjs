// node --test: a job's KV story as the pages show it (static/kvops/kv_story.js), the
// misses counted between metrics samples (metrics.js increases), and opening the
// timeline at a moment (timeline.js parseMoment, replay.js firstFrom), without a browser.
import assert from "node:assert/strict";
import test from "node:test";

import { SOURCE_CSS } from "../../../static/kvops/colors.js";
import { compactStoryHtml, momentHref, missesHtml, storyHtml, stripHtml } from "../../../static/kvops/kv_story.js";
import { plural } from "../../../static/kvops/format.js";
import { MetricsHistory } from "../../../static/kvops/metrics.js";
import { Replay } from "../../../static/kvops/replay.js";
import { parseMoment } from "../../../static/kvops/timeline.js";
import { FINISH, GROW, snapshot } from "./kv_fixtures.mjs";

const REASONS = { never_cached: "no engine block has held this hash", evicted: "its block was taken",
                  partial_block: "only the last block missed" };
const AT = "2026-12-04T19:42:05.767397+00:00";
const AT_LATER = "2026-12-04T19:42:06.100000+00:00";
const AT_LATEST = "2026-12-04T19:42:07.100000+00:00";

// A story as GET /api/jobs/<id>/kv/ gives it: 3 GPU hits, a CPU-tier hit, then 2 computed
// blocks (the last partly filled), its first miss at block 4, evicted by job-88-1; one
// preemption (kv_full), then an operator's swap out and swap in.
function story(extra = {}) {
  const sources = ["gpu", "gpu", "gpu", "cpu", "computed", "computed"];
  return {
    job: 12, status: "finished", engine: "a", request_id: "job-12-1", told: true, block_size: 16,
    prompt_tokens: 89, cached_tokens: { gpu: 48, cpu: 16, disk: 0 },
    blocks: sources.map((source, index) => ({ index, hash: index < 5 ? `h${index}` : null, source })),
    first_miss: { block: 4, reason: "evicted", at: AT, by: "job-88-1",
                  detail: "block 4 was evicted at 19:42:05 to make room for job-88-1 (least recently used first)" },
    preemptions: [{ at: AT, reason: "kv_full", by: "job-90-1", needed_blocks: 5, free_blocks: 2,
                    recomputed_tokens: 40 }],
    swaps: [{ at: AT_LATER, direction: "out", reason: "operator", by: "admin", needed_blocks: null,
              free_blocks: null, blocks: 3 },
            { at: AT_LATEST, direction: "in", reason: "operator", by: "admin", needed_blocks: null,
              free_blocks: null, blocks: 3 }],
    moves: [],
    routing: { policy: "prefix", engine: "a", hit_tokens: 64, best_engine: "b", best_hit_tokens: 80 },
    copy_on_write: 1, window_freed: 0,
    moments: { admitted: AT, first_token: AT, preemptions: [AT, AT], ended: AT },
    ...extra,
  };
}

// The cells of a strip: [{block, classes, colour}] in order.
function cells(html) {
  return [...html.matchAll(/<span class="kv-cell ([^"]*)" data-block="(\d+)" style="--src:([^"]*)"/g)]
    .map(([, classes, block, colour]) => ({ block: Number(block), classes: classes.split(" "), colour }));
}

test("the strip has one cell per prompt block, coloured by source, the first miss ringed", () => {
  const shown = cells(stripHtml(story()));
  assert.deepEqual(shown.map((c) => c.block), [0, 1, 2, 3, 4, 5]);
  assert.deepEqual(shown.map((c) => c.classes[0]), ["src-gpu", "src-gpu", "src-gpu", "src-cpu", "src-computed", "src-computed"]);
  assert.deepEqual(shown.map((c) => c.colour), [SOURCE_CSS.gpu, SOURCE_CSS.gpu, SOURCE_CSS.gpu, SOURCE_CSS.cpu,
                                                 SOURCE_CSS.computed, SOURCE_CSS.computed]);
  assert.deepEqual(shown.filter((c) => c.classes.includes("first-miss")).map((c) => c.block), [4]);
  assert.match(stripHtml(story()), /title="block 5: tokens 80–88, computed, partly filled/);
  const full = cells(stripHtml(story({ first_miss: null })));
  assert.equal(full.filter((c) => c.classes.includes("first-miss")).length, 0);
});

test("a moment's link names the engine, the moment and the request that took the blocks", () => {
  const href = momentHref("a b", AT, "job-88-1", "evicted");
  const url = new URL(href, "http://x");
  assert.equal(url.pathname, "/engines/a%20b/");
  assert.equal(url.searchParams.get("request"), "job-88-1");
  assert.equal(url.searchParams.get("at"), AT);  // the "+" of the zone survives
  // an operator, or another user's hidden request, is no request to select
  assert.equal(new URL(momentHref("a", AT, "admin", "operator_evict"), "http://x").searchParams.get("request"), null);
  assert.equal(new URL(momentHref("a", AT, "another user's request", "evicted"), "http://x").searchParams.has("request"), false);
  assert.equal(momentHref("a", null, "job-88-1", "evicted"), null);
  assert.equal(momentHref(null, AT, "job-88-1", "evicted"), null);
});

test("the job page's story says the first miss in words, the tiers, the causes and the routing", () => {
  const html = storyHtml(story(), REASONS);
  assert.match(html, /64<\/b> of 89 prompt tokens cached \(GPU 48 · CPU 16 · disk 0\), <b>25<\/b> computed/);
  assert.match(html, /data-reason="evicted" data-block="4"/);
  assert.ok(html.includes("its block was taken"));
  assert.ok(html.includes("block 4 was evicted at 19:42:05 to make room for job-88-1 (least recently used first)"));
  const links = [...html.matchAll(/<a class="moment" href="([^"]*)"/g)].map((m) => m[1].replaceAll("&amp;", "&"));
  assert.equal(links.length, 4);  // the first miss, the preemption and both swaps
  assert.equal(new URL(links[1], "http://x").searchParams.get("request"), "job-90-1");
  assert.equal(new URL(links[2], "http://x").searchParams.has("request"), false);  // the operator's
  assert.match(html, /<tr data-kind="preemption" data-reason="kv_full">[\s\S]*the GPU pool ran out of free blocks[\s\S]*5 needed, 2 free[\s\S]*40 tokens recomputed/);
  assert.match(html, /holding 64 tokens of its prefix[\s\S]*>b<\/a>, holding 80 tokens/);
});

test("a swap out and a swap in are named as what they were, and counted apart from preemptions", () => {
  const html = storyHtml(story(), REASONS);
  const kinds = [...html.matchAll(/<tr data-kind="([^"]+)"/g)].map((m) => m[1]);
  assert.deepEqual(kinds, ["preemption", "swap-out", "swap-in"]);  // in time order
  assert.match(html, /<tr data-kind="swap-out" data-reason="operator">[\s\S]*an operator swapped it out[\s\S]*3 blocks swapped out/);
  assert.match(html, /<tr data-kind="swap-in" data-reason="operator">[\s\S]*an operator swapped it in[\s\S]*3 blocks swapped in/);
  assert.doesNotMatch(html, /an operator preempted it/);
  // the engine page's numbers: preemptions (recompute) and swaps out/in
  assert.match(html, /1 preemption \(recompute\) · swaps out\/in 1\/1/);
  const resumed = storyHtml(story({ swaps: [{ at: AT, direction: "in", reason: null, by: null, blocks: 2 }] }), REASONS);
  assert.match(resumed, /swapped back in once blocks were free/);
  // a move in from another engine is a move, neither a preemption nor a swap
  const moved = storyHtml(story({ moves: [{ at: AT_LATEST, from: "east", blocks_sent: 6 }] }), REASONS);
  assert.match(moved, /<tr data-kind="move"[\s\S]*moved here from engine east[\s\S]*6 blocks sent/);
  assert.match(moved, /· 1 move</);
});

test("a story not told yet says why; a full hit says no miss", () => {
  const untold = storyHtml({ told: false, detail: "its engine has not admitted it yet", job: 3 }, REASONS);
  assert.match(untold, /its engine has not admitted it yet/);
  assert.doesNotMatch(untold, /kv-cell/);
  assert.match(compactStoryHtml({ told: false, detail: "its engine has not admitted it yet", job: 3 }, REASONS),
               /job 3[\s\S]*not admitted/);
  assert.match(storyHtml(story({ first_miss: null }), REASONS), /kv-miss none/);
});

test("a prompt shorter than one block says it has no full block, not that nothing missed", () => {
  // a 7-token prompt, nothing cached: one partly filled block, no hash, no first miss
  const short = story({ prompt_tokens: 7, cached_tokens: { gpu: 0, cpu: 0, disk: 0 }, first_miss: null,
                        blocks: [{ index: 0, hash: null, source: "computed" }], preemptions: [],
                        copy_on_write: 0 });
  const html = storyHtml(short, REASONS);
  assert.match(html, /kv-miss no-full-block/);
  assert.match(html, /No full block<\/b>: the prompt's 7 tokens fill no block of 16/);
  assert.doesNotMatch(html, /No miss|kv-miss none/);
  assert.doesNotMatch(compactStoryHtml(short, REASONS), /No miss|kv-miss none/);
});

test("counts read in the singular when they are 1", () => {
  const one = story({ prompt_tokens: 1, cached_tokens: { gpu: 0, cpu: 0, disk: 0 }, first_miss: null,
                      blocks: [{ index: 0, hash: null, source: "computed" }], copy_on_write: 1, window_freed: 1,
                      preemptions: [{ at: AT, reason: "kv_full", by: null, needed_blocks: 1, free_blocks: 0,
                                      recomputed_tokens: 1, swapped_blocks: 0 }] });
  const html = storyHtml(one, REASONS);
  assert.match(html, /1 prompt token in 1 block\s+of 16 tokens/);
  assert.match(html, /of 1 prompt token cached/);
  assert.match(html, /1 block copied before a write/);
  assert.match(html, /1 block given back/);
  assert.match(html, /1 token recomputed/);
  assert.doesNotMatch(html, /\b1 (blocks|tokens|prompt tokens)\b/);
  assert.equal(plural(1, "token"), "1 token");
  assert.equal(plural(0, "token"), "0 tokens");
  assert.equal(plural(1200, "token"), "1,200 tokens");
});

test("the compact story counts preemptions by cause and keeps the first miss", () => {
  const html = compactStoryHtml(story(), REASONS);
  assert.match(html, /preemptions: <b>1<\/b> \(kv_full 1\)\s+· swaps out\/in <b>1\/1<\/b>/);
  assert.match(html, /data-reason="evicted"/);
  assert.equal(cells(html).length, 6);
  assert.match(html, /href="\/jobs\/12\/"/);
});

test("misses by reason: a bar each, largest first, zeros left out, the widest full", () => {
  const html = missesHtml({ never_cached: 500, evicted: 1200, salt: 0, partial_block: 9 }, REASONS);
  const rows = [...html.matchAll(/data-reason="([^"]+)" data-tokens="(\d+)"/g)].map((m) => [m[1], Number(m[2])]);
  assert.deepEqual(rows, [["evicted", 1200], ["never_cached", 500], ["partial_block", 9]]);
  assert.match(html, /width:100\.0%/);
  assert.match(html, /width:41\.7%/);
  assert.match(missesHtml({}, REASONS), /No prompt tokens missed/);
});

test("increases: the counters' growth over the span, from the last point before it", () => {
  const h = new MetricsHistory();
  const m = (ts, missed) => ({ ts, missed_tokens_by_reason: missed });
  assert.equal(h.increases("missed_tokens_by_reason", 0), null);
  h.load([m(100, { never_cached: 50 }), m(101, { never_cached: 80 }), m(102, { never_cached: 80, evicted: 30 }),
          m(103, undefined), m(104, { never_cached: 100, evicted: 30 })]);
  // (a point without the map, then the map again: the counters went on, they did not restart)
  assert.deepEqual(h.increases("missed_tokens_by_reason", 0), { totals: { never_cached: 50, evicted: 30 }, from: 100 });
  assert.deepEqual(h.increases("missed_tokens_by_reason", 101.5), { totals: { never_cached: 20, evicted: 30 }, from: 101 });
  // (from the last point with the map at or before the span's start)
  assert.deepEqual(h.increases("missed_tokens_by_reason", 103.5), { totals: { never_cached: 20, evicted: 0 }, from: 102 });
  assert.deepEqual(h.increases("missed_tokens_by_reason", 104), { totals: {}, from: 104 });
  // the engine restarted: its counters began again from zero
  h.load([m(200, { evicted: 900 }), m(201, { evicted: 950 }), m(202, { evicted: 20 }), m(203, { evicted: 25 })]);
  assert.deepEqual(h.increases("missed_tokens_by_reason", 0).totals, { evicted: 75 });
});

test("parseMoment reads ISO 8601 to the microsecond and Unix seconds", () => {
  assert.equal(parseMoment("2026-12-04T19:42:05Z"), Date.UTC(2026, 11, 4, 19, 42, 5) / 1000);
  const precise = parseMoment(AT);
  assert.ok(Math.abs(precise - (Date.UTC(2026, 11, 4, 19, 42, 5) / 1000 + 0.767397)) < 1e-6, precise);
  assert.equal(parseMoment("2026-12-04T20:42:05+01:00"), parseMoment("2026-12-04T19:42:05Z"));
  assert.equal(parseMoment("2026-12-04T20:42:05+0100"), parseMoment("2026-12-04T19:42:05Z"));
  assert.equal(parseMoment("1796413325.5"), 1796413325.5);
  for (const bad of ["", "soon", "2026-12-04", "12:00:00"]) assert.equal(parseMoment(bad), null, bad);
});

test("firstFrom: the first state stored at or after a moment, across windows", () => {
  // window 1: its keyframe at 1001.0 (seq 10), a delta at 1001.1; window 2 from 1001.2
  const first = snapshot();
  const newest = FINISH.ts + 0.1;
  const answers = [
    { window: { start: first.ts, end: FINISH.ts }, newest, keyframe: first, deltas: [GROW] },
    { window: { start: FINISH.ts, end: null }, newest, keyframe: snapshot({ seq: 12 }), deltas: [] },
  ];
  const replay = new Replay();
  assert.equal(replay.firstFrom(first.ts), null);  // nothing fetched yet
  replay.add(answers[0]);
  assert.equal(replay.firstFrom(first.ts), first.ts);  // the keyframe itself
  assert.equal(replay.firstFrom(1001.05), GROW.ts);  // an event between two states: the one after
  assert.equal(replay.firstFrom(GROW.ts), GROW.ts);
  assert.equal(replay.firstFrom(1001.15), FINISH.ts);  // after the window's last delta: the next keyframe
  replay.add(answers[1]);
  assert.equal(replay.firstFrom(FINISH.ts + 0.05), FINISH.ts + 0.05);  // nothing stored after it
  assert.equal(replay.seek(replay.firstFrom(1001.05)).state.requestById("r2").status, "running");
});

test("the job page's story says the KV block-seconds it held by pool, or that they were not counted", () => {
  const html = storyHtml(story({ block_seconds: { gpu: 1234.5, cpu: 2.25 } }), REASONS);
  assert.match(html, /<dt>KV held<\/dt><dd>1,235 block-seconds on the GPU pool · 2\.3 on the CPU pool/);
  assert.match(storyHtml(story(), REASONS), /<dt>KV held<\/dt><dd>not counted/);
});

test("a preemption and a swap out for the cache quota say why, and link the request that needed the room", () => {
  const html = storyHtml(story({
    preemptions: [{ at: AT, reason: "cache_quota", by: "job-91-1", needed_blocks: 1, free_blocks: 30,
                    recomputed_tokens: 12 }],
    swaps: [{ at: AT_LATER, direction: "out", reason: "cache_quota", by: "job-91-1", needed_blocks: 1,
              free_blocks: 30, blocks: 4 }],
  }), REASONS);
  assert.match(html, /<tr data-kind="preemption" data-reason="cache_quota">[\s\S]*another tenant&#39;s cache, kept under its quota[\s\S]*1 needed, 30 free/);
  assert.match(html, /<tr data-kind="swap-out" data-reason="cache_quota">[\s\S]*swapped out: the room left was another tenant&#39;s cache/);
  const links = [...html.matchAll(/<a class="moment" href="([^"]*)"/g)].map((m) => m[1].replaceAll("&amp;", "&"));
  assert.deepEqual(links.slice(1, 3).map((l) => new URL(l, "http://x").searchParams.get("request")),
                   ["job-91-1", "job-91-1"]);
});
