// Tier health, from the metrics samples the engine page has seen (the stored history,
// then live): a tier of the prefix cache that stores blocks and serves none costs copies
// (and disk writes) for nothing, and a disk block that failed its checksum says the
// disk or its files may be going bad. The shipped Prometheus rules
// (deploy/prometheus/alerts.yml) warn on the same over an hour; the page judges the
// minutes it has.
import { num } from "./format.js";

export const WINDOW_S = 600;  // how far back the samples are judged
export const MIN_SPAN_S = 120;  // no judgement before the samples span this much

// Each tier: what it stored (bytes copied to it) and served (prompt tokens), read from
// one sample. A tier is judged on the samples that carry its counters (the disk's are
// there only when the engine has a disk tier; the CPU tier's stay at 0 without one).
const TIERS = [
  {
    tier: "cpu",
    has: (s) => s.cpu_cache_copy_out_bytes !== undefined && s.cpu_prefix_cache_hits !== undefined,
    stored: (s) => s.cpu_cache_copy_out_bytes,
    // the CPU tier's own hits (blocks the disk read back through it are the disk's)
    served: (s) => s.cpu_prefix_cache_hits,
    text: (minutes) => `the CPU tier stored blocks for ${minutes} min and served none: the traffic `
      + "does not come back to its prefixes within the tier's size (a larger tier, or none)",
  },
  {
    tier: "disk",
    has: (s) => s.disk_cache_write_bytes !== undefined && s.disk_prefix_cache_hits !== undefined,
    stored: (s) => s.disk_cache_write_bytes,
    served: (s) => s.disk_prefix_cache_hits,
    text: (minutes) => `the disk tier stored blocks for ${minutes} min and served none: a higher `
      + "KVOPS_ENGINE_DISK_CACHE_MIN_HITS writes fewer, a larger budget keeps them until they come back",
  },
];

// How much a counter grew along the samples. A counter that went down started again
// from zero (the engine restarted): what it counts since then is its new value.
function growth(samples, read) {
  let total = 0;
  for (let i = 1; i < samples.length; i++) {
    const before = read(samples[i - 1]), now = read(samples[i]);
    total += now >= before ? now - before : now;
  }
  return total;
}

// The samples of the last `windowS` seconds before the newest: from the last one at or
// before the window's start (the oldest when none is that old).
function lastWindow(samples, windowS) {
  const since = samples[samples.length - 1].ts - windowS;
  let start = 0;
  while (start + 1 < samples.length && samples[start + 1].ts <= since) start++;
  return samples.slice(start);
}

// The warnings for `samples` ({ts: Unix seconds, ...metrics}, oldest first), each
// {tier: "cpu" | "disk", kind: "never-served" | "checksum" | "write-failed", text}.
export function tierWarnings(samples, { windowS = WINDOW_S, minSpanS = MIN_SPAN_S } = {}) {
  const warnings = [];
  for (const t of TIERS) {
    const own = samples.filter(t.has);
    if (own.length < 2) continue;
    const window = lastWindow(own, windowS);
    const span = window[window.length - 1].ts - window[0].ts;
    if (span < minSpanS) continue;
    if (growth(window, t.stored) > 0 && growth(window, t.served) === 0) {
      warnings.push({ tier: t.tier, kind: "never-served", text: t.text(Math.round(span / 60)) });
    }
  }
  const failures = samples.length ? samples[samples.length - 1].disk_cache_checksum_failures ?? 0 : 0;
  if (failures > 0) {
    const blocks = failures === 1 ? "1 block failed its checksum" : `${num(failures)} blocks failed their checksum`;
    warnings.push({ tier: "disk", kind: "checksum",
                    text: `disk tier: ${blocks} (misses, deleted): the disk or its files may be going bad` });
  }
  // writes failing now (a full disk): the newest sample's error, gone once one succeeds
  const writeError = samples.length ? samples[samples.length - 1].disk_cache_write_error : null;
  if (writeError) {
    warnings.push({ tier: "disk", kind: "write-failed",
                    text: `disk tier: its writes fail (${writeError}): it stores no new blocks and serves those `
                      + "it holds, and the engine serves on; free space under its folder or lower "
                      + "KVOPS_ENGINE_DISK_CACHE_BYTES" });
  }
  return warnings;
}
