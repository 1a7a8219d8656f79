"""Waiting in tests for a condition, never for a duration: wait_until asks a probe again
and again until its value is what was awaited, and past the timeout fails saying what
was awaited and the last value seen. wait_until_async is the same for a test on an
event loop (its probe may be a coroutine function; the loop runs between tries)."""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

_NOTHING = object()  # (no value seen yet: the probe raised each time)


class WaitTimeout(AssertionError):
    """The awaited condition did not hold within the timeout."""


class _Wait:
    """One wait's bookkeeping: its deadline and the last value or error seen."""

    def __init__(self, what: str, timeout_s: float, poll_s: float,
                 detail: Callable[[], str] | None) -> None:
        if timeout_s <= 0 or poll_s < 0:
            raise ValueError(f"waiting for {what}: timeout_s must be > 0 and poll_s >= 0, "
                             f"not {timeout_s!r} and {poll_s!r}")
        self.what, self.timeout_s, self.detail = what, timeout_s, detail
        self.deadline = time.monotonic() + timeout_s
        self.last: object = _NOTHING

    def give_up_if_late(self) -> None:
        if time.monotonic() < self.deadline:
            return
        last = "nothing (the probe raised each time)" if self.last is _NOTHING \
            else repr(self.last)
        message = f"timed out after {self.timeout_s:g} s waiting for {self.what}; " \
                  f"last seen: {last}"
        if self.detail is not None:
            message += "\n" + self.detail()
        raise WaitTimeout(message)


def wait_until(probe: Callable[[], T], what: str, timeout_s: float = 30.0, *,
               until: Callable[[T], object] = bool, poll_s: float = 0.01,
               errors: tuple[type[Exception], ...] = (),
               check: Callable[[], None] | None = None,
               detail: Callable[[], str] | None = None) -> T:
    """Call `probe` every `poll_s` seconds until `until(value)` holds; return that value.

    what: what is awaited, for the failure's message ("job 3 to finish").
    errors: exceptions of the probe that mean "not yet" (a server still starting); the
        last one is the value seen. Any other exception ends the wait.
    check: called after each try that did not succeed; it raises to stop waiting early
        (a process the condition depends on has exited).
    detail: more to say when the time is up (a log's tail).
    Raises WaitTimeout (an AssertionError) once `timeout_s` has passed.
    """
    wait = _Wait(what, timeout_s, poll_s, detail)
    while True:
        try:
            value = probe()
        except errors as e:
            wait.last = e
        else:
            if until(value):
                return value
            wait.last = value
        if check is not None:
            check()
        wait.give_up_if_late()
        time.sleep(poll_s)


async def wait_until_async(probe: Callable[[], T | Awaitable[T]], what: str,
                           timeout_s: float = 30.0, *,
                           until: Callable[[T], object] = bool, poll_s: float = 0.01,
                           errors: tuple[type[Exception], ...] = ()) -> T:
    """wait_until on an event loop: the probe may return an awaitable (it is awaited),
    and the loop runs other tasks between tries (asyncio.sleep, not time.sleep)."""
    wait = _Wait(what, timeout_s, poll_s, None)
    while True:
        try:
            value = probe()
            if inspect.isawaitable(value):
                value = await value
        except errors as e:
            wait.last = e
        else:
            if until(value):
                return value
            wait.last = value
        wait.give_up_if_late()
        await asyncio.sleep(poll_s)
