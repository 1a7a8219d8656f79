// node --test: the prefix cache's lower tiers as the engine page shows them, without a
// browser: the disk tier's panel (static/kvops/disk_tier.js), sizes in bytes
// (format.js), and the tier health warnings over a window of metrics samples
// (static/kvops/tier_health.js).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import test from "node:test";

import { diskHitShare, diskTierCaption, diskTierFigures, diskTierNote, hasDiskTier } from "../../../static/kvops/disk_tier.js";
import { byteSize } from "../../../static/kvops/format.js";
import { tierWarnings } from "../../../static/kvops/tier_health.js";

const GiB = 2 ** 30;
const DISK = { disk_cache_dir: "/var/cache/kvops", disk_cache_bytes: 10 * GiB };

test("sizes in binary units", () => {
  assert.equal(byteSize(0), "0 B");
  assert.equal(byteSize(1023), "1,023 B");
  assert.equal(byteSize(48_128), "47 KiB");
  assert.equal(byteSize(1.5 * 2 ** 20), "1.5 MiB");
  assert.equal(byteSize(10 * GiB), "10 GiB");
  assert.equal(byteSize(3 * 2 ** 40), "3 TiB");
  assert.equal(byteSize(undefined), "–");
});

test("the disk tier shows only where the engine has one", () => {
  assert.equal(hasDiskTier(DISK), true);
  assert.equal(hasDiskTier({ disk_cache_dir: null, disk_cache_bytes: 0 }), false);
  assert.equal(hasDiskTier({ disk_cache_bytes: 10 * GiB }), true);  // a plain user's config: no folder
  assert.equal(hasDiskTier(undefined), false);
});

test("the panel: blocks and bytes of the budget, the share of prompt tokens served from disk", () => {
  const m = { num_disk_cached_blocks: 1260, disk_cache_bytes_used: 48_128, prefix_cache_queries: 800,
              prefix_cache_hits: 400, cpu_prefix_cache_hits: 300, disk_prefix_cache_hits: 100,
              disk_cache_read_bytes: 1.5 * 2 ** 20, disk_cache_read_blocks: 25, disk_cache_write_bytes: 4096,
              disk_cache_stored_blocks: 64, disk_cache_checksum_failures: 2, disk_cache_not_admitted: 7,
              disk_cache_dropped: 0, disk_cache_evicted_blocks: 3 };
  assert.equal(diskTierCaption(m, DISK), "1,260 blocks, 47 KiB of 10 GiB");
  assert.equal(diskTierCaption({ ...m, num_disk_cached_blocks: 1 }, DISK), "1 block, 47 KiB of 10 GiB");
  assert.equal(diskHitShare(m), 0.125);
  const shown = Object.fromEntries(diskTierFigures(m).map((f) => [f.key, f.text]));
  assert.deepEqual(shown, { "hit-share": "12.5%", read: "1.5 MiB", written: "4 KiB", checksum: "2" });
  assert.equal(diskTierNote(m), "64 blocks written, 25 read back; 7 not admitted (asked for by too few "
    + "prompts), 0 dropped (too many waiting to be written), 3 evicted for room");
});

test("no queries yet: no hit share, and no figure says NaN", () => {
  assert.equal(diskHitShare({ disk_prefix_cache_hits: 0, prefix_cache_queries: 0 }), null);
  for (const f of diskTierFigures({})) assert.equal(f.text, "–", f.key);
  assert.equal(diskTierCaption({}, DISK), "– blocks, – of 10 GiB");
});

// --- tier health ----------------------------------------------------------------------
// Samples every `every` seconds for `seconds`, from t0; `at(t)` gives each one's counters.
function samples(seconds, at, { every = 1, t0 = 1000 } = {}) {
  const out = [];
  for (let t = 0; t <= seconds; t += every) out.push({ ts: t0 + t, ...at(t) });
  return out;
}

// An engine whose CPU tier copies blocks out all the time and whose disk tier writes.
const storing = (t) => ({ cpu_cache_copy_out_bytes: 4096 * t, cpu_prefix_cache_hits: 0,
                          disk_cache_write_bytes: 1024 * t, disk_prefix_cache_hits: 0,
                          disk_cache_checksum_failures: 0 });
const kinds = (warnings) => warnings.map((w) => `${w.tier} ${w.kind}`);

test("a tier that stores and serves none is told only once two minutes of samples exist", () => {
  assert.deepEqual(tierWarnings([]), []);
  assert.deepEqual(tierWarnings(samples(0, storing)), []);
  assert.deepEqual(tierWarnings(samples(119, storing)), []);
  const warnings = tierWarnings(samples(120, storing));
  assert.deepEqual(kinds(warnings), ["cpu never-served", "disk never-served"]);
  assert.match(warnings[0].text, /^the CPU tier stored blocks for 2 min and served none/);
  assert.match(warnings[1].text, /^the disk tier stored blocks for 2 min and served none/);
});

test("the window is the last ten minutes: older hits do not clear it", () => {
  // the CPU tier served once, early; then 11 minutes of storing and nothing served
  const early = (t) => ({ ...storing(t), cpu_prefix_cache_hits: t < 30 ? 0 : 64 });
  const warnings = tierWarnings(samples(30 + 660, early, { every: 5 }));
  assert.deepEqual(kinds(warnings), ["cpu never-served", "disk never-served"]);
  assert.match(warnings[0].text, /stored blocks for 10 min/);
  // ... while that hit is inside the window, the CPU tier is fine
  assert.deepEqual(kinds(tierWarnings(samples(30 + 300, early, { every: 5 }))), ["disk never-served"]);
});

