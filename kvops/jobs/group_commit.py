"""Group commit: calls that arrive while a batch is being written wait, and the next
batch takes all of them (one transaction instead of one each). The one helper for the
web's job admissions (kvops/jobs/admission.py, from threads and from the event loop) and the
worker's claims (kvops/tasks.py).

The first caller to find no batch in progress writes (an event-loop caller hands that
to a thread); the writer keeps writing batches until none is waiting. `write(items)`
returns one result per item, in order; a result that is an exception is raised to its
caller alone. If `write` raises for a batch of several calls, each call is written again
alone, so that the one the database refuses fails alone. The items of one call are
written in the same batch, all or none.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class _Call:
    """One caller's items, and how it learns their results."""
    __slots__ = ("items", "results", "error", "_event", "_future", "_loop")

    def __init__(self, items: list, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.items = items
        self.results: list | None = None
        self.error: BaseException | None = None
        self._loop = loop
        self._event = threading.Event() if loop is None else None
        self._future = loop.create_future() if loop is not None else None

    @property
    def abandoned(self) -> bool:
        """Its event-loop caller went away (cancelled): nothing to write for it."""
        return self._future is not None and self._future.done()

    def finish(self, results: list | None, error: BaseException | None) -> None:
        for result in results or ():
            if isinstance(result, BaseException):
                error, results = result, None
                break
        self.results, self.error = results, error
        if self._event is not None:
            self._event.set()
        else:
            self._loop.call_soon_threadsafe(self._settle)

    def _settle(self) -> None:
        if self._future.done():
            return
        if self.error is not None:
            self._future.set_exception(self.error)
        else:
            self._future.set_result(self.results)

    def wait(self) -> list:
        self._event.wait()
        if self.error is not None:
            raise self.error
        return self.results


class GroupCommit(Generic[T, R]):
    def __init__(self, write: Callable[[list[T]], list[R | BaseException]],
                 max_batch: int = 256) -> None:
        self.write = write
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._waiting: list[_Call] = []
        self._writing = False

    def __call__(self, item: T) -> R:
        return self.many([item])[0]

    def many(self, items: list[T]) -> list[R]:
        """Each item's result, in order (from a thread: this one may write the batch)."""
        if not items:
            return []
        call = _Call(list(items))
        if self._enqueue(call):
            self._lead()
        return call.wait()

    async def one(self, item: T) -> R:
        """The item's result, from an event loop: a thread writes the batches."""
        loop = asyncio.get_running_loop()
        call = _Call([item], loop)
        if self._enqueue(call):
            loop.run_in_executor(None, self._lead)
        return (await call._future)[0]

    def _enqueue(self, call: _Call) -> bool:
        """Queue the call; True if the caller must start the writer."""
        with self._lock:
            self._waiting.append(call)
            lead = not self._writing
            self._writing = True
        return lead

    def _lead(self) -> None:
        while True:
            with self._lock:
                batch = [c for c in self._waiting if not c.abandoned]
                if not batch:
                    self._waiting.clear()
                    self._writing = False
                    return
                taken, size = 0, 0  # a call larger than max_batch goes alone
                while taken < len(batch) and (taken == 0 or
                                              size + len(batch[taken].items) <= self.max_batch):
                    size += len(batch[taken].items)
                    taken += 1
                batch, rest = batch[:taken], batch[taken:]
                self._waiting = rest
            self._write(batch)

    def _write(self, batch: list[_Call]) -> None:
        try:
            results = self.write([item for call in batch for item in call.items])
        except BaseException as e:  # noqa: BLE001  (the batch's error)
            if len(batch) > 1:  # each call alone: the one at fault fails alone
                for call in batch:
                    self._write([call])
                return
            batch[0].finish(None, e)
            return
        it = iter(results)
        for call in batch:
            call.finish([next(it) for _ in call.items], None)
