// node --test: the engine page's Retention control (static/kvops/retention.js): the
// engine's retention from its metrics or config, the pinned-blocks line, the form
// following live updates without undoing an edit, and what Apply sends; without a browser.
import assert from "node:assert/strict";
import test from "node:test";

import { EVICTION_POLICIES, budgetPercent, currentRetention, followedForm, pinnedText,
         retentionForm, retentionRequest, retentionText } from "../../../static/kvops/retention.js";

const CONFIG = { num_gpu_blocks: 512, eviction_policy: "lru", pin_budget: 0.5 };

// The engine's retention as currentRetention gives it (and the API answers it).
function retention(extra = {}) {
  return { eviction_policy: "lru", pin_budget: 0.5, pin_budget_blocks: 256, num_pinned_blocks: 12, ...extra };
}

test("the four policies the engine knows, each explained", () => {
  assert.deepEqual(Object.keys(EVICTION_POLICIES), ["lru", "slru", "lfu", "priority"]);
  assert.equal(EVICTION_POLICIES.slru, "blocks never hit before blocks hit");
});

test("the retention comes from the live metrics, the config where they lack it", () => {
  const metrics = { eviction_policy: "slru", pin_budget: 0.1, num_pinned_blocks: 3 };
  assert.deepEqual(currentRetention(metrics, CONFIG),
                   { eviction_policy: "slru", pin_budget: 0.1, pin_budget_blocks: 51, num_pinned_blocks: 3 });
  assert.deepEqual(currentRetention({}, CONFIG),
                   { eviction_policy: "lru", pin_budget: 0.5, pin_budget_blocks: 256, num_pinned_blocks: null });
  assert.deepEqual(currentRetention(null, null),
                   { eviction_policy: null, pin_budget: null, pin_budget_blocks: null, num_pinned_blocks: null });
});

test("the budget in blocks is rounded down, as the engine does", () => {
  assert.equal(currentRetention({ pin_budget: 0.1 }, { num_gpu_blocks: 64 }).pin_budget_blocks, 6);
  assert.equal(currentRetention({ pin_budget: 0 }, { num_gpu_blocks: 64 }).pin_budget_blocks, 0);
  assert.equal(currentRetention({ pin_budget: 1 }, { num_gpu_blocks: 64 }).pin_budget_blocks, 64);
});

test("the budget shows as a percentage with at most two decimals", () => {
  assert.equal(budgetPercent(0.5), "50");
  assert.equal(budgetPercent(0.1), "10");
  assert.equal(budgetPercent(0.125), "12.5");
  assert.equal(budgetPercent(0.12345), "12.35");
  assert.equal(budgetPercent(0), "0");
  assert.equal(budgetPercent(null), "");
});

test("the pinned blocks and the budget in a line", () => {
  assert.equal(pinnedText(retention()), "12 of 256 blocks pinned (budget 50%)");
  assert.equal(pinnedText(retention({ pin_budget: 0.25, pin_budget_blocks: 1024, num_pinned_blocks: 1000 })),
               "1,000 of 1,024 blocks pinned (budget 25%)");
  assert.equal(pinnedText(retention({ pin_budget: 0.01, pin_budget_blocks: 1, num_pinned_blocks: 0 })),
               "0 of 1 block pinned (budget 1%)");
  assert.equal(pinnedText(retention({ num_pinned_blocks: null })), "– of 256 blocks pinned (budget 50%)");
});

test("the API's answer in a line", () => {
  assert.equal(retentionText(retention({ eviction_policy: "slru", pin_budget: 0.1, pin_budget_blocks: 51 })),
               "slru (blocks never hit before blocks hit), 12 of 51 blocks pinned (budget 10%)");
});

test("an untouched form follows the engine; a field the operator changed stays", () => {
  const filled = retentionForm(retention());
  assert.deepEqual(filled, { eviction_policy: "lru", percent: "50" });
  const now = retention({ eviction_policy: "lfu", pin_budget: 0.3 });
  assert.deepEqual(followedForm(filled, filled, now), { eviction_policy: "lfu", percent: "30" });
  assert.deepEqual(followedForm({ eviction_policy: "slru", percent: "50" }, filled, now),
                   { eviction_policy: "slru", percent: "30" });
  assert.deepEqual(followedForm({ eviction_policy: "lru", percent: "10" }, filled, now),
                   { eviction_policy: "lfu", percent: "10" });
});

test("Apply sends only what differs from the engine's retention", () => {
  const now = retention();
  assert.deepEqual(retentionRequest({ eviction_policy: "slru", percent: "50" }, now),
                   { body: { eviction_policy: "slru" } });
  assert.deepEqual(retentionRequest({ eviction_policy: "lru", percent: "10" }, now),
                   { body: { pin_budget: 0.1 } });
  assert.deepEqual(retentionRequest({ eviction_policy: "priority", percent: " 0 " }, now),
                   { body: { eviction_policy: "priority", pin_budget: 0 } });
  assert.deepEqual(retentionRequest({ eviction_policy: "slru", percent: "" }, now),
                   { body: { eviction_policy: "slru" } });  // an emptied budget stays as it is
});

test("a budget shown rounded and left alone is not sent back", () => {
  const now = retention({ pin_budget: 0.12345 });
  assert.match(retentionRequest({ eviction_policy: "lru", percent: "12.35" }, now).error, /^nothing to change/);
  assert.deepEqual(retentionRequest({ eviction_policy: "lru", percent: "12.3" }, now), { body: { pin_budget: 0.123 } });
});

test("a budget is sent when the engine's is not known yet", () => {
  const unknown = { eviction_policy: "lru", pin_budget: null, pin_budget_blocks: null, num_pinned_blocks: null };
  assert.deepEqual(retentionRequest({ eviction_policy: "lru", percent: "0" }, unknown), { body: { pin_budget: 0 } });
});

test("a budget outside 0-100, or no change at all, is an error in words", () => {
  const now = retention();
  for (const percent of ["150", "-1", "ten", "1e3"]) {
    assert.equal(retentionRequest({ eviction_policy: "slru", percent }, now).error,
                 `the pin budget is a percentage of the GPU pool, from 0 to 100; got ${percent}`);
  }
  assert.equal(retentionRequest({ eviction_policy: "lru", percent: "50" }, now).error,
               "nothing to change: the engine already evicts by lru with a pin budget of 50%");
});
