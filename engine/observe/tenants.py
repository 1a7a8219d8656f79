"""KV held by tenant: the one place that computes it (metrics' `kv_by_tenant`, which the
engine page, its snapshot and /metrics read).

Per tenant (Request.tenant; None: requests without one, staff's or a library caller's):
the blocks its live requests hold on the GPU and CPU pools (the KV meter's counts,
engine/kv/block_seconds.py), the GPU pool's cached blocks its requests cached
(BlockPool.cached_by_tenant), and its block-seconds by pool over the engine's life.
Bounded: the `top` tenants holding the most blocks, and the rest added up as `other`, so
that the document and the metrics' label set stay small however many tenants there are.
"""
from __future__ import annotations

from engine.kv.block_seconds import TenantKV


def kv_by_tenant(meter: dict[str | None, TenantKV], cached: dict[str | None, int],
                 top: int) -> dict:
    """{"tenants": [row, ...], "other": row with "tenants" (how many) or None}; a row is
    {tenant, gpu_blocks, cpu_blocks, cached_blocks, block_seconds: {gpu, cpu}}, the
    tenants ordered by blocks held and cached, then block-seconds."""
    rows = [_row(tenant, kv, cached.get(tenant, 0)) for tenant, kv in meter.items()]
    rows += [_row(tenant, TenantKV(), n) for tenant, n in cached.items() if tenant not in meter]
    rows = [r for r in rows if _blocks(r) or sum(r["block_seconds"].values())]
    rows.sort(key=lambda r: (-_blocks(r), -sum(r["block_seconds"].values()),
                             r["tenant"] is None, r["tenant"] or ""))
    named, rest = rows[:top], rows[top:]
    return {"tenants": named, "other": added_up(rest) if rest else None}


def _row(tenant: str | None, kv: TenantKV, cached: int) -> dict:
    return {"tenant": tenant, "gpu_blocks": kv.gpu, "cpu_blocks": kv.cpu,
            "cached_blocks": cached, "block_seconds": {"gpu": kv.gpu_s, "cpu": kv.cpu_s}}


def _blocks(row: dict) -> int:
    return row["gpu_blocks"] + row["cpu_blocks"] + row["cached_blocks"]


def added_up(rows: list[dict]) -> dict:
    """Rows (a tenant's, or an `other` row of several) as one `other` row: `tenants`
    counts the tenants in it."""
    return {"tenants": sum(r.get("tenants", 1) for r in rows),
            **{k: sum(r[k] for r in rows) for k in ("gpu_blocks", "cpu_blocks", "cached_blocks")},
            "block_seconds": {pool: sum(r["block_seconds"][pool] for r in rows)
                              for pool in ("gpu", "cpu")}}
