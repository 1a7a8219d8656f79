// The disk tier of the prefix cache (engine/kv/tiers/disk.py) as the engine page shows it:
// counts and a hit share, not a block map, as it may hold millions of blocks. Read from
// the engine's config (disk_cache_bytes: the budget, 0 without a tier; its folder is
// staff's) and its metrics (the disk_* counters, present only when the engine has a
// disk tier).
import { byteSize, num, pct } from "./format.js";

export function hasDiskTier(config) {
  return Boolean(config?.disk_cache_bytes);
}

// The share of all queried prompt tokens that came from disk (null before any query).
// Disk hits are the disk's own, never in cpu_prefix_cache_hits (below the CPU tier too,
// where they reach the GPU through it): this share adds to the CPU tier's.
export function diskHitShare(metrics) {
  const m = metrics || {};
  return m.prefix_cache_queries ? (m.disk_prefix_cache_hits ?? 0) / m.prefix_cache_queries : null;
}

// "1,260 blocks, 47 KiB of 10 GiB"
export function diskTierCaption(metrics, config) {
  const m = metrics || {};
  const blocks = m.num_disk_cached_blocks;
  return `${num(blocks)} block${blocks === 1 ? "" : "s"}, ${byteSize(m.disk_cache_bytes_used)} `
    + `of ${byteSize(config?.disk_cache_bytes)}`;
}

// The panel's figures, in order: {key, label, text, title}. `key` names the figure for
// the page's markup (data-figure) and its tests.
export function diskTierFigures(metrics) {
  const m = metrics || {};
  const belowGpu = m.disk_tier_below === "gpu";  // (no CPU tier: straight below the GPU pool)
  return [
    { key: "hit-share", label: "hit share", text: pct(diskHitShare(m)),
      title: "prompt tokens served from disk, of all prompt tokens queried" },
    { key: "read", label: "read", text: byteSize(m.disk_cache_read_bytes),
      title: `${num(m.disk_cache_read_blocks)} blocks read back into ${belowGpu ? "GPU blocks" : "the CPU tier"}` },
    { key: "written", label: "written", text: byteSize(m.disk_cache_write_bytes),
      title: `${num(m.disk_cache_stored_blocks)} blocks written` },
    { key: "checksum", label: "bad checksums", text: num(m.disk_cache_checksum_failures),
      title: "blocks that failed their checksum: misses, deleted" },
  ];
}

// What became of the blocks the pool above (the CPU tier, or the GPU pool) let go:
// written, or why not.
export function diskTierNote(metrics) {
  const m = metrics || {};
  return `${num(m.disk_cache_stored_blocks)} blocks written, ${num(m.disk_cache_read_blocks)} read back; `
    + `${num(m.disk_cache_not_admitted)} not admitted (asked for by too few prompts), `
    + `${num(m.disk_cache_dropped)} dropped (too many waiting to be written), `
    + `${num(m.disk_cache_evicted_blocks)} evicted for room`;
}
