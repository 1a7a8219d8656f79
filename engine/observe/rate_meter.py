"""Tokens per second over a sliding window."""
from __future__ import annotations

import collections


class RateMeter:
    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def record(self, now: float, total: int) -> None:
        """Record a running total (monotonic) at time now."""
        self._samples.append((now, total))
        # Keep one sample at or before the window start as the base of the rate.
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rate(self, now: float) -> float:
        if len(self._samples) < 2:
            return 0.0
        t0, n0 = self._samples[0]
        _, n1 = self._samples[-1]
        span = max(now - t0, 1e-6)
        return (n1 - n0) / span if now - t0 <= 2 * self.window_s else 0.0
