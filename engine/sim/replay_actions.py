"""Operator actions a replay applies at their simulated times (capacity.replay_paged), so
that it sees what the engine saw: a prefix cache an operator reset is empty after it
in the replay too, a request an operator preempted computes its blocks again.

Each is applied through the engine's own operator method (LLMEngine's, the ones the
engine core's commands call), never by reaching into the scheduler or the KV core. A
request that moved to another engine leaves the replay as a request ends
(`finish_request`, reason "migrated"): the replay does not copy its K/V anywhere.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.llm_engine import LLMEngine

BY = "operator (replayed)"  # who asked, as the replay's KV stories name it

# kind -> (engine, action, the replay's id of the request it acts on) -> None
_APPLY: dict[str, Callable[[LLMEngine, "ReplayAction", str | None], Any]] = {
    "reset": lambda e, a, rid: e.reset_prefix_cache(BY),
    "evict": lambda e, a, rid: e.evict_cached_blocks(a.arguments.get("num_blocks"), BY),
    "pin": lambda e, a, rid: e.pin_prefix(list(a.tokens), **_soft(a.arguments)),
    "unpin": lambda e, a, rid: e.unpin_prefix(list(a.tokens),
                                              soft=bool(a.arguments.get("soft"))),
    "preempt": lambda e, a, rid: e.preempt(rid, BY),
    "swap-out": lambda e, a, rid: e.swap_out(rid, BY),
    "swap-in": lambda e, a, rid: e.swap_in(rid, BY),
    "abort": lambda e, a, rid: e.abort(rid),
    "move-out": lambda e, a, rid: e.finish_request(rid, "migrated"),
    "pause": lambda e, a, rid: e.pause(),
    "resume": lambda e, a, rid: e.resume(),
    "retention": lambda e, a, rid: e.set_retention(a.arguments.get("pin_budget"),
                                                   a.arguments.get("eviction_policy"),
                                                   a.arguments.get("tenant_cache_quota")),
    "tenant": lambda e, a, rid: e.set_tenant(a.arguments.get("tenant"),
                                             a.arguments.get("cache_quota"),
                                             a.arguments.get("weight"),
                                             tuple(a.arguments.get("clear") or ())),
    "set-limits": lambda e, a, rid: e.set_limits(a.arguments.get("max_num_seqs"),
                                                 a.arguments.get("max_num_batched_tokens")),
}
KINDS = tuple(_APPLY)
# the kinds that act on one request of the trace
REQUEST_KINDS = ("preempt", "swap-out", "swap-in", "abort", "move-out")


@dataclass(slots=True, frozen=True)
class ReplayAction:
    # simulated seconds after the trace's start (its first request's arrival); an action
    # before 0 is applied at the start, in order
    at_s: float
    kind: str  # one of KINDS
    request: int | None = None  # REQUEST_KINDS: the index of the trace request acted on
    tokens: tuple[int, ...] = ()  # pin, unpin: the prefix, in the trace's token space
    # evict: num_blocks (None: all); pin: soft, priority, ttl_s; unpin: soft;
    # retention: pin_budget, eviction_policy, tenant_cache_quota; tenant: tenant,
    # cache_quota, weight, clear; set-limits: max_num_seqs, max_num_batched_tokens
    arguments: dict = field(default_factory=dict)
    label: str = ""  # what the engine's operator log called it, for a report

    def __post_init__(self) -> None:
        if self.kind not in _APPLY:
            raise ValueError(f"unknown replay action {self.kind!r}; one of {', '.join(KINDS)}")
        if (self.request is None) == (self.kind in REQUEST_KINDS):
            raise ValueError(f"a {self.kind} action needs a trace request"
                             if self.request is None else
                             f"a {self.kind} action acts on no request")
        if self.kind in ("pin", "unpin") and not self.tokens:
            raise ValueError(f"a {self.kind} action needs the prefix's tokens")


def apply(engine: LLMEngine, action: ReplayAction, request_id: str | None) -> None:
    """Apply one action to the replay's engine between two steps (request_id: the
    replay's id of the request it acts on). Raises the engine's EngineError where the
    engine refuses it: the replay's state then differs from the engine's (a request that
    ended sooner in the replay, a prefix not cached there)."""
    _APPLY[action.kind](engine, action, request_id)


def _soft(arguments: dict) -> dict:
    """A soft pin's arguments, those given (the engine's defaults for the rest); none
    for a hard pin."""
    if not arguments.get("soft"):
        return {}
    return {"soft": True, **{k: arguments[k] for k in ("priority", "ttl_s")
                             if arguments.get(k) is not None}}
