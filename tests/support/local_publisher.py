"""An engine's live view published from this process (tests): the KV feed that an engine
core runs (engine/observe/feed.py) runs here, on its own thread, over an LLMEngine the test
drives, and hands its items to an EnginePublisher as a worker's client would."""
from __future__ import annotations

from typing import Any

from engine.observe.feed import KVFeed
from kvops.worker.publisher import EnginePublisher


class LocalPublisher:
    """Call it with the engine after the steps it wants captured (an engine hook)."""

    def __init__(self, name: str, interval_s: float = 0.0) -> None:
        self.feed = KVFeed(name, self._on_item, interval_s=interval_s)
        self.publisher = EnginePublisher(name, source=self)

    def _on_item(self, item: dict) -> None:
        self.publisher.on_item(item)

    # the KVSource the publisher asks (snapshots and block tables for the consumers)
    def ask_kv(self, kind: str, argument: Any, timeout_s: float) -> Any:
        return self.feed.ask_wait(kind, argument, timeout_s)

    def __call__(self, engine) -> None:
        self.feed(engine)

    @property
    def mirror(self):
        return self.feed.mirror

    @property
    def idle(self) -> bool:
        """Every capture taken so far has been made an item and sent."""
        return self.feed.idle and self.publisher.idle

    def close(self, timeout_s: float = 5.0) -> None:
        self.feed.close(timeout_s)
        self.publisher.close(timeout_s)
