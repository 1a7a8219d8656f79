// node --test: the what-if panel's pure logic (static/kvops/what_if_report.js).
import assert from "node:assert/strict";
import test from "node:test";

import {
  commonTimeline, comparisonRows, fidelityText, requestBody, stepCostText, sweepSeries, sweepSuggestion,
  sweepValueText,
  sweepTable, traceSummary,
} from "../../../static/kvops/what_if_report.js";

test("the request body leaves empty fields out and types the rest", () => {
  const body = requestBody({ minutes: "15", max_jobs: "", num_gpu_blocks: " 256 ", block_size: "32",
                             preemption_mode: "swap", enable_prefix_caching: "false",
                             cpu_prefix_cache: "true", step_token_ms: "0.1", max_num_seqs: "" });
  assert.deepEqual(body, { minutes: 15, num_gpu_blocks: 256, block_size: 32, preemption_mode: "swap",
                           enable_prefix_caching: false, cpu_prefix_cache: true, step_token_ms: 0.1 });
});

const config = (blocks, extra = {}) => ({ num_gpu_blocks: blocks, block_size: 16, pool_tokens: blocks * 16,
  num_cpu_blocks: 64, preemption_mode: "recompute", max_num_seqs: 8, max_num_batched_tokens: 512,
  enable_prefix_caching: true, ...extra });
const result = (blocks, preemptions, hit, wait, extra = {}) => ({ config: config(blocks, extra),
  sim_seconds: 10, output_tokens_per_s: 100, kv_usage_mean: 0.5, kv_usage_peak: 1, slot_utilisation: 0.9,
  preemptions, swaps_out: 0, prefix_hit_rate: hit, queue_wait_p50: wait, queue_wait_p99: 2 * wait,
  peak_concurrency: 8, timeline: { t: [], gpu: [], cpu: [], waiting: [] } });

test("rows compare both runs: counts in percent, ratios in points", () => {
  const rows = comparisonRows({ baseline: result(64, 40, 0.25, 0.5), alternative: result(256, 10, 0.4, 0.5) });
  const row = (label) => rows.find((r) => r.label === label);
  assert.equal(row("GPU pool").baseline, "64 × 16 = 1024 tokens");
  assert.equal(row("GPU pool").alternative, "256 × 16 = 4096 tokens");
  assert.equal(row("preemptions (recompute)").change, "-75%");
  assert.equal(row("prefix hit rate").baseline, "25.0%");
  assert.equal(row("prefix hit rate").change, "+15.0 pt");
  assert.equal(row("queue wait p50").baseline, "500 ms");
  assert.equal(row("queue wait p50").change, "=");
  assert.equal(row("CPU prefix tier"), undefined);  // neither run has the setting
  const tier = comparisonRows({ baseline: result(64, 1, 0, 0, { cpu_prefix_cache: false }),
                                alternative: result(64, 1, 0, 0, { cpu_prefix_cache: true }) });
  assert.deepEqual([tier.find((r) => r.label === "CPU prefix tier").baseline,
                    tier.find((r) => r.label === "CPU prefix tier").alternative], ["off", "on"]);
});

test("both timelines share one axis to the later finish; the shorter one stops", () => {
  const a = { t: [1, 2, 3, 4], gpu: [0.1, 0.2, 0.3, 0.4] };  // ends at 4 s
  const b = { t: [2, 4, 6, 8], gpu: [0.5, 0.6, 0.7, 0.8] };  // ends at 8 s
  const line = commonTimeline(a, b, "gpu", 8);
  assert.equal(line.end, 8);
  assert.deepEqual(line.baseline, [0.1, 0.2, 0.3, 0.4, null, null, null, null]);
  assert.deepEqual(line.alternative, [0.5, 0.5, 0.6, 0.6, 0.7, 0.7, 0.8, 0.8]);
});

