// What-if runs as the engine page shows them (static/kvops/what_if.js): the request
// body from the form, the rows that compare both replays, and both timelines on one
// time axis. No DOM here: tests/dashboard/js/what_if.test.mjs runs it in node.

const NUMBERS = ["minutes", "max_jobs", "num_gpu_blocks", "block_size", "num_cpu_blocks",
                 "max_num_seqs", "max_num_batched_tokens", "step_base_ms", "step_token_ms"];
const FLAGS = ["enable_prefix_caching", "cpu_prefix_cache"];

// values: {field name: the form's string}. Empty fields are left out (the engine's
// value); numbers and on/off flags travel as JSON numbers and booleans. A sweep
// (sweep_lever: a field's name, sweep_values: its values, separated by commas or
// spaces) travels as {sweep: {lever, values}}, each value read as that field's.
export function requestBody(values) {
  const body = {};
  for (const [name, raw] of Object.entries(values)) {
    const text = String(raw ?? "").trim();
    if (text === "" || name === "sweep_lever" || name === "sweep_values") continue;
    const [key, value] = fieldValue(name, text);
    body[key] = value;
  }
  const lever = String(values.sweep_lever ?? "");
  const listed = String(values.sweep_values ?? "").split(/[\s,]+/).filter((v) => v !== "");
  if (lever) {
    body.sweep = { lever: RENAMED[lever] ?? lever,
                   values: listed.map((text) => fieldValue(lever, text)[1]) };
  }
  return body;
}

const RENAMED = { disk_cache_gib: "disk_cache_bytes", pin_budget_percent: "pin_budget",
                  tenant_cache_quota_percent: "tenant_cache_quota" };
const PERCENTS = ["pin_budget_percent", "tenant_cache_quota_percent"];  // (shares as %)

// One form field's value as the API takes it: [API field, value]. Text that is not a
// number stays text, for the API to name (NaN would travel as null: the engine's value).
function fieldValue(name, text) {
  const number = (scale) => (Number.isNaN(Number(text)) ? text : scale(Number(text)));
  let value = text;
  if (name === "disk_cache_gib") value = number((n) => Math.round(n * 2 ** 30));
  else if (PERCENTS.includes(name)) value = number((n) => n / 100);
  else if (NUMBERS.includes(name)) value = number((n) => n);
  else if (FLAGS.includes(name)) value = text === "true" || text === "on";
  return [RENAMED[name] ?? name, value];
}

// What a sweep's form offers to fill in for a lever when its values are empty: every
// choice for a setting with a few, else the engine's value (`current`, a number) halved,
// kept, doubled and quadrupled, each once; "" when there is nothing to suggest.
export function sweepSuggestion(lever, current) {
  const choices = { eviction_policy: "lru, slru, lfu, priority",
                    preemption_mode: "recompute, swap", cpu_prefix_cache: "off, on",
                    enable_prefix_caching: "off, on", pin_budget_percent: "0, 25, 50, 100",
                    tenant_cache_quota_percent: "25, 50, 100", fairness: "share, vtc" };
  if (choices[lever]) return choices[lever];
  const n = Number(current);
  if (!Number.isFinite(n) || n <= 0) return "";
  const integer = lever !== "disk_cache_gib";
  const values = [0.5, 1, 2, 4].map((k) => (integer ? Math.max(1, Math.round(n * k)) : n * k));
  return [...new Set(values)].join(", ");  // (the API refuses a value twice)
}

const fixed = (digits) => (v) => (v == null ? "–" : Number(v).toFixed(digits));
const integer = (v) => (v == null ? "–" : String(Math.round(v)));
const percent = (v) => (v == null ? "–" : `${(100 * v).toFixed(1)}%`);
const secs = (v) => (v == null ? "–" : v < 1 ? `${(1000 * v).toFixed(0)} ms` : `${v.toFixed(2)} s`);
const onOff = (v) => (v == null ? "–" : v ? "on" : "off");
const bytesOrOff = (v) => (v == null ? "–" : !v ? "off"
  : v >= 2 ** 30 ? `${(v / 2 ** 30).toFixed(1)} GiB` : `${(v / 2 ** 20).toFixed(0)} MiB`);

