// The KV held by tenant (the engine's metrics `kv_by_tenant`, engine/observe/tenants.py):
// the engine page's "KV by tenant" panel, and the tenant each block map cell is coloured
// by in its "by tenant" mode. A plain user's copy names their own tenant only (the rest
// are `other`, and every other request's tenant is "others": kvops/dashboard/visibility.py);
// staff see every label, with the user's name where the service knows it (`names`).
// No DOM here: tests/dashboard/js/tenant_kv.test.mjs runs it in node.
import { blockSeconds, esc, num } from "./format.js";

export const OTHERS = "others";  // visibility.OTHERS: any tenant but a plain viewer's own

// The panel's rows: {key, label, gpu, cpu, cached, cpuCached, diskCached, seconds, mine};
// `mine` is the viewer's tenant label (null for staff).
export function tenantRows(byTenant, { mine = null, names = {} } = {}) {
  if (!byTenant) return [];
  const row = (r, key, label) => ({ key, label, gpu: r.gpu_blocks, cpu: r.cpu_blocks, cached: r.cached_blocks,
                                    cpuCached: r.cpu_cached_blocks ?? 0, diskCached: r.disk_cached_blocks ?? 0,
                                    seconds: r.block_seconds.gpu + r.block_seconds.cpu, mine: key === mine && mine !== null });
  const rows = byTenant.tenants.map((r) => row(r, r.tenant, tenantLabel(r.tenant, { mine, names })));
  const other = byTenant.other;
  if (other) {
    // (mine_in_other: the viewer's tenant is not among the engine's top tenants, so
    // whatever it holds is counted in this row: kvops/dashboard/visibility.py)
    const label = byTenant.mine_in_other ? "others, and you: not among the engine's top tenants"
      : other.tenants == null ? "others" : `other (${num(other.tenants)} tenant${other.tenants === 1 ? "" : "s"})`;
    rows.push(row(other, "other", label));
  }
  return rows;
}

// Labels of the tenants named in `byTenant` that have no name in `names` and were not
// asked for in the last NAMES_ASK_MS (`asked`: label -> when, ms; `now`, ms): staff's
// page asks the service for their users' names.
export const NAMES_ASK_MS = 5000;
export function unnamedTenants(byTenant, names, asked, now) {
  if (!byTenant) return [];
  return byTenant.tenants.map((r) => r.tenant)
    .filter((t) => t && t !== OTHERS && !(t in names) && !(now - (asked.get(t) ?? -Infinity) < NAMES_ASK_MS));
}

// A tenant label as the viewer reads it: "you", the user's name (staff), "staff" for
// requests without a label, "others" for another's in a plain viewer's copy.
export function tenantLabel(tenant, { mine = null, names = {} } = {}) {
  if (mine !== null && tenant === mine) return "you";
  if (tenant === null || tenant === undefined) return "staff";
  if (tenant === OTHERS) return "others";
  return names[tenant] ?? tenant;
}

// The tiers' columns show only where some tenant has blocks on that tier.
export function tenantPanelHtml(rows) {
  if (!rows.length) return `<p class="muted">No tenant holds or has held KV blocks yet.</p>`;
  const tiers = [["cpuCached", "CPU tier"], ["diskCached", "disk tier"]].filter(([k]) => rows.some((r) => r[k]));
  const cells = (r) => `<td>${esc(r.label)}</td><td class="num">${num(r.gpu)}</td><td class="num">${num(r.cpu)}</td>
    <td class="num">${num(r.cached)}</td>${tiers.map(([k]) => `<td class="num">${num(r[k])}</td>`).join("")}<td class="num">${blockSeconds(r.seconds)}</td>`;
  return `<table class="list tenant-kv"><thead><tr><th>tenant</th><th class="num">GPU held</th><th class="num">CPU held</th>
    <th class="num">cached</th>${tiers.map(([, h]) => `<th class="num">cached, ${h}</th>`).join("")}<th class="num">block-seconds</th></tr></thead>
    <tbody>${rows.map((r) => `<tr data-tenant="${esc(r.key ?? "staff")}"${r.mine ? " class=\"mine\"" : ""}>${cells(r)}</tr>`).join("")}</tbody></table>`;
}

// FNV-1a (32 bits) of a tenant label's UTF-8, "staff" for none: the key the engine
// gives a cached block of that tenant (engine/observe/tenants.py tenant32).
export function tenantHash(tenant) {
  let h = 0x811c9dc5;
  for (const byte of new TextEncoder().encode(tenant ?? "staff")) h = Math.imul(h ^ byte, 0x01000193) >>> 0;
  return h || 1;
}

// The colour key of a block owned by request `r` in the "by tenant" mode: a number the
// palette turns into a hue, the same for every request of one tenant (0: no owner).
export function tenantKey(r) {
  return r ? cachedTenantKey(tenantHash(r.tenant)) : 0;
}

// The colour key of a cached block from its tenant32: its tenant's (0: none known).
export function cachedTenantKey(t32) {
  return t32 ? 1 + (t32 % 9973) : 0;
}