test("the trace line says what was replayed and what the engine recorded", () => {
  const text = traceSummary({ jobs: 12, minutes: 30, max_jobs: 2000, truncated: false, span_s: 3.25,
    still_running: 0, prompt_tokens: 1200, output_tokens: 300, prefix_groups: 2, prefixes_from: "tokens",
    recorded: { prefix_hit_rate: 0.125, preemptions: 3 } });
  assert.match(text, /Replayed 12 jobs of the last 30 min/);
  assert.match(text, /2 prefix groups \(from the prompts' tokens\)/);
  assert.match(text, /prefix hit rate 12\.5%, 3 preemptions/);
  assert.equal(traceSummary({}), "");
});

test("the trace line says how the replay started, what it applied and what it could not", () => {
  const text = traceSummary({ jobs: 3, minutes: 10, max_jobs: 100, truncated: false, span_s: 2,
    still_running: 0, prompt_tokens: 300, output_tokens: 12, prefix_groups: 1, prefixes_from: "tokens",
    warmup_jobs: 4, actions: 2, moved_in: 1, moved_out: 0, recorded: {},
    not_replayed: [{ action: "swap-out job-9-1", at: 1.25, why: "its request is not one of the replayed jobs'" },
                   { action: "pin", at: null, why: "held when the replay starts" }] });
  assert.match(text, /a warm start: 4 earlier jobs replayed first \(in no figure\)/);
  assert.match(text, /2 operator actions replayed at their times/);
  assert.match(text, /1 moved in, 0 moved away/);
  assert.match(text, /not replayed: swap-out job-9-1 at 1\.3 s \(its request is not one of the replayed jobs'\); pin \(held when the replay starts\)/);
  const cold = traceSummary({ jobs: 1, minutes: 1, span_s: 0, prompt_tokens: 10, output_tokens: 1,
    prefix_groups: 0, prefixes_from: "tokens", warmup_jobs: 0, actions: 0, not_replayed: [], recorded: {} });
  assert.match(cold, /an empty cache at the start/);
  assert.doesNotMatch(cold, /not replayed|operator action|moved/);
  const rows = comparisonRows({
    baseline: { ...result(48, 3, 0.2, 1), actions_applied: 2, actions_refused: [] },
    alternative: { ...result(96, 3, 0.2, 1), actions_applied: 1, actions_refused: [{ action: "preempt job-3-1", at: 2, why: "ended" }] } });
  const row = (label) => rows.find((r) => r.label === label);
  assert.deepEqual([row("operator actions applied").baseline, row("operator actions refused").alternative], ["2", "1"]);
  assert.equal(comparisonRows({ baseline: result(1, 1, 0, 0), alternative: result(1, 1, 0, 0) })
    .find((r) => r.label === "operator actions refused"), undefined);
});

test("the tier, policy and K/V dtype levers: a disk size in GiB travels as bytes", () => {
  const body = requestBody({ disk_cache_gib: "1.5", eviction_policy: "slru", kv_cache_dtype: "fp8_e4m3",
                             cpu_prefix_cache: "true" });
  assert.deepEqual(body, { disk_cache_bytes: 1610612736, eviction_policy: "slru",
                           kv_cache_dtype: "fp8_e4m3", cpu_prefix_cache: true });
  const rows = comparisonRows({
    baseline: { ...result(48, 20, 0.1, 1), disk_tier_hit_rate: 0, ttft_p99: 2.5, prompt_tokens_computed: 9000,
                config: config(48, { kv_cache_dtype: "bfloat16", disk_cache_bytes: 0, eviction_policy: "lru" }) },
    alternative: { ...result(96, 5, 0.3, 1), disk_tier_hit_rate: 0.2, ttft_p99: 0.5, prompt_tokens_computed: 6000,
                   config: config(96, { kv_cache_dtype: "fp8_e4m3", disk_cache_bytes: 2 ** 31, eviction_policy: "slru" }) },
  });
  const row = (label) => rows.find((r) => r.label === label);
  assert.deepEqual([row("K/V dtype").baseline, row("K/V dtype").alternative], ["bfloat16", "fp8_e4m3"]);
  assert.deepEqual([row("disk tier").baseline, row("disk tier").alternative], ["off", "2.0 GiB"]);
  assert.equal(row("  of which from disk").change, "+20.0 pt");
  assert.equal(row("TTFT p99").change, "-80%");
  assert.equal(row("prompt tokens computed").change, "-33%");
  // an engine that does not say its K/V dtype (the simulator): no row
  assert.equal(comparisonRows({ baseline: result(1, 1, 0, 0), alternative: result(1, 1, 0, 0) })
    .find((r) => r.label === "K/V dtype"), undefined);
});

test("the pin budget travels as a share; the rows say what the engine's pins held", () => {
  assert.deepEqual(requestBody({ pin_budget_percent: "25" }), { pin_budget: 0.25 });
  const rows = comparisonRows({
    baseline: { ...result(48, 3, 0.2, 1), pinned_blocks: 4, pins_refused: 0, config: config(48, { pin_budget: 0.5 }) },
    alternative: { ...result(48, 3, 0.1, 1), pinned_blocks: 0, pins_refused: 1, config: config(48, { pin_budget: 0 }) },
  });
  const row = (label) => rows.find((r) => r.label === label);
  assert.deepEqual([row("pin budget").baseline, row("pin budget").alternative], ["50.0%", "0.0%"]);
  assert.deepEqual([row("blocks pinned (the engine's pins)").baseline, row("pins refused (past the budget)").alternative], ["4", "1"]);
});

test("a baseline that misses what the engine recorded says so first, and names the figure", () => {
  const figures = { prefix_hit_rate: { recorded: 0.358, replayed: 0.36, difference: 0.002 },
                    ttft_p50: { recorded: 0.0683, replayed: 0.0237, difference: -0.0446 } };
  const missed = fidelityText({ fidelity: { figures, misses: ["ttft_p50"], tolerance: {} } });
  assert.equal(missed.missed, true);
  assert.match(missed.text, /^The replay of the engine's own configuration misses what it recorded \(TTFT p50\)/);
  assert.match(missed.text, /TTFT p50 68 ms recorded, 24 ms replayed/);
  const held = fidelityText({ fidelity: { figures, misses: [], tolerance: {} } });
  assert.equal(held.missed, false);
  assert.match(held.text, /holds to what it recorded: prefix hit rate 35.8% recorded, 36.0% replayed/);
  assert.deepEqual(fidelityText({}), { missed: false, text: "" });
});

test("the step cost says where it came from", () => {
  const text = stepCostText({ step_base_ms: 10.04, step_token_ms: 0.2, step_decode_seq_ms: 0.21,
                              step_context_token_ms: 0, step_block_ms: 0, source: "engine" });
  assert.equal(text, "a step: 10 ms + 0.2 ms a prompt token + 0.21 ms a decode sequence "
    + "(fitted to the engine's steps)");
});

test("a sweep travels as its lever and values, each typed as the lever's own field", () => {
  assert.deepEqual(requestBody({ minutes: "10", sweep_lever: "num_gpu_blocks", sweep_values: "64, 128 256,512" }),
                   { minutes: 10, sweep: { lever: "num_gpu_blocks", values: [64, 128, 256, 512] } });
  assert.deepEqual(requestBody({ sweep_lever: "eviction_policy", sweep_values: "lru,slru" }).sweep,
                   { lever: "eviction_policy", values: ["lru", "slru"] });
  assert.deepEqual(requestBody({ sweep_lever: "pin_budget_percent", sweep_values: "0, 50" }).sweep,
                   { lever: "pin_budget", values: [0, 0.5] });
  assert.deepEqual(requestBody({ sweep_lever: "disk_cache_gib", sweep_values: "0 2" }).sweep,
                   { lever: "disk_cache_bytes", values: [0, 2 * 2 ** 30] });
  assert.deepEqual(requestBody({ sweep_lever: "cpu_prefix_cache", sweep_values: "off, on" }).sweep,
                   { lever: "cpu_prefix_cache", values: [false, true] });
  // not a number: sent as typed, for the API to name (NaN would travel as null)
  assert.deepEqual(requestBody({ sweep_lever: "max_num_seqs", sweep_values: "4, lots" }).sweep,
                   { lever: "max_num_seqs", values: [4, "lots"] });
  // no lever: no sweep, whatever the values field holds
  assert.deepEqual(requestBody({ sweep_lever: "", sweep_values: "1, 2" }), {});
});

test("the tenants' levers: the quota travels as a share, fairness as its name", () => {
  assert.deepEqual(requestBody({ tenant_cache_quota_percent: "50", fairness: "vtc" }),
                   { tenant_cache_quota: 0.5, fairness: "vtc" });
  assert.deepEqual(requestBody({ sweep_lever: "tenant_cache_quota_percent", sweep_values: "25, 100" }).sweep,
                   { lever: "tenant_cache_quota", values: [0.25, 1] });
  assert.equal(sweepSuggestion("fairness", undefined), "share, vtc");
  assert.equal(sweepValueText("tenant_cache_quota", 0.25), "25.0%");
});

test("a sweep's suggestion is every choice, or the engine's value halved to quadrupled", () => {
  assert.equal(sweepSuggestion("eviction_policy", undefined), "lru, slru, lfu, priority");
  assert.equal(sweepSuggestion("num_gpu_blocks", "256"), "128, 256, 512, 1024");
  assert.equal(sweepSuggestion("max_num_seqs", "1"), "1, 2, 4");  // (each once)
  assert.equal(sweepSuggestion("num_cpu_blocks", "0"), "");
  assert.equal(sweepSuggestion("disk_cache_gib", "none"), "");
});

const sweepRun = () => ({
  baseline: { ...result(256, 3, 0.58, 0.05), ttft_p50: 0.09, ttft_p99: 0.4 },
  alternative: {},
  sweep: { lever: "num_gpu_blocks", results: [
    { value: 128, ...result(128, 37, 0.46, 0.5), ttft_p50: 0.79, ttft_p99: 2.5 },
    { value: 512, ...result(512, 0, 0.69, 0.01), ttft_p50: 0.085, ttft_p99: null },
  ] },
});

test("a sweep's series are each value's figures, the engine's configuration beside them", () => {
  const series = sweepSeries(sweepRun());
  assert.equal(series.label, "GPU blocks");
  assert.deepEqual(series.values, ["128", "512"]);
  assert.deepEqual(series.hitRate, [0.46, 0.69]);
  assert.deepEqual(series.ttftP50, [0.79, 0.085]);
  assert.deepEqual(series.ttftP99, [2.5, null]);  // (a gap, not a zero)
  assert.deepEqual(series.baseline, { hitRate: 0.58, ttftP50: 0.09, ttftP99: 0.4 });
  const budgets = sweepSeries({ baseline: {}, sweep: { lever: "pin_budget", results: [
    { value: 0 }, { value: 0.25 }] } });
  assert.deepEqual(budgets.values, ["0.0%", "25.0%"]);
  assert.equal(sweepSeries({ baseline: {}, alternative: {}, sweep: {} }), null);
  assert.equal(sweepSeries({ baseline: {}, alternative: {} }), null);
});

test("a sweep's table has a column a value, after the engine's configuration", () => {
  const table = sweepTable(sweepRun());
  assert.deepEqual(table.columns, ["engine's configuration", "GPU blocks 128", "GPU blocks 512"]);
  const row = (label) => table.rows.find((r) => r.label === label);
  assert.deepEqual(row("prefix hit rate").cells, ["58.0%", "46.0%", "69.0%"]);
  assert.deepEqual(row("preemptions (recompute)").cells, ["3", "37", "0"]);
  assert.deepEqual(row("TTFT p99").cells, ["400 ms", "2.50 s", "–"]);
  assert.equal(row("operator actions refused"), undefined);  // no replay has it
  assert.equal(sweepTable({ baseline: {}, alternative: {} }), null);
});
