"""The waiting queue, in FCFS or priority order."""
from __future__ import annotations

import bisect
import collections
from collections.abc import Iterator

from engine.request import Request


class WaitingQueue:
    """FCFS: arrival order, preempted requests go back to the front.
    Priority: ordered by (priority, arrival time); lower priority value runs first, and
    a preempted request keeps its arrival time, so it goes back ahead of newer ones."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fcfs: collections.deque[Request] = collections.deque()
        self._sorted: list[tuple[tuple[int, float, int], Request]] = []

    def __len__(self) -> int:
        return len(self._fcfs) if self.policy == "fcfs" else len(self._sorted)

    def __iter__(self) -> Iterator[Request]:
        if self.policy == "fcfs":
            return iter(self._fcfs)
        return (r for _, r in self._sorted)

    def push(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fcfs.append(request)
        else:
            bisect.insort(self._sorted, (_key(request), request), key=lambda e: e[0])

    def push_front(self, request: Request) -> None:
        """A preempted request: FCFS puts it first; priority puts it in its place."""
        if self.policy == "fcfs":
            self._fcfs.appendleft(request)
        else:
            self.push(request)

    def peek(self) -> Request:
        return self._fcfs[0] if self.policy == "fcfs" else self._sorted[0][1]

    def pop(self) -> Request:
        return self._fcfs.popleft() if self.policy == "fcfs" else self._sorted.pop(0)[1]

    def remove(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fcfs.remove(request)
        else:
            self._sorted = [e for e in self._sorted if e[1] is not request]


def _key(request: Request) -> tuple[int, float, int]:
    return (request.priority, request.arrival_time, request.index)


def priority_key(request: Request) -> tuple[int, float, int]:
    """Sort key of the priority policy: smaller runs first, the largest is preempted."""
    return _key(request)
