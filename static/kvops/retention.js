// What the prefix cache keeps, as the engine page's Retention control shows and changes
// it (POST /api/engines/<name>/retention/): the GPU pool's eviction policy and the pin
// budget, the share of the pool that pinned prefixes may hold. The form holds the
// budget as a percentage; the API and the engine as a share (0-1). Pure functions:
// node's tests import them.
import { num } from "./format.js";

// The policies the engine knows (engine/kv/block_pool.py EVICTION_POLICIES): what each
// evicts first.
export const EVICTION_POLICIES = {
  lru: "least recently used first",
  slru: "blocks never hit before blocks hit",
  lfu: "least hit first",
  priority: "prefixes of the least important requests first",
};

// The engine's retention now, in the shape of the API's answer: from its metrics (live),
// or its config at start where the metrics lack a field. The budget in blocks is the
// engine's own rounding (LLMEngine.retention: down); null where the pool size is unknown.
export function currentRetention(metrics, config) {
  const m = metrics || {}, c = config || {};
  const pinBudget = m.pin_budget ?? c.pin_budget ?? null;
  return {
    eviction_policy: m.eviction_policy ?? c.eviction_policy ?? null,
    pin_budget: pinBudget,
    pin_budget_blocks: pinBudget !== null && c.num_gpu_blocks != null
      ? Math.floor(pinBudget * c.num_gpu_blocks) : null,
    num_pinned_blocks: m.num_pinned_blocks ?? null,
  };
}

// A share as the form's percentage, to two decimals at most: 0.5 -> "50", 0.125 -> "12.5".
export function budgetPercent(share) {
  if (share === null || share === undefined) return "";
  return String(Number((share * 100).toFixed(2)));
}

// "12 of 256 blocks pinned (budget 50%)": the pinned blocks and the budget in blocks.
export function pinnedText(retention) {
  const blocks = retention.pin_budget_blocks;
  return `${num(retention.num_pinned_blocks)} of ${num(blocks)} block${blocks === 1 ? "" : "s"} pinned `
    + `(budget ${budgetPercent(retention.pin_budget)}%)`;
}

// An answer of the API (its `result`) in a line: "slru (blocks never hit before blocks
// hit), 12 of 256 blocks pinned (budget 50%)".
export function retentionText(result) {
  const what = EVICTION_POLICIES[result.eviction_policy];
  return `${result.eviction_policy}${what ? ` (${what})` : ""}, ${pinnedText(result)}`;
}

// The form filled with the engine's retention: {eviction_policy, percent} as the
// fields hold them (strings).
export function retentionForm(retention) {
  return { eviction_policy: retention.eviction_policy ?? "", percent: budgetPercent(retention.pin_budget) };
}

// The form once the engine's retention changed: a field the operator has left as it
// was last filled (`filled`) takes the engine's new value; one they changed stays, so
// that live updates never undo an edit before it is applied.
export function followedForm(form, filled, retention) {
  const fresh = retentionForm(retention);
  const followed = {};
  for (const key of Object.keys(fresh)) followed[key] = form[key] === filled[key] ? fresh[key] : form[key];
  return followed;
}

// What Apply sends: {body} with only the fields that differ from the engine's current
// retention, or {error} in words when the form is wrong or changes nothing. The budget
// counts as changed when it differs from the engine's as the form shows it, so that a
// budget of 0.12345 left as "12.35" is not sent back rounded.
export function retentionRequest(form, current) {
  const body = {};
  if (form.eviction_policy !== current.eviction_policy) body.eviction_policy = form.eviction_policy;
  const text = String(form.percent ?? "").trim();
  if (text !== "") {
    const percent = Number(text);
    if (!Number.isFinite(percent) || percent < 0 || percent > 100) {
      return { error: `the pin budget is a percentage of the GPU pool, from 0 to 100; got ${text}` };
    }
    const shown = current.pin_budget === null ? null : Number(budgetPercent(current.pin_budget));
    // (12.3 / 100 is 0.12300000000000001 in floating point: the share sent is 0.123)
    if (percent !== shown) body.pin_budget = Number((percent / 100).toPrecision(12));
  }
  if (Object.keys(body).length === 0) {
    return { error: `nothing to change: the engine already evicts by ${current.eviction_policy} `
      + `with a pin budget of ${budgetPercent(current.pin_budget)}%` };
  }
  return { body };
}
