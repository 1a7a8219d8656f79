// node --test: the engine page's KV by tenant (static/kvops/tenant_kv.js): the panel's
// rows as staff and a plain user read them, and the "by tenant" colour keys.
import assert from "node:assert/strict";
import test from "node:test";

import { OTHERS, cachedTenantKey, tenantHash, tenantKey, tenantPanelHtml, tenantRows, unnamedTenants, NAMES_ASK_MS } from "../../../static/kvops/tenant_kv.js";

const row = (tenant, gpu, cached = 0, seconds = 0) => ({
  tenant, gpu_blocks: gpu, cpu_blocks: 1, cached_blocks: cached, block_seconds: { gpu: seconds, cpu: 0.5 } });

test("staff read every tenant by user name where known, staff's own requests as staff, and the rest with their count", () => {
  const byTenant = { tenants: [row("aa11", 9, 4, 120), row(null, 3), row("bb22", 2)],
                     other: { ...row(undefined, 5), tenants: 3 } };
  const rows = tenantRows(byTenant, { names: { aa11: "alice" } });
  assert.deepEqual(rows.map((r) => r.label), ["alice", "staff", "bb22", "other (3 tenants)"]);
  assert.deepEqual([rows[0].gpu, rows[0].cpu, rows[0].cached, rows[0].seconds], [9, 1, 4, 120.5]);
  const html = tenantPanelHtml(rows);
  assert.match(html, /<tr data-tenant="aa11"><td>alice<\/td><td class="num">9<\/td><td class="num">1<\/td>\s*<td class="num">4<\/td><td class="num">121<\/td>/);
  assert.match(html, /data-tenant="staff"><td>staff</);
});

test("a plain user reads their own tenant as you and the rest as others", () => {
  const sealed = { tenants: [row("cc33", 4)], other: { ...row(undefined, 7), tenants: null } };
  const rows = tenantRows(sealed, { mine: "cc33" });
  assert.deepEqual(rows.map((r) => [r.label, r.mine]), [["you", true], ["others", false]]);
  assert.match(tenantPanelHtml(rows), /<tr data-tenant="cc33" class="mine"><td>you</);
  assert.equal(tenantPanelHtml(tenantRows({ tenants: [], other: null })).includes("No tenant"), true);
});

test("a plain user whose tenant is not among the engine's top ones reads that it is in others", () => {
  const sealed = { tenants: [], other: { ...row(undefined, 7), tenants: null }, mine_in_other: true };
  const rows = tenantRows(sealed, { mine: "cc33" });
  assert.deepEqual(rows.map((r) => [r.label, r.mine]), [["others, and you: not among the engine's top tenants", false]]);
  assert.equal(tenantRows({ ...sealed, mine_in_other: false }, { mine: "cc33" })[0].label, "others");
});

test("a tenant's requests share one colour key; another tenant's, others' and staff's differ", () => {
  const a1 = tenantKey({ tenant: "aa11" }), a2 = tenantKey({ tenant: "aa11" });
  assert.equal(a1, a2);
  const keys = new Set([a1, tenantKey({ tenant: "bb22" }), tenantKey({ tenant: OTHERS }), tenantKey({ tenant: null })]);
  assert.equal(keys.size, 4);
  assert.equal(tenantKey(undefined), 0);
});

test("the tiers' cached blocks get a column each where some tenant has blocks there", () => {
  const byTenant = { tenants: [{ ...row("aa11", 2), cpu_cached_blocks: 6, disk_cached_blocks: 0 },
                               { ...row("bb22", 1), cpu_cached_blocks: 0, disk_cached_blocks: 0 }], other: null };
  const html = tenantPanelHtml(tenantRows(byTenant));
  assert.match(html, /<th class="num">cached, CPU tier<\/th>/);
  assert.doesNotMatch(html, /disk tier/);
  assert.match(html, /data-tenant="aa11"><td>aa11<\/td><td class="num">2<\/td><td class="num">1<\/td>\s*<td class="num">0<\/td><td class="num">6<\/td>/);
  assert.doesNotMatch(tenantPanelHtml(tenantRows({ tenants: [row("cc33", 1)], other: null })), /tier/);
});

// engine/observe/tenants.py tenant32 of the same labels (tests/engine/test_tenant_kv.py
// pins the same numbers): the engine's key of a cached block and the page's of a request
export const TENANT32 = { A: 3289118412, staff: 1734124753, others: 598067698,
                          "3f2a9c0d11e4b7a8": 3679306680, "é": 513665217 };

test("a tenant's cached blocks and its requests' blocks share a colour key", () => {
  for (const [label, t32] of Object.entries(TENANT32)) assert.equal(tenantHash(label), t32, label);
  assert.equal(tenantHash(null), TENANT32.staff);
  assert.equal(tenantKey({ tenant: "A" }), cachedTenantKey(TENANT32.A));
  assert.equal(tenantKey({ tenant: null }), cachedTenantKey(TENANT32.staff));
  assert.equal(cachedTenantKey(0), 0);
});

test("the map colours a cached block in its tenant's tint by tenant, grey by request or without one", async () => {
  const { BlockMap } = await import("../../../static/kvops/blockmap.js");
  const { Palette } = await import("../../../static/kvops/colors.js");
  const canvas = { getContext: () => ({}) }, pal = new Palette();
  const map = new BlockMap(canvas, canvas, pal);
  map.pool = { n: 3, state: [2, 2, 1], ref_cnt: [0, 0, 1], owner: [0, 0, 1],
               hash32: new Uint32Array(3), tenant32: Uint32Array.from([TENANT32.A, 0, 0]) };
  map.colors(0);
  assert.equal(map.base, pal.cached);  // (by request: cached blocks are grey)
  const requests = new Map([[1, { tenant: "A" }]]);
  map.keyOf = (index) => tenantKey(requests.get(index));
  map.cachedKey = cachedTenantKey;
  map.colors(0);
  const key = cachedTenantKey(TENANT32.A);
  assert.equal(map.base, pal.cachedTint(key, false));
  assert.notEqual(map.base, pal.cached);
  map.colors(1);
  assert.equal(map.base, pal.cached);  // no tenant known
  map.colors(2);
  assert.equal(map.base, pal.ownerColor(key, false));  // A's held block: the same key
});

test("staff's page asks for the names of the labels it has none for, again only after a while", () => {
  const byTenant = { tenants: [row("aa11", 1), row("bb22", 1), row(null, 1), row("cc33", 1)], other: null };
  const asked = new Map([["cc33", 1000]]);
  assert.deepEqual(unnamedTenants(byTenant, { aa11: "alice" }, asked, 2000), ["bb22"]);
  assert.deepEqual(unnamedTenants(byTenant, { aa11: "alice" }, asked, 1000 + NAMES_ASK_MS), ["bb22", "cc33"]);
  assert.deepEqual(unnamedTenants(null, {}, asked, 2000), []);
});
