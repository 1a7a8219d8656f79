"""What an engine's operator log says happened to it, as a what-if replay needs it
(kvops/what_if/what_if_trace.py): the hard pins it held at a moment, the requests that
moved away from it, and each action taken on it in a period made a replay action
(engine/sim/replay_actions.py) at its time, or said why it cannot be one.

Only actions the engine carried out (`ok`) count. A move to another engine is replayed
from the job's own record of its stays (what_if_trace: it leaves the replay when it
moved away, and arrives when it moved in); a drain changes routing, which the jobs
already show, and a what-if run changes nothing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from engine.sim.replay_actions import ReplayAction
from kvops.models import OperatorAction

# the log's actions the replay applies (the log's names are the replay's kinds)
REPLAYED = ("reset", "evict", "pin", "unpin", "preempt", "swap-out", "swap-in", "abort",
            "pause", "resume", "retention", "set-limits", "tenant")
ON_REQUESTS = ("preempt", "swap-out", "swap-in", "abort", "migrate")
UNCHANGED = ("drain", "undrain", "what-if")  # change nothing a replay runs
REQUEST_ID = re.compile(r"^job-(\d+)-(\d+)$")  # kvops/jobs/job_store.py's request ids


def active_pins(engine_name: str, until: datetime) -> list[dict]:
    """The hard pins the engine holds at `until`, as the operator log says: each
    successful pin's parameters (prompt or token_ids, cache_salt), less those unpinned
    since, none from before the last reset (which unpins every block)."""
    pins: dict[tuple, dict] = {}
    actions = OperatorAction.objects.filter(engine=engine_name, ok=True, created_at__lte=until,
                                            action__in=("pin", "unpin", "reset")).order_by("id")
    for action in actions:
        params = action.params or {}
        if action.action == "reset":
            pins.clear()
            continue
        if params.get("soft"):  # (a soft pin takes nothing from the budget)
            continue
        key = (params.get("prompt"), tuple(params.get("token_ids") or ()),
               params.get("cache_salt") or "")
        if action.action == "pin":
            pins[key] = params
        else:
            pins.pop(key, None)
    return list(pins.values())


def actions_between(engine_name: str, since: datetime, until: datetime) -> list[OperatorAction]:
    """The actions the engine carried out in (since, until], in the log's order, but
    those that change nothing a replay runs."""
    return list(OperatorAction.objects.filter(
        engine=engine_name, ok=True, created_at__gt=since, created_at__lte=until)
        .exclude(action__in=UNCHANGED).order_by("id"))


def job_of(request_id: str) -> int | None:
    """The job whose attempt this request id is (job-<job id>-<attempt>), None if none."""
    match = REQUEST_ID.match(request_id or "")
    return int(match.group(1)) if match else None


def moves_out(engine_name: str, since: datetime, until: datetime) -> dict[int, datetime]:
    """The jobs whose request moved from this engine to another in (since, until]: job
    id -> when the log has the move (an operator's or a drain's)."""
    moved = {}
    for row in OperatorAction.objects.filter(engine=engine_name, ok=True, action="migrate",
                                             created_at__gt=since, created_at__lte=until):
        job = job_of(row.target)
        if job is not None:
            moved.setdefault(job, row.created_at)
    return moved


@dataclass(slots=True)
class Segment:
    """One stretch of a replay (its warm-up, or its window) as actions find their
    requests in it."""
    name: str  # "warm-up" or "window"
    origin: datetime  # its time 0: its first request's arrival
    requests: dict[str, int]  # the request id each of its jobs last ran with -> its index
    jobs: set[int]  # its jobs' ids


def replay_action(row: OperatorAction, segment: Segment, t0: datetime,
                  tokens: list[int] | None, replayed_jobs: set[int]) -> ReplayAction | dict | None:
    """The row as a replay action in `segment`, or why it cannot be one ({action, at,
    why}, `at` in seconds after the window's start t0), or None when nothing is to be
    done (a move, which the job's stays replay). tokens: a pin's or unpin's prefix in the
    trace's token space (None: it could not be rebuilt)."""
    label = f"{row.action} {row.target}".strip()
    at = (row.created_at - segment.origin).total_seconds()
    params = row.params or {}

    def refused(why: str) -> dict:
        return {"action": label, "at": round((row.created_at - t0).total_seconds(), 3),
                "why": why}

    if row.action in ON_REQUESTS:
        job = job_of(row.target)
        if job is not None and job in replayed_jobs and row.action == "migrate":
            return None
        if job is None or job not in replayed_jobs:
            return refused("its request is not one of the replayed jobs'")
        if job not in segment.jobs:
            return refused(f"job {job} is replayed in the warm-up, which ends before the "
                           f"window starts" if segment.name == "window" else
                           f"job {job} is replayed in the window, after the warm-up")
        if row.target not in segment.requests:
            return refused(f"it acted on an earlier attempt of job {job}, which ran again: "
                           f"the replay runs its last")
        return ReplayAction(at, row.action, request=segment.requests[row.target], label=label)
    if row.action not in REPLAYED:
        return refused(f"the replay does not model a {row.action!r}")
    if row.action in ("pin", "unpin"):
        if not tokens:
            return refused("its prefix cannot be rebuilt among the replayed prompts (token "
                           "ids where the prompts are compared as characters, or a tokenizer "
                           "this process cannot read)")
        return ReplayAction(at, row.action, tokens=tuple(tokens), label=label, arguments={
            k: params[k] for k in ("soft", "priority", "ttl_s") if params.get(k) is not None})
    fields = {"evict": ("num_blocks",),
              "retention": ("pin_budget", "eviction_policy", "tenant_cache_quota"),
              "set-limits": ("max_num_seqs", "max_num_batched_tokens"),
              "tenant": ("tenant", "cache_quota", "weight", "clear")}.get(row.action, ())
    return ReplayAction(at, row.action, label=label,
                        arguments={k: params[k] for k in fields if params.get(k) is not None})