test("no warning where the hits grew, or where nothing was stored", () => {
  const serving = (t) => ({ ...storing(t), cpu_prefix_cache_hits: 16 * t, disk_prefix_cache_hits: 4 * t });
  assert.deepEqual(tierWarnings(samples(300, serving)), []);
  const idle = () => ({ cpu_cache_copy_out_bytes: 8192, cpu_prefix_cache_hits: 0 });
  assert.deepEqual(tierWarnings(samples(300, idle)), []);
});

test("the CPU tier is judged on its own hits, as the engine counts them (the disk's apart)", () => {
  // every hit below the GPU was a block read back from disk through the CPU tier: the
  // engine counts them as the disk's only, and the CPU tier itself served none
  const viaDisk = (t) => ({ ...storing(t), disk_tier_below: "cpu", cpu_prefix_cache_hits: 0,
                            disk_prefix_cache_hits: 4 * t });
  assert.deepEqual(kinds(tierWarnings(samples(300, viaDisk))), ["cpu never-served"]);
  // the CPU tier serving its own, the disk too: neither is warned of
  const both = (t) => ({ ...viaDisk(t), cpu_prefix_cache_hits: 4 * t });
  assert.deepEqual(tierWarnings(samples(300, both)), []);
});

// The cases the shipped alert rules are checked on too (tests/service/test_monitoring.py):
// each counter's growth over the window, from zero.
const CASES = JSON.parse(readFileSync(new URL("./tier_health_cases.json", import.meta.url))).cases;

for (const c of CASES) {
  test(`the page warns as the alert rules do: ${c.name}`, () => {
    const zero = Object.fromEntries(Object.entries(c.counters)
      .map(([k, v]) => [k, typeof v === "number" ? 0 : v]));
    const window = [{ ts: 0, ...zero }, { ts: 3600, ...c.counters }];
    const warned = tierWarnings(window).filter((w) => w.kind === "never-served").map((w) => w.tier);
    assert.deepEqual(warned, c.warn);
  });
}

test("without a disk tier only the CPU tier is judged", () => {
  const cpuOnly = (t) => ({ cpu_cache_copy_out_bytes: 4096 * t, cpu_prefix_cache_hits: 0 });
  assert.deepEqual(kinds(tierWarnings(samples(300, cpuOnly))), ["cpu never-served"]);
});

test("a restart (counters back to zero) is growth from zero, not a fall", () => {
  // hits counted up to 1,000, then the engine restarted and served 50 more
  const restarted = (t) => ({ ...storing(t), cpu_prefix_cache_hits: t < 200 ? 1000 : 50 });
  assert.deepEqual(kinds(tierWarnings(samples(300, restarted))), ["disk never-served"]);
});

test("failed checksums are told with their count, however short the window", () => {
  const bad = (n) => [{ ts: 1, ...storing(1), disk_cache_checksum_failures: n }];
  assert.deepEqual(tierWarnings(bad(0)), []);
  const [one] = tierWarnings(bad(1));
  assert.deepEqual([one.tier, one.kind], ["disk", "checksum"]);
  assert.equal(one.text, "disk tier: 1 block failed its checksum (misses, deleted): the disk or its files may be going bad");
  assert.equal(tierWarnings(bad(3))[0].text,
               "disk tier: 3 blocks failed their checksum (misses, deleted): the disk or its files may be going bad");
});

test("failing writes (a full disk) are told while they last, with the error", () => {
  const writing = (error) => [{ ts: 1, ...storing(1), disk_cache_write_failures: 4,
                                disk_cache_write_error: error }];
  const [full] = tierWarnings(writing("No space left on device"));
  assert.deepEqual([full.tier, full.kind], ["disk", "write-failed"]);
  assert.match(full.text, /^disk tier: its writes fail \(No space left on device\): it stores no new blocks/);
  assert.match(full.text, /KVOPS_ENGINE_DISK_CACHE_BYTES/);
  assert.deepEqual(tierWarnings(writing(null)), []);  // writing again: past failures are no warning
});

test("a disk straight below the GPU: its hits are not the CPU tier's, and the panel says GPU blocks", () => {
  // no CPU tier (nothing copied out, no CPU hits), the disk serving
  const direct = (t) => ({ cpu_cache_copy_out_bytes: 0, cpu_prefix_cache_hits: 0, disk_tier_below: "gpu",
                           disk_cache_write_bytes: 1024 * t, disk_prefix_cache_hits: 4 * t,
                           disk_cache_checksum_failures: 0 });
  assert.deepEqual(tierWarnings(samples(300, direct)), []);
  const figures = diskTierFigures({ disk_tier_below: "gpu", disk_cache_read_blocks: 3, prefix_cache_queries: 10,
                                    disk_prefix_cache_hits: 4 });
  const read = figures.find((f) => f.key === "read");
  assert.match(read.title, /3 blocks read back into GPU blocks/);
  assert.doesNotMatch(figures.find((f) => f.key === "hit-share").title, /CPU tier/);
  const below = diskTierFigures({ disk_tier_below: "cpu", disk_cache_read_blocks: 3 });
  assert.match(below.find((f) => f.key === "read").title, /into the CPU tier/);
  // below the CPU tier too, the disk's hits are its own: not a slice of the CPU tier's
  assert.doesNotMatch(below.find((f) => f.key === "hit-share").title, /CPU tier/);
});
