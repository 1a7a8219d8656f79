"""Token-weighted fairness between tenants: the virtual token counter (VTC; Sheng et
al., "Fairness in Serving Large Language Models", OSDI '24).

Each tenant's counter is the tokens the engine served it, weighted (a prompt token
computed counts PROMPT_WEIGHT, a token sampled OUTPUT_WEIGHT, as the paper's w_p = 1,
w_q = 2) and divided by the tenant's weight. Among the waiting requests of the most
important priority, the scheduler admits the one of the tenant with the smallest counter
(in arrival order within a tenant), so a tenant sending long prompts waits behind one
sending short ones, not behind its request count. A tenant that had nothing waiting or
running joins at the smallest counter of those that do (the paper's lift), one token
under it (LIFT_UNDER): time spent idle is not credit to spend later in a burst, and a
tie does not put it behind the busy tenant.

The paper's VTC admits in counter order only. Without more, a tenant whose requests
hold the pool delays every other tenant's next request by its requests' whole length,
and a step full of a heavy tenant's prompt chunks delays a light one's prompt by that
step. So the scheduler (engine/sched/scheduler.py) also:
* when the request VTC admits next cannot get a seat in the batch or its blocks,
  preempts running requests of tenants served more than its own and holding more of the
  batch than its own would with it (so two tenants never preempt each other back and
  forth), the newest of the most served tenant first (`_room_for_lighter`): a light
  tenant then waits for one step;
* schedules the prompt chunks of the tenants served more after that admission
  (`_schedule_deferred`), in a step that gives them no more prompt tokens than it gives
  the lighter tenants, or DEFERRED_FLOOR of its budget (so that they progress beside
  prompts of a few tokens): the light tenant's prompt is neither split over steps nor
  slowed by much more than its own tokens;
* while VTC's pick waits for blocks, admits the requests of tenants holding less of
  the pool than its tenant, into what is free (never those holding as much: its own
  tenant's ending requests make its room, and they could keep taking it);
* when the pool runs out under a running request, preempts the newest request of the
  tenant holding the most GPU blocks, not the last admitted (often the light tenant's).
What a tenant holds counts a block its requests share (a chat's system prompt) once.

Requests without a tenant (staff's) count as one tenant of their own, "". The scheduler
charges (after each forward pass) and asks `pick`; this module owns the counters and the
weights.
"""
from __future__ import annotations

from collections.abc import Iterable

from engine.errors import InvalidRequestError
from engine.request import Request

PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0
MAX_WEIGHT = 1000.0
# A tenant back from idle joins this many weighted tokens under the least counter of
# those waiting or running: without it the tie goes to the tenant whose request waited
# longest, the busy one, and the returning tenant's first request waits a step behind it
# (and behind its prompt chunks, which give way only to a tenant served less)
LIFT_UNDER = 1.0


def check_weight(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0.0 < value <= MAX_WEIGHT:
        raise InvalidRequestError(f"weight must be a number in (0, {MAX_WEIGHT:g}], "
                                  f"got {value!r}")
    return float(value)


class VirtualTokenCounter:
    def __init__(self) -> None:
        self.served: dict[str, float] = {}  # weighted tokens served / weight, per tenant
        self.weights: dict[str, float] = {}  # a tenant's weight where it is not 1

    def charge(self, tenant: str | None, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        key = tenant or ""
        cost = PROMPT_WEIGHT * prompt_tokens + OUTPUT_WEIGHT * output_tokens
        self.served[key] = self.served.get(key, 0.0) + cost / self.weights.get(key, 1.0)

    def arrive(self, tenant: str | None, active: Iterable[str | None]) -> None:
        """A request of `tenant` joins the queue; `active`: the tenants of the requests
        already waiting or running. A tenant not among them is lifted to one token under
        their least (LIFT_UNDER): level with them, and first among equals."""
        key = tenant or ""
        others = {t or "" for t in active}
        if key in others or not others:
            return
        floor = min(self.served.get(t, 0.0) for t in others) - LIFT_UNDER
        if self.served.get(key, 0.0) < floor:
            self.served[key] = floor

    def pick(self, waiting: Iterable[Request], scheduling_policy: str) -> Request:
        """The request to admit next: among the waiting requests of the head's
        priority (every one under fcfs), the first of the tenant served least."""
        best, best_served, seen = None, 0.0, set()
        for request in waiting:
            if best is None:
                head_priority = request.priority
            elif scheduling_policy == "priority" and request.priority != head_priority:
                break  # (the queue is in priority order: priorities still win)
            key = request.tenant or ""
            if key in seen:
                continue
            seen.add(key)
            served = self.served_of(key)
            if best is None or served < best_served:
                best, best_served = request, served
        return best

    def served_of(self, tenant: str | None) -> float:
        """A tenant's counter: the weighted tokens served it, over its weight."""
        return self.served.get(tenant or "", 0.0)

    def set_weight(self, tenant: str, weight: float | None) -> None:
        """A tenant's weight (None: back to 1): its counter grows 1/weight as fast."""
        if weight is None:
            self.weights.pop(tenant, None)
        else:
            self.weights[tenant] = check_weight(weight)

    def of(self, tenant: str) -> dict:
        """One tenant's weight and its counter (weighted tokens served / weight)."""
        return {"weight": self.weights.get(tenant, 1.0),
                "served_tokens": round(self.served_of(tenant), 1)}