// [label, read(result), format, kind]: kind "ratio" compares in points, "number" in
// percent of the engine's value, null not at all.
const CONFIG_ROWS = [
  ["GPU pool", (r) => r.config, (c) => `${c.num_gpu_blocks} × ${c.block_size} = ${c.pool_tokens} tokens`, null],
  ["CPU pool (blocks)", (r) => r.config.num_cpu_blocks, integer, null],
  ["preemption", (r) => r.config.preemption_mode, String, null],
  ["max_num_seqs", (r) => r.config.max_num_seqs, integer, null],
  ["max_num_batched_tokens", (r) => r.config.max_num_batched_tokens, integer, null],
  ["prefix caching", (r) => r.config.enable_prefix_caching, onOff, null],
  ["CPU prefix tier", (r) => r.config.cpu_prefix_cache, onOff, null],
  ["disk tier", (r) => r.config.disk_cache_bytes, bytesOrOff, null],
  ["eviction policy", (r) => r.config.eviction_policy, String, null],
  ["pin budget", (r) => r.config.pin_budget, percent, null],
  ["tenant cache quota", (r) => r.config.tenant_cache_quota, percent, null],
  ["fairness", (r) => r.config.fairness, String, null],
  ["K/V dtype", (r) => r.config.kv_cache_dtype ?? undefined, String, null],
];
const RESULT_ROWS = [
  ["finish time (simulated)", (r) => r.sim_seconds, secs, "number"],
  ["output tokens per second", (r) => r.output_tokens_per_s, fixed(0), "number"],
  ["KV usage, mean", (r) => r.kv_usage_mean, percent, "ratio"],
  ["KV usage, peak", (r) => r.kv_usage_peak, percent, "ratio"],
  ["KV slots holding tokens", (r) => r.slot_utilisation, percent, "ratio"],
  ["preemptions (recompute)", (r) => r.preemptions, integer, "number"],
  ["swaps out", (r) => r.swaps_out, integer, "number"],
  ["prefix hit rate", (r) => r.prefix_hit_rate, percent, "ratio"],
  ["prefix lookups hit (readmissions too)", (r) => r.prefix_lookup_hit_rate, percent, "ratio"],
  ["  of which on the CPU tier", (r) => r.cpu_tier_hit_rate, percent, "ratio"],
  ["  of which from disk", (r) => r.disk_tier_hit_rate, percent, "ratio"],
  ["prompt tokens computed", (r) => r.prompt_tokens_computed, integer, "number"],
  ["blocks pinned (the engine's pins)", (r) => r.pinned_blocks, integer, "number"],
  ["pins refused (past the budget)", (r) => r.pins_refused, integer, "number"],
  ["operator actions applied", (r) => r.actions_applied, integer, "number"],
  // (refused by the replay's engine: its state then was not the engine's)
  ["operator actions refused", (r) => (r.actions_refused ? r.actions_refused.length : undefined), integer, "number"],
  ["TTFT p50", (r) => r.ttft_p50, secs, "number"],
  ["TTFT p99", (r) => r.ttft_p99, secs, "number"],
  ["queue wait p50", (r) => r.queue_wait_p50, secs, "number"],
  ["queue wait p99", (r) => r.queue_wait_p99, secs, "number"],
  ["peak concurrency", (r) => r.peak_concurrency, integer, "number"],
];

function change(a, b, kind) {
  if (kind === null || a == null || b == null) return "";
  if (kind === "ratio") {
    const points = 100 * (b - a);
    return Math.abs(points) < 0.05 ? "=" : `${points > 0 ? "+" : ""}${points.toFixed(1)} pt`;
  }
  if (a === b) return "=";
  if (a === 0) return b > 0 ? "+" : "−";
  const rel = (100 * (b - a)) / Math.abs(a);
  return `${rel > 0 ? "+" : ""}${rel.toFixed(rel > -10 && rel < 10 ? 1 : 0)}%`;
}

