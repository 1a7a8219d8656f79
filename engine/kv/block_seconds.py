"""KV block-seconds: per request, the seconds times blocks it held on each pool (what a
tenant is billed for holding the KV cache, beside the tokens it computed).

Cheap by construction: a request's totals move only when the number of blocks it holds
changes (a layer group's allocation, free, swap, fork or window give-back reports the
change) and at its end, never per step. Between two changes it held the same blocks, so
the interval adds held x (now - last change) to each pool's total: the one formula,
`_accrue`. Blocks are counted in the request's tables over every layer group; a block
shared with another request (a prefix hit, a fork's samples) counts for each holder.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

@dataclass(slots=True)
class _Held:
    gpu: int  # blocks held on the GPU pool now
    cpu: int  # blocks held on the CPU pool now (swapped out)
    since: float  # when the counts last changed (the clock's seconds)
    gpu_s: float = 0.0  # block-seconds on the GPU pool up to `since`
    cpu_s: float = 0.0


class BlockSeconds:
    """The running totals of live requests. Owned by the KV coordinator; its layer groups
    report changes (change), the scheduler ends a request (end)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock  # the event log's: the stories' time source
        self._held: dict[str, _Held] = {}

    def change(self, request_id: str, gpu: int = 0, cpu: int = 0) -> None:
        """The request's held blocks changed by `gpu` and `cpu` blocks (negative: freed)."""
        if not gpu and not cpu:
            return
        held = self._held.get(request_id)
        if held is None:
            held = self._held[request_id] = _Held(0, 0, self.clock())
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
        self._held.pop(request_id, None)
        return spent

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
