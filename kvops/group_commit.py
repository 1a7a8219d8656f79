"""Group commit for threads: callers that arrive while a batch is being written wait,
and the next batch takes all of them (one transaction instead of one each).

The first caller to find no batch in progress writes; it keeps writing batches until
none is waiting, then returns. Every caller gets its own result or exception.
"""
from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class _Slot:
    __slots__ = ("item", "done", "result", "error")

    def __init__(self, item) -> None:
        self.item = item
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None


class GroupCommit(Generic[T, R]):
    def __init__(self, write: Callable[[list[T]], list[R]], max_batch: int = 256) -> None:
        self.write = write  # items -> one result per item, in order
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._waiting: list[list[_Slot]] = []  # one list per call
        self._writing = False

    def __call__(self, item: T) -> R:
        return self.many([item])[0]

    def many(self, items: list[T]) -> list[R]:
        """Each item's result, in order. The items of one call are written in the same
        batch (all or none: one error raises for all of them)."""
        slots = [_Slot(item) for item in items]
        if not slots:
            return []
        with self._lock:
            self._waiting.append(slots)
            lead = not self._writing
            self._writing = True
        if lead:
            self._lead()
        for slot in slots:
            slot.done.wait()
        if slots[0].error is not None:
            raise slots[0].error
        return [slot.result for slot in slots]

    def _lead(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    self._writing = False
                    return
                batch = self._waiting.pop(0)  # a call larger than max_batch goes alone
                while self._waiting and len(batch) + len(self._waiting[0]) <= self.max_batch:
                    batch = batch + self._waiting.pop(0)
            try:
                results = self.write([s.item for s in batch])
                for slot, result in zip(batch, results, strict=True):
                    slot.result = result
            except BaseException as e:  # noqa: BLE001  (each caller raises it)
                for slot in batch:
                    slot.error = e
            for slot in batch:
                slot.done.set()