// Rows {label, baseline, alternative, change, section} of a finished run; a setting
// neither configuration has (an engine without a CPU tier) is left out.
export function comparisonRows(run) {
  const rows = [];
  for (const [section, specs] of [["configuration", CONFIG_ROWS], ["results", RESULT_ROWS]]) {
    for (const [label, read, format, kind] of specs) {
      const a = read(run.baseline), b = read(run.alternative);
      if (a === undefined && b === undefined) continue;
      rows.push({ label, section, baseline: format(a), alternative: format(b),
                  change: change(a, b, kind) });
    }
  }
  return rows;
}

// Both runs' timelines (each over its own duration) on one axis of `points` slices from
// 0 to the later finish: {end, baseline: [...], alternative: [...]}, null after a run
// ended. key: "gpu", "cpu" or "waiting".
export function commonTimeline(baseline, alternative, key, points = 200) {
  const last = (tl) => (tl && tl.t.length ? tl.t[tl.t.length - 1] : 0);
  const end = Math.max(last(baseline), last(alternative));
  const sample = (tl) => {
    if (!tl || !tl.t.length) return Array(points).fill(null);
    const width = tl.t[0], stop = last(tl);
    return Array.from({ length: points }, (_, k) => {
      const x = ((k + 1) * end) / points;
      if (x > stop * (1 + 1e-9)) return null;
      return tl[key][Math.min(tl[key].length - 1, Math.max(0, Math.ceil(x / width - 1e-9) - 1))];
    });
  };
  return { end, baseline: sample(baseline), alternative: sample(alternative) };
}

// One line on what was replayed, and what the engine itself recorded for those jobs.
export function traceSummary(trace) {
  if (!trace || !trace.jobs) return "";
  const parts = [
    `Replayed ${trace.jobs} jobs of the last ${trace.minutes} min`
      + (trace.truncated ? ` (the newest ${trace.max_jobs}; older ones left out)` : ""),
    `arrivals over ${trace.span_s.toFixed(1)} s`,
    `${trace.prompt_tokens} prompt and ${trace.output_tokens} output tokens`,
    `${trace.prefix_groups} prefix group${trace.prefix_groups === 1 ? "" : "s"} (from the prompts' ${trace.prefixes_from})`,
  ];
  if (trace.still_running) parts.push(`${trace.still_running} still running (their output so far)`);
  if (trace.warmup_jobs != null) {
    parts.push(trace.warmup_jobs
      ? `a warm start: ${trace.warmup_jobs} earlier job${trace.warmup_jobs === 1 ? "" : "s"} replayed first (in no figure)`
      : "an empty cache at the start (no jobs before the window)");
  }
  if (trace.actions) parts.push(`${trace.actions} operator action${trace.actions === 1 ? "" : "s"} replayed at their times`);
  if (trace.moved_in || trace.moved_out) parts.push(`${trace.moved_in || 0} moved in, ${trace.moved_out || 0} moved away`);
  const skipped = trace.not_replayed || [];
  if (skipped.length) {
    parts.push(`not replayed: ${skipped.map((a) => `${a.action}${a.at == null ? "" : ` at ${Number(a.at).toFixed(1)} s`} (${a.why})`).join("; ")}`);
  }
  const cost = trace.step_cost;
  if (cost) parts.push(stepCostText(cost));
  const rec = trace.recorded || {};
  parts.push(`recorded on the engine: prefix hit rate ${percent(rec.prefix_hit_rate)}, `
             + `${rec.preemptions ?? "–"} preemptions`);
  return parts.join(" · ");
}

// The step cost a replay used, and where it came from: the engine's fit to its own
// steps, the operator's numbers, or the default (an engine with too few steps to fit).
export function stepCostText(cost) {
  const ms = (v) => Number(v).toPrecision(3).replace(/\.?0+$/, "");
  const terms = [`${ms(cost.step_base_ms)} ms`, `${ms(cost.step_token_ms)} ms a prompt token`];
  if (cost.step_decode_seq_ms != null) terms.push(`${ms(cost.step_decode_seq_ms)} ms a decode sequence`);
  if (cost.step_context_token_ms) terms.push(`${ms(cost.step_context_token_ms)} ms a context token`);
  if (cost.step_block_ms) terms.push(`${ms(cost.step_block_ms)} ms a block moved`);
  const from = { engine: "fitted to the engine's steps", operator: "as asked",
                 default: "the default: the engine had too few steps to fit" }[cost.source] || "";
  return `a step: ${terms.join(" + ")}${from ? ` (${from})` : ""}`;
}

