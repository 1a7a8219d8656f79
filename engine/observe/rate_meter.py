"""Tokens per second over a sliding window of recent steps."""
from __future__ import annotations

import collections


class RateMeter:
    """A rate over the steps of the last `window_s` seconds: 0 when no step ran in that
    window (an idle engine), and 0 while the engine is paused (its last steps' rate is
    not what it does now)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def record(self, now: float, total: int) -> None:
        """Record a running total (monotonic) at time now."""
        self._samples.append((now, total))
        # Keep one sample at or before the window start as the base of the rate.
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rate(self, now: float, paused: bool = False) -> float:
        if paused or len(self._samples) < 2:
            return 0.0
        t0, n0 = self._samples[0]
        t1, n1 = self._samples[-1]
        if now - t1 > self.window_s:  # no step in the window
            return 0.0
        return (n1 - n0) / max(now - t0, 1e-6)
