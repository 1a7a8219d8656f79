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
        self._waiting: list[_Slot] = []
        self._writing = False

    def __call__(self, item: T) -> R:
        slot = _Slot(item)
        with self._lock:
            self._waiting.append(slot)
            lead = not self._writing
            self._writing = True
        if lead:
            self._lead()
        slot.done.wait()
        if slot.error is not None:
            raise slot.error
        return slot.result

    def _lead(self) -> None:
        while True:
            with self._lock:
                batch = self._waiting[:self.max_batch]
                del self._waiting[:self.max_batch]
                if not batch:
                    self._writing = False
                    return
            try:
                results = self.write([s.item for s in batch])
                for slot, result in zip(batch, results, strict=True):
                    slot.result = result
            except BaseException as e:  # noqa: BLE001  (each caller raises it)
                for slot in batch:
                    slot.error = e
            for slot in batch:
                slot.done.set()
