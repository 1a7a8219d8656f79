"""Policy: who runs this step, how many tokens each, and who is preempted.

Every step is one batch mixing decodes and (chunks of) prefills under a token budget,
vLLM-v1 style: a request simply has tokens whose K/V is not yet computed, and the
scheduler gives it as many as the budget allows. Running requests go first; when one
cannot get blocks, the least important running request not yet scheduled this step is
preempted (recompute: free and requeue; swap: copy to the CPU pool). New requests are
admitted only in steps that preempted nobody for a running request, so a block freed by
preemption is never fought over in the same step.

Fair share (EngineConfig.max_batch_share): a tenant holding its share of max_num_seqs is
passed over at admission while requests of others wait, and under fcfs its requests are
the first preempted; requests without a tenant are exempt, and with nobody else waiting
a tenant may use the whole batch. Token-weighted fairness (EngineConfig.fairness = "vtc",
engine/sched/fairness.py): among the waiting of equal priority, the tenant served the
fewest weighted tokens goes first, and when it cannot get a seat or its blocks, running
requests of tenants served more are preempted for it at the start of the step (which
then admits it before resuming the swapped); the prompt chunks of tenants served more
go after its admission, and while it waits for blocks the tenants holding less of the
pool go on (fairness.py lists these and why); the share cap still applies beside it.
A cache quota (engine/kv/tenant_cache.py): a running request whose next blocks would
take the cached blocks another tenant keeps under its quota makes the room from its own
tenant's newest requests instead (_within_quota); a tenant with nothing running is
admitted past it, as its oldest running request grows past it.
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.errors import (InvalidRequestError, InvalidStateError, NotEnoughBlocksError,
                           UnknownRequestError)
from engine.kv.events import EventLog
from engine.kv.coordinator import KVCacheCoordinator
from engine.kv.export import request_row
from engine.kv.group import OVER_QUOTA, Allocation
from engine.request import Request, RequestStatus
from engine.sched.fairness import VirtualTokenCounter
from engine.sched.output import ScheduledRequest, SchedulerOutput
from engine.sched.queue import WaitingQueue, priority_key


# Most CPU-tier copies made ahead of need per step (KVCacheCoordinator.copy_ahead)
COPY_AHEAD_BLOCKS = 32
# Under vtc, in a step that admits a lighter tenant's request, the heavier tenants'
# prompt chunks take as many tokens as the lighter tenants' prompts, or this share of
# the step's budget if more (Scheduler.schedule)
DEFERRED_FLOOR = 0.125


# What the counts mean, everywhere they are shown (the engine's metrics, a request's row,
# a job's facts and its KV story): a preemption is a request losing its GPU blocks to
# compute them again later (recompute), whoever caused it; a swap out (its blocks copied
# to the CPU pool) and a swap in are counted apart, as swaps, and a move to another
# engine as neither. vLLM's num_preemptions counts the same.
@dataclass(slots=True)
class SchedulerCounters:
    num_preemptions: int = 0  # recompute preemptions, whoever caused them
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    num_prompt_tokens: int = 0  # prefill tokens computed (prompts, recomputed outputs)
    num_generation_tokens: int = 0  # tokens sampled
    # every preemption (recompute) by its reason (events.REASONS): they add up to
    # num_preemptions
    preemptions_by_reason: collections.Counter = field(default_factory=collections.Counter)


@dataclass(slots=True, frozen=True)
class _Lighter:
    """Token-weighted fairness: the waiting request VTC admits next (Scheduler._lighter)."""
    request: Request
    num_new: int  # tokens its admission computes this step
    need: int  # free GPU blocks its admission takes
    served: float  # its tenant's counter
    heavier: frozenset  # the tenants of running requests served more
    # the least important priority value a running request of those may have and still be
    # asked to give way to it (under fcfs, any)
    floor: float


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheCoordinator, max_model_len: int,
                 events: EventLog) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.events = events
        self.requests: dict[str, Request] = {}  # live: waiting, running, swapped
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []  # scheduling order
        self.swapped: collections.deque[Request] = collections.deque()
        self.recently_finished: collections.deque[Request] = collections.deque(maxlen=64)
        self.counters = SchedulerCounters()
        # the tenants' served tokens, with fairness "vtc" (None: arrival order)
        self.vtc = VirtualTokenCounter() if config.fairness == "vtc" else None
        # Parallel sampling: the engine makes a fork's samples (it numbers requests and
        # gives each its own detokenizer and grammar); live forks' sample ids by parent.
        self.make_sample: Callable[[Request, int], Request] | None = None
        self.forks: dict[str, list[str]] = {}
        # running requests taken out of the batch while they are copied to another
        # engine, their blocks kept (engine/transfer/migration.py)
        self.suspended: dict[str, Request] = {}
        self.unforked: list[Request] = []  # live requests with n > 1 not forked yet (few)
        # Live requests not queued yet: their constraint compiles beside the step loop
        # (engine/text/structured.py); the engine queues each once its grammar is ready.
        self.compiling: dict[str, Request] = {}
        # set_limits may lower the batch limits and raise them back, never above these:
        # the worker's threads and a GPU's activation memory were sized for them
        self.limit_caps = {"max_num_seqs": config.max_num_seqs,
                           "max_num_batched_tokens": config.max_num_batched_tokens}

    # --- queue management ----------------------------------------------------------
    def add(self, request: Request, compiling: bool = False) -> None:
        """A new request: queued, or (compiling) live but held until release()."""
        if self.vtc is not None:
            self.vtc.arrive(request.tenant, (r.tenant for r in self.requests.values()))
        self.requests[request.request_id] = request
        if request.fork_pending:
            self.unforked.append(request)
        if compiling:
            self.compiling[request.request_id] = request
        else:
            self.waiting.push(request)

    def release(self, request: Request) -> None:
        """Queue a request whose grammar is ready."""
        del self.compiling[request.request_id]
        self.waiting.push(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def export_rows(self, window_freed: dict[str, int]) -> tuple[list[tuple], dict[str, int]]:
        """Viewers' copy of the requests (engine/kv/export.py): the REQUEST_FIELDS row of
        every live request, then the recently finished ones; and the live ones' indexes
        by id (their tables' keys)."""
        live = self.requests
        rows = [request_row(r, window_freed) for r in live.values()]
        rows += [request_row(r, window_freed) for r in self.recently_finished
                 if r.request_id not in live]
        return rows, {rid: r.index for rid, r in live.items()}

    def has_queued(self) -> bool:
        """Whether any live request could run (every one but those compiling)."""
        return len(self.requests) > len(self.compiling)

    # --- one step ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.scheduling_policy == "priority":
            self.running.sort(key=priority_key)
        lighter = self._lighter() if self.vtc is not None and self.waiting else None
        # (with a cache quota in force the quota decides whose blocks go: a preempted
        # request's blocks would be its tenant's first evicted, its work lost)
        fair = self._room_for_lighter(out, lighter) \
            if lighter is not None and not self.kv.gpu.quota_active else 0
        # (its blocks free now: the heavier tenants' prompt chunks go after the admissions)
        after = lighter if lighter is not None and lighter.need <= self.kv.gpu.num_free \
            else None
        deferred: list[tuple[Request, int]] = []  # (a request, its tokens so far)
        budget = self._schedule_running(out, budget, after, deferred)
        if len(out.preempted) == fair:  # nobody was preempted for a running request
            if fair:  # the room was made for a waiting request: it goes before the swapped
                budget = self._admit_waiting(out, budget, after)
                budget = self._resume_swapped(out, budget)
            else:
                budget = self._resume_swapped(out, budget)
                budget = self._admit_waiting(out, budget, after)
        if after is not None and after.request.status is RequestStatus.RUNNING:
            # it was admitted: the heavier tenants' prompt chunks take no more of the
            # step's tokens than the lighter tenants' prompts took (the step that computes
            # its prompt carries at most as many of theirs), or DEFERRED_FLOOR of the
            # budget, so that they progress beside lighter prompts of a few tokens
            light = sum(s.num_new_tokens for s in out.scheduled
                        if not s.is_decode and s.request.tenant not in after.heavier)
            budget = min(budget, max(light, int(DEFERRED_FLOOR
                                                * self.config.max_num_batched_tokens)))
        if deferred:
            self._schedule_deferred(out, budget, deferred)
        # The CPU tier's copies of reused blocks (none without it); releases the CPU
        # blocks this step's swap-ins read.
        out.swap_out.extend(self.kv.flush_offloads())
        if self.kv.num_groups > 1 and out.scheduled:
            tables = self.kv.group_step_block_ids
            out.group_block_ids = {s.request.request_id: tables(s.request.request_id)
                                   for s in out.scheduled}
        if self.kv.cpu_tier and out.scheduled:  # (a step that runs makes the copies)
            out.copy_ahead = self.kv.copy_ahead(
                self.config.max_num_batched_tokens // self.kv.block_size
                + self.config.max_num_seqs, COPY_AHEAD_BLOCKS)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          after: _Lighter | None = None, deferred: list | None = None) -> int:
        """after: VTC's next admission, after which the prompt chunks of the running
        requests of tenants served more go (they are put in `deferred`): so that a light
        tenant's prompt is not split over the steps a heavy tenant's long prompts fill,
        nor the blocks it needs taken by them."""
        # Every running request passes here every step: names are bound once, and the
        # ScheduledRequest is built inline (see _add_scheduled).
        running, allocate, step_ids = self.running, self.kv.allocate_more, \
            self.kv.step_block_ids
        scheduled = out.scheduled
        quota = self.kv.gpu.quota_active
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            start = request.num_computed_tokens
            if request.num_pending and self._ends_with_pending(request):
                i += 1  # its pending token is its last: it ends when that is applied
                continue
            num_tokens = len(request.all_token_ids) + request.num_pending \
                - (1 if request.fork_pending else 0)
            num_new = min(num_tokens - start, budget)
            if after is not None and num_new > 1 and request.tenant in after.heavier \
                    and request.priority >= after.floor:
                deferred.append((request, num_tokens))
                i += 1
                continue
            alloc = allocate(request, num_new, quota=quota)
            if alloc is OVER_QUOTA:
                alloc = self._within_quota(request, num_new, i, out)
                if request.status is not RequestStatus.RUNNING:
                    continue  # it gave way itself; index i now holds the next
            while alloc is None:
                # Preempt the least important request not yet scheduled (the last one);
                # if that is this request, it gives way itself.
                victim = running[-1] if self.share_cap is None and self.vtc is None \
                    else self._victim(i)
                self._preempt(victim, out, request, num_new)
                if victim is request:
                    break
                alloc = allocate(request, num_new)
            if alloc is None:
                continue  # `request` was removed from running; index i now holds the next
            if alloc.copies:
                out.copies.extend(alloc.copies)
            scheduled.append(ScheduledRequest(request, num_new, start,
                                              step_ids(request.request_id),
                                              start + num_new == num_tokens
                                              and not request.fork_pending))
            budget -= num_new
            i += 1
        return budget

    def _within_quota(self, request: Request, num_new: int, at: int,
                      out: SchedulerOutput) -> Allocation | None:
        """A cache quota in force, running[at]'s next blocks would take free cached blocks
        that another tenant keeps under its quota (OVER_QUOTA): its own tenant makes the
        room instead. Its newest requests not yet scheduled this step give way (reason
        "cache_quota", recompute or swap as configured), then, if an older request of its
        tenant runs, it does itself. The tenant's oldest running request is never stopped:
        it takes them (so every tenant progresses, and a request larger than its tenant's
        quota still ends). Returns its allocation (None: it gave way, or, the oldest, found
        the pool short)."""
        allocate, running, tenant = self.kv.allocate_more, self.running, request.tenant
        while True:
            newer = next((r for r in reversed(running[at + 1:]) if r.tenant == tenant), None)
            if newer is None:
                if not any(r.tenant == tenant for r in running[:at]):
                    return allocate(request, num_new)  # the oldest: quota aside
                self._preempt(request, out, request, num_new, reason="cache_quota")
                return None
            self._preempt(newer, out, request, num_new, reason="cache_quota")
            alloc = allocate(request, num_new, quota=True)
            if alloc is not OVER_QUOTA:
                return alloc

    def _ends_with_pending(self, request: Request) -> bool:
        """Whether a request's pending tokens (async scheduling) bring it to its length
        limit, so that it computes nothing more."""
        n = request.num_pending
        return request.num_output_tokens + n >= request.sampling_params.max_tokens \
            or request.num_tokens + n >= self.max_model_len

    def _resume_swapped(self, out: SchedulerOutput, budget: int) -> int:
        reserved = self._reserved() if self.unforked else 0
        # (a cache quota in force: a swapped request of a tenant with requests running
        # comes back only within its quota, as its running requests grow, _within_quota)
        running = {r.tenant for r in self.running} if self.kv.gpu.quota_active else None
        for request in list(self.swapped):
            if request.parked:
                continue
            extra = request.num_seqs - 1
            if len(self.running) + reserved + 1 + extra > self.config.max_num_seqs:
                break
            if running is not None and request.tenant in running and \
                    not self.kv.gpu.within_quota(
                        request.tenant, self.kv.num_cpu_blocks_held(request.request_id)):
                continue
            reserved += extra
            if not self._swap_in(request, out.swap_in):
                break
            if running is not None:
                running.add(request.tenant)
            if budget > 0:
                num_new = min(request.num_tokens - request.num_held_back
                              - request.num_computed_tokens, budget)
                alloc = self.kv.allocate_more(request, num_new) if num_new > 0 else None
                if alloc is not None:
                    self._add_scheduled(out, request, num_new)
                    budget -= num_new
        return budget

    def _reserved(self) -> int:
        """Running slots that requests about to fork will take beyond their own one."""
        running = RequestStatus.RUNNING
        return sum(r.sampling_params.n - 1 for r in self.unforked if r.status is running)

    def _admit_waiting(self, out: SchedulerOutput, budget: int,
                       first: _Lighter | None = None) -> int:
        """Admit waiting requests while seats, blocks and the token budget last; returns
        the budget left. first: VTC's next admission, before which the requests of the
        tenants served more wait this step (unless it cannot be admitted)."""
        if not self.waiting:
            return budget
        reserved = self._reserved()
        held = self._seqs_by_tenant() if self.share_cap is not None else None
        # tenants whose requests wait this step: those over their cache quota whose next
        # request found no room it may take (engine/kv/tenant_cache.py), those holding as
        # much as VTC's pick that waits for blocks, those served more than `first`
        shut: set[str] = set(first.heavier) if first is not None else set()
        # a cache quota in force: the tenants with requests running, whose admissions stay
        # within it (a tenant's first request may take what it needs, as its oldest running
        # request may: so that every tenant progresses, _within_quota)
        active = {r.tenant for r in self.running} if self.kv.gpu.quota_active else None
        while self.waiting and budget > 0 and \
                len(self.running) + reserved < self.config.max_num_seqs:
            waiting = self.waiting if not shut else \
                [r for r in self.waiting if r.tenant not in shut]
            if not waiting:
                break
            request = next(iter(waiting)) if self.vtc is None else \
                self.vtc.pick(waiting, self.config.scheduling_policy)
            if held and not self._within_share(request, held):
                if first is not None and request is first.request:
                    shut -= first.heavier  # it waits for its share: they need not
                    first = None
                    continue
                request = self._next_within_share(held, waiting)
            extra = request.num_seqs - 1
            if len(self.running) + reserved + 1 + extra > self.config.max_num_seqs:
                break  # its samples will all run: wait until there is room for them
            match = self.kv.find_prefix(request)
            request.num_computed_tokens = match.num_computed_tokens
            num_new = min(request.num_tokens - request.num_held_back
                          - request.num_computed_tokens, budget)
            quota = active is not None and request.tenant in active
            alloc = self.kv.allocate_slots(request, num_new, match, quota=quota)
            if alloc is None:
                request.num_computed_tokens = 0
                if first is not None and request is first.request:
                    shut -= first.heavier  # (it waits: they need not)
                if quota and self.kv.gpu.room_for(request.tenant) < self.kv.gpu.num_free:
                    shut.add(request.tenant)  # (its quota, not the pool, stops it)
                    continue
                if self.vtc is not None:
                    # VTC's pick cannot get its blocks: the tenants holding less of the
                    # pool than its own go on meanwhile, in what is free now; the others
                    # wait with it (so its own tenant's ending requests make its room)
                    holding = self._blocks_by_tenant()
                    floor = holding[request.tenant or ""]
                    shut.add(request.tenant)
                    shut.update(r.tenant for r in waiting if holding[r.tenant or ""] >= floor)
                    continue
                break  # head-of-line: later requests wait their turn
            if request is self.waiting.peek():
                self.waiting.pop()
            else:
                self.waiting.remove(request)
            if held is not None and request.tenant is not None:
                held[request.tenant] = held.get(request.tenant, 0) + 1 + extra
            self.kv.record_prefix_query(request, match)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = match.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if active is not None:
                active.add(request.tenant)
            out.copies.extend(alloc.copies)
            if alloc.copies_in:
                out.swap_in.extend(alloc.copies_in)
            if num_new == 0:  # a fork whose prompt but the last token was all cached
                self._fork(request)
                continue
            reserved += extra
            self._add_scheduled(out, request, num_new)
            budget -= num_new
        return budget

    def _lighter(self) -> _Lighter | None:
        """The waiting request VTC admits next, with the tokens its admission computes this
        step and the free GPU blocks it takes (a cached prefix's it revives included);
        None when no running request's tenant was served more than its own (nobody gives
        way to it)."""
        vtc, kv = self.vtc, self.kv
        request = vtc.pick(self.waiting, self.config.scheduling_policy)
        served = vtc.served_of(request.tenant)
        heavier = frozenset(r.tenant for r in self.running if vtc.served_of(r.tenant) > served)
        if not heavier:
            return None
        match = kv.find_prefix(request)
        request.num_computed_tokens = match.num_computed_tokens
        num_new = min(request.num_tokens - request.num_held_back - match.num_computed_tokens,
                      self.config.max_num_batched_tokens)
        need = kv.blocks_to_admit(request, num_new, match)
        request.num_computed_tokens = 0
        floor = request.priority if self.config.scheduling_policy == "priority" \
            else float("-inf")
        return _Lighter(request, num_new, need, served, heavier, floor)

    def _schedule_deferred(self, out: SchedulerOutput, budget: int,
                           deferred: list[tuple[Request, int]]) -> None:
        """The prompt chunks _schedule_running deferred, in its order, with the tokens and
        blocks the admissions left; one that finds no blocks waits for the next step
        (nobody is preempted for it), as does one past its tenant's cache quota, but for
        its tenant's oldest running request, which takes them (as in _within_quota: every
        tenant progresses). None was preempted since: a victim is taken from past the
        request that needs the room, and admissions preempt nobody."""
        quota = self.kv.gpu.quota_active
        for request, num_tokens in deferred:
            if budget <= 0:
                return
            start = request.num_computed_tokens
            num_new = min(num_tokens - start, budget)
            alloc = self.kv.allocate_more(request, num_new, quota=quota)
            if alloc is OVER_QUOTA:
                oldest = next(r for r in self.running if r.tenant == request.tenant)
                alloc = self.kv.allocate_more(request, num_new) if oldest is request else None
            if alloc is None:
                continue
            out.copies.extend(alloc.copies)
            out.scheduled.append(ScheduledRequest(
                request, num_new, start, self.kv.step_block_ids(request.request_id),
                start + num_new == num_tokens and not request.fork_pending))
            budget -= num_new

    def _room_for_lighter(self, out: SchedulerOutput, lighter: _Lighter) -> int:
        """Token-weighted fairness, before the step's running requests are scheduled: when
        the waiting request VTC admits next cannot get a seat or its blocks, preempt
        running requests of tenants served more than its own that also hold more of the
        batch than its own would with it (more blocks for blocks, more seats for a seat;
        so two tenants never preempt each other back and forth), never one more
        important, the newest of the most served tenant first, until it fits. Nobody is
        preempted where those could not make the room. Returns how many were."""
        vtc, kv = self.vtc, self.kv
        request, num_new, need = lighter.request, lighter.num_new, lighter.need
        tenant = request.tenant or ""
        victims = [r for r in self.running
                   if r.tenant in lighter.heavier and r.priority >= lighter.floor]
        if not victims:
            return 0
        seats = len(self.running) + self._reserved() + request.num_seqs \
            - self.config.max_num_seqs
        short = need - kv.gpu.num_free
        if seats <= 0 and short <= 0:
            return 0
        blocks = self._blocks_by_tenant()
        held = collections.Counter(r.tenant or "" for r in self.running)
        blocks[tenant] += need
        held[tenant] += request.num_seqs
        victims.sort(key=lambda r: (vtc.served_of(r.tenant), r.arrival_time, r.index),
                     reverse=True)
        plan, freed, taken = [], 0, 0
        for victim in victims:
            if freed >= short and taken >= seats:
                break
            # (its blocks that another request also holds stay where they are)
            key, n = victim.tenant or "", kv.num_blocks_freed_by(victim.request_id)
            if (short > freed and blocks[key] > blocks[tenant]) or \
                    (seats > taken and held[key] > held[tenant]):
                plan.append(victim)
                freed, taken = freed + n, taken + 1
                blocks[key] -= n
                held[key] -= 1
        if freed < short or taken < seats:
            return 0
        for victim in plan:
            self._preempt(victim, out, request, num_new, reason="fairness", needed=need)
        return len(plan)

    def _blocks_by_tenant(self) -> collections.Counter:
        """The GPU blocks each tenant's running requests hold ("" for those without one),
        a block they share (a tenant's chats' system prompt) counted once."""
        ids: dict[str, list[str]] = collections.defaultdict(list)
        for r in self.running:
            ids[r.tenant or ""].append(r.request_id)
        return collections.Counter({t: self.kv.num_blocks_held_by(rids)
                                    for t, rids in ids.items()})

    # --- fair share ----------------------------------------------------------------------
    @property
    def share_cap(self) -> int | None:
        """The most sequences one tenant may hold while others wait (None: no limit), of
        max_num_seqs as it is now (an operator's set_limits changes it)."""
        if self.config.max_batch_share >= 1.0:
            return None
        return max(1, int(self.config.max_batch_share * self.config.max_num_seqs))

    def _seqs_by_tenant(self) -> dict[str, int]:
        """Sequences each tenant holds in the batch (a request about to fork: its n)."""
        held: dict[str, int] = {}
        for request in self.running:
            if request.tenant is not None:
                held[request.tenant] = held.get(request.tenant, 0) + request.num_seqs
        return held

    def _next_within_share(self, held: dict[str, int], waiting) -> Request:
        """The first waiting request whose tenant stays within its share by running, or,
        if every waiting one would take its tenant past it, the first (nobody else is
        waiting for the room)."""
        for request in waiting:
            if self._within_share(request, held):
                return request
        return next(iter(waiting))

    def _within_share(self, request: Request, held: dict[str, int]) -> bool:
        """A tenant holding nothing may start one request, whatever its n (a fork wider
        than the share would otherwise wait for ever)."""
        tenant = request.tenant
        if tenant is None or not held.get(tenant):
            return True
        return held[tenant] + request.num_seqs <= self.share_cap

    def _victim(self, at: int) -> Request:
        """Whom to preempt so that running[at] gets blocks: the last request not yet
        scheduled this step (running[at:]); under fcfs the last of those whose tenant
        holds more than its share, if any, else, under vtc, the last of those of the
        tenant holding the most GPU blocks (the pool ran out: who holds most of it gives
        way, not the light tenant whose request came last)."""
        running, cap = self.running, self.share_cap
        if self.config.scheduling_policy == "fcfs" and cap is not None:
            held = self._seqs_by_tenant()
            for j in range(len(running) - 1, at - 1, -1):
                tenant = running[j].tenant
                if tenant is not None and held.get(tenant, 0) > cap:
                    return running[j]
        if self.vtc is not None and self.config.scheduling_policy == "fcfs":
            blocks = self._blocks_by_tenant()
            most = max((r.tenant or "" for r in running[at:]), key=blocks.__getitem__)
            for j in range(len(running) - 1, at - 1, -1):
                if (running[j].tenant or "") == most:
                    return running[j]
        return running[-1]

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        out.scheduled.append(ScheduledRequest(
            request, num_new, start, self.kv.step_block_ids(request.request_id),
            start + num_new == len(request.all_token_ids)))  # never for a fork's parent

    # --- after the model ran ---------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance progress, append sampled tokens, finish requests that hit a stop.
        Returns the requests that made progress, in batch order."""
        self.advance(out)
        return self.apply_tokens(out, sampled)

    def advance(self, out: SchedulerOutput) -> None:
        """What a step's forward pass did, before its sampled tokens are known: its
        blocks hold their K/V, its requests' computed tokens move on, a request whose
        prompt but the last token is computed forks, and each request that sampled
        holds a pending token (Request.num_pending) until apply_tokens. With async
        scheduling the next step is scheduled in between."""
        self.kv.mark_computed()
        counters = self.counters
        running = RequestStatus.RUNNING
        for s in out.scheduled:
            request = s.request
            if request.status is not running:
                continue
            is_decode = s.samples and s.num_new_tokens == 1 and request.output_token_ids
            if not is_decode:
                counters.num_prompt_tokens += s.num_new_tokens
                if self.vtc is not None:
                    self.vtc.charge(request.tenant, prompt_tokens=s.num_new_tokens)
            request.num_computed_tokens += s.num_new_tokens
            if s.samples:
                request.num_pending += 1
            elif request.fork_pending and \
                    request.num_computed_tokens == len(request.all_token_ids) - 1:
                self._fork(request)  # its prompt but the last token is computed

    def apply_tokens(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """The step's sampled tokens appended to the requests advance() left them
        pending on (running, or preempted or swapped since by the next step's
        schedule), and the requests that hit a stop finished. A request that ended
        meanwhile drops its token. Returns the requests that made progress, in batch
        order."""
        progressed, finished = [], []
        counters = self.counters
        max_model_len = self.max_model_len
        for s in out.scheduled:
            request = s.request
            if not s.samples or not request.num_pending:
                continue
            request.num_pending -= 1
            if request.status.is_finished:
                continue
            token = sampled[request.request_id]
            request.append_output_token(token)
            counters.num_generation_tokens += 1
            if self.vtc is not None:
                self.vtc.charge(request.tenant, output_tokens=1)
            progressed.append(request)
            params = request.sampling_params  # a stop token, EOS, or the length limit
            if len(request.output_token_ids) > params.min_tokens and (
                    token in params.stop_token_ids
                    or (not params.ignore_eos and token in request.eos_token_ids)) \
                    or (request.grammar is not None and request.grammar.is_terminated()):
                finished.append((request, "stop"))
            elif len(request.output_token_ids) >= params.max_tokens \
                    or len(request.all_token_ids) >= max_model_len:
                finished.append((request, "length"))
        for request, reason in finished:
            self.finish(request, RequestStatus.FINISHED, reason)
        return progressed

    def _fork(self, parent: Request) -> None:
        """Replace a running request with n > 1 by its n samples, in its place in the
        running order. Each gets the parent's blocks (one more reference each) and its
        progress (all but the last prompt token computed), computes that last token
        itself (copying the shared, partly filled block first) and samples on its own."""
        n = parent.sampling_params.n
        samples = [self.make_sample(parent, i) for i in range(n)]
        for sample in samples:
            self.kv.fork(parent, sample)
            sample.num_computed_tokens = parent.num_computed_tokens
            sample.num_cached_tokens = parent.num_cached_tokens
            sample.status = RequestStatus.RUNNING
            self.requests[sample.request_id] = sample
        at = self.running.index(parent)
        self.running[at:at + 1] = samples
        table = self.kv.block_ids(parent.request_id)
        self.kv.free(parent, "forked")
        spent = self.kv.end(parent.request_id)  # (its samples' stories carry it on)
        del self.requests[parent.request_id]
        self.unforked.remove(parent)
        parent.status = RequestStatus.FINISHED
        parent.finish_reason = "forked"
        self.forks[parent.request_id] = [s.request_id for s in samples]
        self.events.emit("Forked", request_id=parent.request_id, block_ids=table,
                         ref_cnts=[b.ref_cnt for b in self.kv.req_to_blocks.get(
                             samples[0].request_id, [])],
                         num_tokens=parent.num_computed_tokens, detail=f"{n} samples",
                         block_seconds=spent)

    def finish(self, request: Request, status: RequestStatus, reason: str) -> None:
        """End a live request (finished or aborted) and release all its blocks."""
        if request.request_id in self.suspended:
            del self.suspended[request.request_id]
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.request_id in self.compiling:
            del self.compiling[request.request_id]
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        self.kv.free(request, reason)
        spent = self.kv.end(request.request_id)
        request.status = status
        request.finish_reason = reason
        request.num_computed_tokens = 0
        del self.requests[request.request_id]
        if request.fork_pending:  # ended before it forked
            self.unforked.remove(request)
        if request.parent_id is not None:  # the fork is over once its last sample is
            siblings = self.forks.get(request.parent_id, ())
            if not any(s in self.requests for s in siblings):
                self.forks.pop(request.parent_id, None)
        self.recently_finished.append(request)
        self.events.emit("Finished", request_id=request.request_id, detail=reason,
                         num_tokens=request.num_tokens, block_seconds=spent)

    # --- preemption and swap -------------------------------------------------------------
    def _preempt(self, victim: Request, out: SchedulerOutput, needy: Request,
                 num_new: int, reason: str | None = None, needed: int | None = None) -> None:
        """Make room for `needy`'s num_new tokens (it may be the victim itself, giving
        way); needed: the free blocks it takes where the caller counted them (a waiting
        request's admission: new blocks and the free cached ones of its prefix it revives)."""
        room = (self.kv.blocks_needed(needy, num_new) if needed is None else needed,
                self.kv.gpu.num_free) if self.events.on else (None, None)
        self.running.remove(victim)
        out.preempted.append(victim.request_id)
        # the reason: a request that ranks higher took the room, or the pool was full
        if reason is None:
            reason = "priority" if self.config.scheduling_policy == "priority" and \
                victim.priority > needy.priority else "kv_full"
        by = needy.request_id if needy is not victim else None
        if self.config.preemption_mode == "swap":
            result = self.kv.swap_out(victim)
            if result is not None:
                out.swap_out.extend(result.mapping)
                self._mark_swapped(victim, result.mapping, parked=False, reason=reason, by=by,
                                   room=room)
                return
        self._preempt_recompute(victim, "out of blocks", reason, by, room)

    def _preempt_recompute(self, victim: Request, detail: str, reason: str,
                           by: str | None, room: tuple = (None, None)) -> None:
        """room: (blocks the request that needed room asked for, free blocks then)."""
        num_blocks = self.kv.num_blocks_held(victim.request_id)
        dropped = victim.num_computed_tokens
        self.kv.free(victim, reason)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.waiting.push_front(victim)
        self.counters.num_preemptions += 1
        self.counters.preemptions_by_reason[reason] += 1
        self.events.emit("Preempted", request_id=victim.request_id, detail=detail,
                         reason=reason, by=by, num_tokens=victim.num_tokens,
                         ref_cnts=[num_blocks], needed_blocks=room[0], free_blocks=room[1],
                         dropped_tokens=dropped)

    def _mark_swapped(self, request: Request, mapping: list[tuple[int, int]], parked: bool,
                      reason: str = "operator", by: str | None = "operator",
                      room: tuple = (None, None)) -> None:
        request.status = RequestStatus.SWAPPED
        request.parked = parked
        request.num_swaps_out += 1
        self.swapped.append(request)
        self.counters.num_swaps_out += 1
        self.events.emit("SwappedOut", request_id=request.request_id,
                         block_ids=[g for g, _ in mapping], pool="gpu",
                         detail="operator" if parked else "out of blocks",
                         reason=reason, by=by, num_tokens=request.num_computed_tokens,
                         needed_blocks=room[0], free_blocks=room[1])

    def _swap_in(self, request: Request, mapping_out: list[tuple[int, int]],
                 by: str | None = None) -> bool:
        """by: the operator who swapped it in (None: the scheduler, blocks having come
        back)."""
        result = self.kv.swap_in(request)
        if result is None:
            return False
        mapping_out.extend(result.mapping)
        self.swapped.remove(request)
        request.status = RequestStatus.RUNNING
        request.parked = False
        self.running.append(request)
        self.counters.num_swaps_in += 1
        self.events.emit("SwappedIn", request_id=request.request_id,
                         reason="operator" if by is not None else None, by=by,
                         block_ids=self.kv.block_ids(request.request_id),
                         num_tokens=request.num_computed_tokens,
                         detail=f"{result.num_hit_blocks} blocks from the prefix cache")
        return True

    # --- operator commands (between steps) ------------------------------------------------
    def get_live(self, request_id: str) -> Request:
        request = self.requests.get(request_id)
        if request is None:
            ended = next((r for r in self.recently_finished if r.request_id == request_id), None)
            if ended is not None and ended.finish_reason == "migrated":
                raise InvalidStateError(f"request {request_id!r} has moved to another engine")
            if ended is not None:
                raise InvalidStateError(f"request {request_id!r} has already finished")
            raise UnknownRequestError(f"no request {request_id!r} on this engine")
        return request

    def _require(self, request: Request, status: RequestStatus, action: str) -> None:
        if request.status != status:
            raise InvalidStateError(
                f"cannot {action} request {request.request_id!r}: it is {request.status.value}, "
                f"not {status.value}")

    def live_requests(self, request_id: str) -> list[Request]:
        """The live request of this id, or the live samples of the forked request of this
        id; [] if none."""
        ids = self.forks.get(request_id, [request_id])
        return [self.requests[i] for i in ids if i in self.requests]

    def abort(self, request_id: str) -> list[Request]:
        """End a request, or every live sample of a forked request (by its id)."""
        ended = self.live_requests(request_id) or [self.get_live(request_id)]
        for request in ended:
            self.finish(request, RequestStatus.ABORTED, "abort")
        return ended

    def preempt(self, request_id: str, by: str = "operator") -> Request:
        """An operator's preemption (by: their name)."""
        request = self.get_live(request_id)
        self._require(request, RequestStatus.RUNNING, "preempt")
        self.running.remove(request)
        self._preempt_recompute(request, "operator", "operator", by)
        return request

    def set_limits(self, max_num_seqs: int | None = None,
                   max_num_batched_tokens: int | None = None) -> dict:
        """Change the batch limits between two steps (an operator's live tuning). Each
        must lie in [1 (16 for the token budget), its value at start]. A lower
        max_num_seqs preempts nobody: admissions wait until the batch is below it."""
        changes = {"max_num_seqs": max_num_seqs,
                   "max_num_batched_tokens": max_num_batched_tokens}
        for name, value in changes.items():
            if value is None:
                continue
            low = 16 if name == "max_num_batched_tokens" else 1
            if isinstance(value, bool) or not isinstance(value, int) or \
                    not low <= value <= self.limit_caps[name]:
                raise InvalidRequestError(
                    f"{name} must be an integer in [{low}, {self.limit_caps[name]}] (its "
                    f"value at start bounds it), got {value!r}")
        for name, value in changes.items():
            if value is not None:
                setattr(self.config, name, value)
        return {"max_num_seqs": self.config.max_num_seqs,
                "max_num_batched_tokens": self.config.max_num_batched_tokens,
                "caps": dict(self.limit_caps)}

    # --- migration (engine/transfer/migration.py) -------------------------------------------------
    def suspend(self, request_id: str) -> Request:
        """Take a running request out of the batch, its blocks kept, while it is copied to
        another engine."""
        request = self.get_live(request_id)
        self._require(request, RequestStatus.RUNNING, "migrate")
        if request.fork_pending:
            raise InvalidStateError(f"request {request_id!r} has not forked into its samples "
                                    "yet (n > 1): it moves once it has")
        self.running.remove(request)
        self.suspended[request_id] = request
        return request

    def resume(self, request_id: str) -> None:
        """The copy failed: the request runs on here."""
        self.running.append(self.suspended.pop(request_id))

    def adopt(self, request: Request) -> None:
        """A request copied from another engine, its blocks in place: it runs."""
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def adopt_fork(self, parent_id: str, sample_ids: list[str]) -> None:
        """Samples copied here together (each adopted already) are one fork again: its
        id names them all (abort, a move on)."""
        if parent_id in self.requests or parent_id in self.forks:
            raise InvalidStateError(f"request {parent_id!r} already exists here")
        strays = [i for i in sample_ids if i not in self.requests]
        if not sample_ids or strays:
            raise InvalidStateError(f"fork {parent_id!r}: its samples must be live here "
                                    f"first ({strays or 'none'} are not)")
        self.forks[parent_id] = list(sample_ids)

    def disown(self, request_id: str, reason: str = "migration") -> Request:
        """Undo adopt(): a request copied here goes back before it ran (its fork could
        not come whole). Its blocks are freed and it leaves no trace: no Finished
        event, not among the recently finished."""
        request = self.get_live(request_id)
        self._require(request, RequestStatus.RUNNING, "give back")
        self.running.remove(request)
        del self.requests[request_id]
        self.kv.free(request, reason)
        self.kv.end(request_id)  # (it leaves no trace)
        return request

    def swap_out(self, request_id: str, by: str = "operator") -> list[tuple[int, int]]:
        """Park a running request in the CPU pool; the caller copies the blocks now."""
        request = self.get_live(request_id)
        self._require(request, RequestStatus.RUNNING, "swap out")
        if self.kv.cpu.num_blocks == 0:
            raise NotEnoughBlocksError("swap space is disabled (num_cpu_blocks=0)")
        result = self.kv.swap_out(request)
        if result is None:
            need = self.kv.num_blocks_held(request_id)
            raise NotEnoughBlocksError(
                f"request {request_id!r} needs {need} CPU blocks, {self.kv.cpu.num_free} free")
        self.running.remove(request)
        self._mark_swapped(request, result.mapping, parked=True, by=by)
        return result.mapping

    def swap_in(self, request_id: str, by: str = "operator") -> list[tuple[int, int]]:
        """Bring a swapped request back now (by: the operator's name); the caller copies
        the blocks now."""
        request = self.get_live(request_id)
        self._require(request, RequestStatus.SWAPPED, "swap in")
        if len(self.running) >= self.config.max_num_seqs:
            raise InvalidStateError(
                f"the running batch is full ({self.config.max_num_seqs} requests); try later")
        mapping: list[tuple[int, int]] = []
        if not self._swap_in(request, mapping, by):
            need = self.kv.num_cpu_blocks_held(request_id)
            raise NotEnoughBlocksError(
                f"request {request_id!r} needs up to {need} GPU blocks, {self.kv.gpu.num_free} free")
        return mapping
