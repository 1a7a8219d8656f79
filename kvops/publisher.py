"""Keeps the engine's latest KV snapshot in Redis for the REST API (runs on the engine's
loop thread, after steps; rate-limited)."""
from __future__ import annotations

import logging
import time

from kvops import live

log = logging.getLogger(__name__)


class SnapshotPublisher:
    def __init__(self, name: str, interval_s: float = 1.0) -> None:
        self.name = name
        self.interval_s = interval_s
        self._last = 0.0
        self._last_version = -1

    def __call__(self, engine) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        if engine.version == self._last_version:
            return  # nothing changed since the last one
        self._last = now
        self._last_version = engine.version
        try:
            live.store_snapshot(self.name, engine.snapshot(compact=True))
        except Exception as e:
            log.warning("could not store the snapshot of %s: %s", self.name, e)
