"""Group commit of /v1 jobs: the calls that arrive while one batch is being stored go
in the next, one transaction and one INSERT for all of them.

A burst of N streamed completions used to cost N write transactions (and N more writes
for the task ids) on the web's one database thread; with SQLite, whose writers poll for
the lock with sleeps of up to 100 ms, a burst of 256 took seconds to admit while the
worker's own writes held the lock. Here each call is checked on its own (a bad one gets
its own error), the good ones of a batch are stored together, and each call's
listener is bound inside that transaction, before any task is sent.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from kvops import services
from kvops.models import Job

MAX_BATCH = 256  # jobs in one transaction


@dataclass(slots=True)
class Admission:
    """One call waiting to be stored."""
    new: services.NewJob
    check: Any  # check(new) raises the call's error (its owner's caps are counted as
    # the batch is stored: services.create_jobs)
    bind: Any  # bind(job) inside the transaction
    future: asyncio.Future = field(default=None)


class Admissions:
    """This event loop's queue of calls waiting to be stored."""

    def __init__(self) -> None:
        self.pending: list[Admission] = []
        self.writing = False

    async def admit(self, new: services.NewJob, check, bind) -> Job:
        item = Admission(new, check, bind, asyncio.get_running_loop().create_future())
        self.pending.append(item)
        if not self.writing:
            self.writing = True
            asyncio.get_running_loop().create_task(self._write())
        return await item.future

    async def _write(self) -> None:
        try:
            while self.pending:
                batch, self.pending = self.pending[:MAX_BATCH], self.pending[MAX_BATCH:]
                batch = [a for a in batch if not a.future.done()]  # its caller went away
                try:
                    results = await sync_to_async(_store, thread_sensitive=False)(batch)
                except Exception:  # noqa: BLE001  (one call's row, or the database)
                    # each call alone, so that one the database refuses fails alone
                    results = [await self._store_alone(item) for item in batch]
                for item, result in zip(batch, results):
                    if item.future.done():
                        continue
                    if isinstance(result, BaseException):
                        item.future.set_exception(result)
                    else:
                        item.future.set_result(result)
        finally:
            self.writing = False

    @staticmethod
    async def _store_alone(item: Admission) -> Job | BaseException:
        try:
            return (await sync_to_async(_store, thread_sensitive=False)([item]))[0]
        except Exception as e:  # noqa: BLE001  (this call's error)
            return e


def _store(batch: list[Admission]) -> list[Job | BaseException]:
    """Check each call, store the good ones in one transaction; returns, per call, its
    job or its error."""
    close_old_connections()
    try:
        results: list[Job | BaseException | None] = []
        good: list[Admission] = []
        for item in batch:
            try:
                item.check(item.new)
            except Exception as e:  # noqa: BLE001  (that call's own error, e.g. a 400)
                results.append(e)
                continue
            results.append(None)
            good.append(item)
        if good:
            def bind(stored: list) -> None:
                for item, job in zip(good, stored):
                    if isinstance(job, Job):  # (not one over its owner's cap)
                        item.bind(job)

            stored = iter(services.create_jobs([item.new for item in good], on_stored=bind))
            results = [next(stored) if r is None else r for r in results]
        return results
    finally:
        close_old_connections()


_queues: dict[asyncio.AbstractEventLoop, Admissions] = {}


def get_admissions() -> Admissions:
    """This event loop's queue (created on first use)."""
    loop = asyncio.get_running_loop()
    queue = _queues.get(loop)
    if queue is None:
        queue = _queues[loop] = Admissions()
    return queue
