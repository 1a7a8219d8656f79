"""KV held by tenant: the one place that computes it (metrics' `kv_by_tenant`, which the
engine page, its snapshot and /metrics read).

Per tenant (Request.tenant; None: requests without one, staff's or a library caller's):
the blocks its live requests hold on the GPU and CPU pools (the KV meter's counts,
engine/kv/block_seconds.py), the cached blocks its requests computed on the GPU pool
(BlockPool.cached_by_tenant) and on each tier below it (the CPU tier's and the disk's,
PrefixTier.cached_by_tenant: the disk knows the blocks it wrote since the engine
started), and its block-seconds by pool over the engine's life.
Bounded: the `top` tenants holding the most blocks, and the rest added up as `other`, so
that the document and the metrics' label set stay small however many tenants there are.
"""
from __future__ import annotations

from engine.kv.block_seconds import TenantKV


# The label of requests without a tenant (staff's) wherever tenants are named (the
# metrics' labels, the bill), and every label but a plain viewer's own as that viewer
# reads it (kvops/dashboard/visibility.py)
STAFF_TENANT = "staff"
OTHERS_TENANT = "others"


# A cached block's tenant in the per-block array `tenant32`: FNV-1a (32 bits) of the
# tenant label's UTF-8; 0 for a block of no tenant (staff's requests'). The page
# computes the same of a request's tenant (static/kvops/tenant_kv.js tenantHash), so a
# tenant's cached blocks and its held ones share a colour.
def tenant32(label: str | None) -> int:
    h = 0x811C9DC5
    for byte in (label if label is not None else STAFF_TENANT).encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h or 1  # (0 means nobody)


# The tiers a row counts cached blocks on, and their keys in it
TIER_KEYS = {"cpu": "cpu_cached_blocks", "disk": "disk_cached_blocks"}
BLOCK_KEYS = ("gpu_blocks", "cpu_blocks", "cached_blocks", *TIER_KEYS.values())


def kv_by_tenant(meter: dict[str | None, TenantKV], cached: dict[str | None, int],
                 top: int, tiers: dict[str, dict[str, int]] | None = None) -> dict:
    """{"tenants": [row, ...], "other": row with "tenants" (how many) or None}; a row is
    {tenant, gpu_blocks, cpu_blocks, cached_blocks (the GPU pool's), cpu_cached_blocks,
    disk_cached_blocks, block_seconds: {gpu, cpu}}, the tenants ordered by blocks held
    and cached, then block-seconds. tiers: per tier ("cpu", "disk"), its cached blocks
    per tenant."""
    tiers = tiers or {}
    everyone = {**dict.fromkeys(meter), **dict.fromkeys(cached)}
    for counts in tiers.values():
        everyone.update(dict.fromkeys(counts))
    rows = [_row(tenant, meter.get(tenant) or TenantKV(), cached.get(tenant, 0),
                 {key: tiers.get(tier, {}).get(tenant, 0) for tier, key in TIER_KEYS.items()})
            for tenant in everyone]
    rows = [r for r in rows if _blocks(r) or sum(r["block_seconds"].values())]
    rows.sort(key=lambda r: (-_blocks(r), -sum(r["block_seconds"].values()),
                             r["tenant"] is None, r["tenant"] or ""))
    named, rest = rows[:top], rows[top:]
    return {"tenants": named, "other": added_up(rest) if rest else None}


def _row(tenant: str | None, kv: TenantKV, cached: int, tiered: dict[str, int]) -> dict:
    return {"tenant": tenant, "gpu_blocks": kv.gpu, "cpu_blocks": kv.cpu,
            "cached_blocks": cached, **tiered,
            "block_seconds": {"gpu": kv.gpu_s, "cpu": kv.cpu_s}}


def _blocks(row: dict) -> int:
    return sum(row.get(key, 0) for key in BLOCK_KEYS)


def added_up(rows: list[dict]) -> dict:
    """Rows (a tenant's, or an `other` row of several) as one `other` row: `tenants`
    counts the tenants in it."""
    return {"tenants": sum(r.get("tenants", 1) for r in rows),
            **{k: sum(r.get(k, 0) for r in rows) for k in BLOCK_KEYS},
            "block_seconds": {pool: sum(r["block_seconds"][pool] for r in rows)
                              for pool in ("gpu", "cpu")}}