const FIDELITY_LABELS = { prefix_hit_rate: ["prefix hit rate", percent],
  prompt_tokens_computed: ["prompt tokens computed", integer], preemptions: ["preemptions", integer],
  ttft_p50: ["TTFT p50", secs], ttft_p99: ["TTFT p99", secs],
  queue_wait_p50: ["queue wait p50", secs], queue_wait_p99: ["queue wait p99", secs] };

// How the replay of the engine's own configuration compares with what the engine
// recorded for the same jobs: {missed, text}. A report whose baseline misses says so
// first, and names the figures that miss.
export function fidelityText(baseline) {
  const f = baseline && baseline.fidelity;
  if (!f || !f.figures) return { missed: false, text: "" };
  const shown = Object.entries(f.figures).map(([key, v]) => {
    const [label, fmt] = FIDELITY_LABELS[key] || [key, String];
    return `${label} ${fmt(v.recorded)} recorded, ${fmt(v.replayed)} replayed`;
  });
  if (f.misses.length) {
    const names = f.misses.map((k) => (FIDELITY_LABELS[k] || [k])[0]).join(", ");
    return { missed: true, text: `The replay of the engine's own configuration misses what it `
      + `recorded (${names}): read the alternative's ${names} with care. ${shown.join(" · ")}` };
  }
  return { missed: false, text: `The replay of the engine's own configuration holds to what it `
    + `recorded: ${shown.join(" · ")}` };
}

const SWEEP_LABELS = { num_gpu_blocks: "GPU blocks", block_size: "block size",
  num_cpu_blocks: "CPU blocks", preemption_mode: "preemption", max_num_seqs: "max_num_seqs",
  max_num_batched_tokens: "max_num_batched_tokens", enable_prefix_caching: "prefix caching",
  cpu_prefix_cache: "CPU prefix tier", disk_cache_bytes: "disk tier",
  eviction_policy: "eviction policy", kv_cache_dtype: "K/V dtype", pin_budget: "pin budget",
  tenant_cache_quota: "tenant cache quota", fairness: "fairness" };

// A swept value as its axis and table show it.
export function sweepValueText(lever, value) {
  if (lever === "disk_cache_bytes") return bytesOrOff(value);
  if (lever === "pin_budget" || lever === "tenant_cache_quota") return percent(value);
  if (typeof value === "boolean") return onOff(value);
  return String(value);
}

// A sweep run's figures against its lever, for the charts: {lever, label, values (the
// axis's labels), hitRate, ttftP50, ttftP99 (one a value), baseline: {hitRate, ttftP50,
// ttftP99} (the engine's configuration, a reference)}; null for a run without a sweep.
export function sweepSeries(run) {
  const sweep = run && run.sweep;
  if (!sweep || !sweep.results || !sweep.results.length) return null;
  const pick = (key) => sweep.results.map((r) => r[key] ?? null);
  const base = run.baseline || {};
  return {
    lever: sweep.lever, label: SWEEP_LABELS[sweep.lever] || sweep.lever,
    values: sweep.results.map((r) => sweepValueText(sweep.lever, r.value)),
    hitRate: pick("prefix_hit_rate"), ttftP50: pick("ttft_p50"), ttftP99: pick("ttft_p99"),
    baseline: { hitRate: base.prefix_hit_rate ?? null, ttftP50: base.ttft_p50 ?? null,
                ttftP99: base.ttft_p99 ?? null },
  };
}

// A sweep run's table: {columns: the engine's configuration, then each value, rows:
// [{label, cells: [text, ...]}]}, the results' rows of the comparison (those no replay
// has left out); null for a run without a sweep.
export function sweepTable(run) {
  const series = sweepSeries(run);
  if (!series) return null;
  const results = [run.baseline, ...run.sweep.results];
  const rows = [];
  for (const [label, read, format] of RESULT_ROWS) {
    const got = results.map((r) => read(r));
    if (got.every((v) => v === undefined)) continue;
    rows.push({ label, cells: got.map((v) => format(v)) });
  }
  return { columns: ["engine's configuration", ...series.values.map((v) => `${series.label} ${v}`)],
           rows };
}
