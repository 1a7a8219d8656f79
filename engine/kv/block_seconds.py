"""KV block-seconds: per request, the seconds times blocks it held on each pool (what a
tenant is billed for holding the KV cache, beside the tokens it computed).

Cheap by construction: a request's totals move only when the number of blocks it holds
changes (a layer group's allocation, free, swap, fork or window give-back reports the
change) and at its end, never per step. Between two changes it held the same blocks, so
the interval adds held x (now - last change) to each pool's total: the one formula,
`_accrue`. Blocks are counted in the request's tables over every layer group; a block
shared with another request (a prefix hit, a fork's samples) counts for each holder.

Per tenant (Request.tenant, named when a request first holds blocks), the totals of its
ended requests are kept, so that a tenant's block-seconds over the engine's life are its
ended requests' plus its live ones' so far (by_tenant).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

@dataclass(slots=True)
class _Held:
    gpu: int  # blocks held on the GPU pool now
    cpu: int  # blocks held on the CPU pool now (swapped out)
    since: float  # when the counts last changed (the clock's seconds)
    tenant: str | None  # the request's (Request.tenant), for its tenant's total
    gpu_s: float = 0.0  # block-seconds on the GPU pool up to `since`
    cpu_s: float = 0.0


@dataclass(slots=True)
class TenantKV:
    """One tenant's KV, as the meter counts it."""
    gpu: int = 0  # blocks its live requests hold on the GPU pool now (shared: each holder's)
    cpu: int = 0  # on the CPU pool (swapped out)
    gpu_s: float = 0.0  # block-seconds on the GPU pool, ended requests' and live ones'
    cpu_s: float = 0.0


class BlockSeconds:
    """The running totals of live requests. Owned by the KV coordinator; its layer groups
    report changes (change), the scheduler ends a request (end)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock  # the event log's: the stories' time source
        self._held: dict[str, _Held] = {}
        # per tenant (None: requests without one), the block-seconds of its ended requests
        # by pool: one entry per tenant the engine ever served
        self._ended: dict[str | None, dict[str, float]] = {}

    def change(self, request_id: str, gpu: int = 0, cpu: int = 0,
               tenant: str | None = None) -> None:
        """The request's held blocks changed by `gpu` and `cpu` blocks (negative: freed).
        tenant: the request's, named by the change that gives it its first blocks."""
        if not gpu and not cpu:
            return
        held = self._held.get(request_id)
        if held is None:
            held = self._held[request_id] = _Held(0, 0, self.clock(), tenant)
        else:
            _accrue(held, self.clock())
        held.gpu += gpu
        held.cpu += cpu
        if held.gpu < 0 or held.cpu < 0:
            raise RuntimeError(f"invariant: {request_id} holds a negative number of blocks "
                               f"({held.gpu} GPU, {held.cpu} CPU)")

    def spent(self, request_id: str) -> dict[str, float]:
        """Its block-seconds by pool up to now (zeros for a request that held none)."""
        held = self._held.get(request_id)
        if held is None:
            return {"gpu": 0.0, "cpu": 0.0}
        _accrue(held, self.clock())
        return {"gpu": held.gpu_s, "cpu": held.cpu_s}

    def end(self, request_id: str) -> dict[str, float]:
        """Its block-seconds by pool, up to now; the request is forgotten (call once its
        blocks are freed: it ended here, finished, aborted, forked or moved away)."""
        spent = self.spent(request_id)
        held = self._held.pop(request_id, None)
        if held is not None:
            total = self._ended.setdefault(held.tenant, {"gpu": 0.0, "cpu": 0.0})
            total["gpu"] += spent["gpu"]
            total["cpu"] += spent["cpu"]
        return spent

    def by_tenant(self) -> dict[str | None, TenantKV]:
        """Per tenant (None: requests without one): the blocks its live requests hold now,
        and its block-seconds by pool up to now (its ended requests' and its live ones')."""
        now = self.clock()
        out = {tenant: TenantKV(gpu_s=total["gpu"], cpu_s=total["cpu"])
               for tenant, total in self._ended.items()}
        for held in self._held.values():
            _accrue(held, now)
            kv = out.get(held.tenant)
            if kv is None:
                kv = out[held.tenant] = TenantKV()
            kv.gpu += held.gpu
            kv.cpu += held.cpu
            kv.gpu_s += held.gpu_s
            kv.cpu_s += held.cpu_s
        return out

    def held(self) -> dict[str, tuple[int, int]]:
        """The (GPU, CPU) blocks each request is counted as holding now (the coordinator's
        invariants check them against its tables)."""
        return {rid: (h.gpu, h.cpu) for rid, h in self._held.items()}

    def __len__(self) -> int:
        return len(self._held)


def _accrue(held: _Held, now: float) -> None:
    """The blocks held since the last change, for the seconds since then."""
    seconds = now - held.since
    held.gpu_s += held.gpu * seconds
    held.cpu_s += held.cpu * seconds
    held.since = now
