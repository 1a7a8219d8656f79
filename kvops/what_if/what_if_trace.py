"""An engine's recent jobs as a capacity-simulator trace (engine/sim/trace.py), for what-if
replays (kvops/what_if/what_if.py).

What comes from the stored jobs (those the engine ran, num_prompt_tokens > 0, queued in
the window; the newest `max_jobs` of them):
* arrival: `queued_at`, in seconds after the first job of the trace (when the demand
  arrived; a job queued behind a busy worker counts its wait in the replay too);
* prompt length: `num_prompt_tokens`, as the engine counted them;
* output length: `num_output_tokens` (a job still running: the tokens so far);
* shared prefixes: from the prompts themselves. Each prompt is tokenized with the
  engine's tokenizer (the chat template applied, as routing does; if the model folder
  is not readable here, or the tokenizer fails on a prompt, the prompts' characters are
  compared and lengths scaled to each job's token count) and keyed by its owner's cache
  salt, since salted prompts never share blocks.
  Sorted, neighbours' common prefixes give every pair's (the common prefix of two
  prompts is the least over the neighbours between them), so the replay's prompts are
  built in that order, each taking its predecessor's first shared tokens and random
  tokens after: the same pairs share the same number of tokens as the jobs did, with no
  prompt text kept. A TraceRequest's prefix_group is a run of such prompts sharing at
  least one block of the engine's size, and its prefix_len the most it shares with any
  other job; those describe the trace (and its CSV form) while the replay uses the
  built prompts, which also keep the branches a flat group cannot (conversations that
  share a system prompt and then each their own turns).
What the engine saw beside its jobs (kvops/what_if/what_if_log.py):
* a warm cache: the engine's jobs from as many minutes before the window's first job
  (the newest WARMUP_MAX_JOBS at most) are replayed first, counted in no figure, so
  that the prefixes cached before the window are cached at its start. The engine's
  timeline keyframe at that moment cannot serve: its blocks hold the engine's token
  ids, and the replay's are synthesized; the warm-up is the approximation. Its
  prompts are built with the window's, so they share what the jobs shared.
* the hard pins the engine held when the warm-up starts (`active_pins`: the operator
  log's since the last reset, unpinned ones left out), built into the same token space
  (each shares with the jobs what its text or tokens did), computed and pinned before
  the replay, within its pin budget;
* the operator actions in the warm-up and the window, at their times (replay actions:
  a reset, an eviction, a pin or unpin, a request's preemption, swap or abort, a pause,
  a retention or limits change); those that cannot be replayed are listed in the
  summary's `not_replayed`;
* moves: a job whose request moved away leaves the replay when it did; one that moved
  in arrives when it did, with its prompt (the replay computes it again there: the K/V
  it brought is not modelled) and its whole output.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone

from engine.sim.capacity import WarmUp
from engine.sim.replay_actions import ReplayAction
from engine.sim.replay_stats import percentile
from engine.sim.trace import TraceRequest
from kvops.jobs.job_store import engines_of
from kvops.models import Engine, Job
from kvops.what_if import what_if_log
from kvops.what_if.what_if_log import active_pins
from kvops.intake.prompts import inspector, render_chat
from kvops.routing.tenancy import cache_salt, tenant

log = logging.getLogger(__name__)

MAX_MINUTES = 24 * 60
MAX_JOBS = 20000  # an hour of one engine at up to 5 jobs a second
WARMUP_MAX_JOBS = 1000  # jobs replayed before the window at most (and max_jobs)


@dataclass(slots=True)
class JobTrace:
    requests: list[TraceRequest]  # in arrival order
    prompts: list[list[int]]  # the token ids each request replays (see the module doc)
    job_ids: list[int]  # the job each request comes from
    summary: dict  # what was replayed, and what the engine recorded for the same jobs
    pins: list[list[int]] = field(default_factory=list)  # pinned before the replay
    actions: list[ReplayAction] = field(default_factory=list)  # in the window, its times
    warmup: WarmUp | None = None  # replayed before the window, in no figure


@dataclass(slots=True)
class _Stay:
    """A job's stay on this engine."""
    job: Job
    arrived: datetime  # queued, or moved in
    left: datetime | None  # moved away; None: it ended here


def window(engine_name: str, minutes: int, until: datetime | None = None):
    """The jobs the engine ran that were queued in the `minutes` before `until` (now),
    newest first."""
    until = until or timezone.now()
    return Job.objects.filter(engine=engine_name, num_prompt_tokens__gt=0,
                              queued_at__gt=until - timedelta(minutes=minutes),
                              queued_at__lte=until).order_by("-queued_at", "-id")


def build_trace(engine: Engine, minutes: int, max_jobs: int,
                until: datetime | None = None) -> JobTrace:
    if not 1 <= minutes <= MAX_MINUTES or not 1 <= max_jobs <= MAX_JOBS:
        raise ValueError(f"minutes must be in [1, {MAX_MINUTES}] and max_jobs in [1, {MAX_JOBS}]")
    until = until or timezone.now()
    newest = list(window(engine.name, minutes, until).select_related("owner")[:max_jobs])
    if not newest:
        raise ValueError(f"engine {engine.name} ran no jobs queued in the last {minutes} "
                         f"minutes: there is nothing to replay")
    first = min(job.queued_at for job in newest)
    warm_from = first - timedelta(minutes=minutes)
    moved_away = what_if_log.moves_out(engine.name, warm_from, until)
    stays = _stays(engine.name, newest + _moved_away_jobs(moved_away, first, until, newest),
                   moved_away)
    warm_jobs = list(Job.objects.filter(
        engine=engine.name, num_prompt_tokens__gt=0, queued_at__gt=warm_from,
        queued_at__lte=first).exclude(pk__in=[s.job.pk for s in stays])
        .select_related("owner").order_by("-queued_at", "-id")[:min(max_jobs, WARMUP_MAX_JOBS)])
    warm = _stays(engine.name, warm_jobs + _moved_away_jobs(
        moved_away, warm_from, first, warm_jobs + [s.job for s in stays]), moved_away)
    jobs = [s.job for s in stays]
    everyone = jobs + [s.job for s in warm]
    units, source = _prompt_units(engine.config, everyone)
    lengths = [job.num_prompt_tokens for job in everyone]
    # the pins after the jobs: held before the warm-up, then those pinned or unpinned
    # in it and in the window; their prompts are built beside the jobs'
    logged = what_if_log.actions_between(engine.name, warm_from, until)
    pin_rows = [row for row in logged if row.action in ("pin", "unpin")]
    pin_units = _pin_units(engine.config, active_pins(engine.name, warm_from)
                           + [row.params or {} for row in pin_rows], source)
    built = [u for u in pin_units if u is not None]
    units += [u for u, _ in built]
    lengths += [n for _, n in built]
    order = sorted(range(len(units)), key=lambda i: units[i])
    shared = _shared_with_predecessor(order, units, lengths, source == "characters")
    vocab = int(engine.config.get("vocab_size") or 32000)
    prompts = _build_prompts(order, shared, lengths, vocab)
    groups, prefix_lens = _groups(order, shared, int(engine.config.get("block_size") or 16))
    n, n_warm = len(jobs), len(warm)
    pin_prompts = iter(prompts[n + n_warm:])
    pin_tokens = [next(pin_prompts) if u is not None else None for u in pin_units]
    n_held = len(pin_units) - len(pin_rows)
    pins = [t for t in pin_tokens[:n_held] if t is not None]
    tokens_of = dict(zip((row.pk for row in pin_rows), pin_tokens[n_held:]))
    t0 = stays[0].arrived
    requests = [TraceRequest(arrival_s=(s.arrived - t0).total_seconds(),
                             prompt_len=s.job.num_prompt_tokens,
                             output_len=max(s.job.num_output_tokens, 1),
                             prefix_group=groups[i], prefix_len=prefix_lens[i],
                             tenant=tenant(s.job.owner))
                for i, s in enumerate(stays)]
    not_replayed = [{"action": "pin", "at": None, "why": "held when the replay starts; its "
                     "prefix cannot be rebuilt among the replayed prompts"}
                    for t in pin_tokens[:n_held] if t is None]
    segments = [_segment("window", stays), *([_segment("warm-up", warm)] if warm else [])]
    actions, warm_actions = _actions(logged, segments, t0, tokens_of, not_replayed)
    actions += _departures(stays, segments[0])
    warmup = None
    if warm:
        warm_actions += _departures(warm, segments[1])
        warmup = WarmUp(
            [TraceRequest(arrival_s=(s.arrived - segments[1].origin).total_seconds(),
                          prompt_len=s.job.num_prompt_tokens,
                          output_len=max(s.job.num_output_tokens, 1),
                          tenant=tenant(s.job.owner)) for s in warm],
            prompts[n:n + n_warm], warm_actions, (t0 - segments[1].origin).total_seconds())
    summary = {
        "jobs": len(jobs), "minutes": minutes, "max_jobs": max_jobs,
        "truncated": window(engine.name, minutes, until)[max_jobs:max_jobs + 1].exists(),
        "from": t0.isoformat(), "until": until.isoformat(),
        "span_s": requests[-1].arrival_s,
        "still_running": sum(job.status == Job.Status.RUNNING for job in jobs),
        "prompt_tokens": sum(lengths[:n]),
        "output_tokens": sum(r.output_len for r in requests),
        "prefix_groups": len({g for g in groups[:n] if g is not None}),
        "prefixes_from": source,
        "pins": len(pins),
        # the warm-up: jobs replayed before the window, in no figure
        "warmup_jobs": n_warm, "warmup_minutes": minutes,
        "actions": len(actions) + len(warm_actions or []),
        "moved_in": sum(s.arrived != s.job.queued_at for s in stays),
        "moved_out": sum(s.left is not None for s in stays),
        "not_replayed": not_replayed,
        # the engine's own counts for these jobs, to hold the replay of its own
        # configuration against
        "recorded": recorded(jobs),
    }
    return JobTrace(requests, prompts[:n], [job.pk for job in jobs], summary, pins,
                    actions, warmup)


def _moved_away_jobs(moved: dict[int, datetime], since: datetime, until: datetime,
                     known: list[Job]) -> list[Job]:
    """The jobs queued in (since, until] that moved away from the engine (they are
    another engine's now), but those in `known`."""
    ids = set(moved) - {job.pk for job in known}
    return list(Job.objects.filter(pk__in=ids, num_prompt_tokens__gt=0, queued_at__gt=since,
                                   queued_at__lte=until).select_related("owner"))


def _stays(engine_name: str, jobs: list[Job], moved: dict[int, datetime]) -> list[_Stay]:
    """Each job's stay on this engine, in the order they arrived here: from its queueing
    or its move here (its `engines`), to its move away (its next engine's start, or the
    operator log's move) if it moved on."""
    out = []
    for job in jobs:
        arrived, left = job.queued_at, moved.get(job.pk)
        visits = engines_of(job)
        here = [k for k, v in enumerate(visits) if v.get("engine") == engine_name]
        if here:
            k = here[-1]
            if visits[k].get("reason") == "migration" and visits[k].get("at"):
                arrived = max(arrived, datetime.fromisoformat(visits[k]["at"]))
            if k + 1 < len(visits) and visits[k + 1].get("at"):
                left = datetime.fromisoformat(visits[k + 1]["at"])
        out.append(_Stay(job, arrived, left))
    return sorted(out, key=lambda s: (s.arrived, s.job.pk))


def _segment(name: str, stays: list[_Stay]) -> what_if_log.Segment:
    return what_if_log.Segment(name, stays[0].arrived,
                               {s.job.request_id: i for i, s in enumerate(stays) if s.job.request_id},
                               {s.job.pk for s in stays})


def _actions(logged: list, segments: list, t0: datetime, tokens_of: dict,
             not_replayed: list[dict]) -> tuple[list[ReplayAction], list[ReplayAction]]:
    """The logged actions as replay actions of the window and of the warm-up (an action
    before the window's first job is the warm-up's, if there is one); those that cannot
    be replayed appended to not_replayed."""
    window_actions: list[ReplayAction] = []
    warm_actions: list[ReplayAction] = []
    replayed_jobs = set().union(*(segment.jobs for segment in segments))
    for row in logged:
        warm = len(segments) > 1 and row.created_at < t0
        made = what_if_log.replay_action(row, segments[1 if warm else 0], t0,
                                         tokens_of.get(row.pk), replayed_jobs)
        if isinstance(made, ReplayAction):
            (warm_actions if warm else window_actions).append(made)
        elif made is not None:
            not_replayed.append(made)
    return window_actions, warm_actions


def _departures(stays: list[_Stay], segment: what_if_log.Segment) -> list[ReplayAction]:
    """A move-out for each job that moved away, at its time in the segment."""
    return [ReplayAction((s.left - segment.origin).total_seconds(), "move-out", request=i,
                         label=f"migrate {s.job.request_id}".strip())
            for i, s in enumerate(stays) if s.left is not None]


def recorded(jobs: list[Job]) -> dict:
    """What the engine and the service did for these jobs, in the replay's terms: the
    prefix hit rate, prompt tokens computed, preemptions, and the times a user saw (TTFT
    from the job's arrival, queued, to its first token; the queue wait to its claim by
    an engine worker), p50 and p99 in seconds; and the service's own delay, which the
    replay does not run and adds to its times (service_delay)."""
    prompt = sum(j.num_prompt_tokens for j in jobs)
    cached = sum(j.num_cached_tokens for j in jobs)
    ttfts = [(j.first_token_at - j.queued_at).total_seconds() for j in jobs
             if j.first_token_at is not None and j.queued_at is not None]
    claims = [(j.started_at - j.queued_at).total_seconds() for j in jobs
              if j.started_at is not None and j.queued_at is not None]
    return {"prefix_hit_rate": cached / prompt if prompt else 0.0,
            "prompt_tokens_computed": prompt - cached,
            "preemptions": sum(j.num_preemptions for j in jobs),
            "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "queue_wait_p50": percentile(claims, 50), "queue_wait_p99": percentile(claims, 99),
            "service_delay_s": service_delay(jobs, claims)}


def service_delay(jobs: list[Job], claims: list[float]) -> float:
    """The service's part of a job's TTFT, which the replay does not run: its TTFT less
    the engine's own (from the request's arrival at the engine to its first token, its
    KV story's moments: the engine's wait and compute, which the replay does run), the
    median over the jobs that have both. That is the wait to be claimed, the hand-off
    to the engine core and the first token's way back. Without stories, the median wait
    to be claimed."""
    parts = []
    for j in jobs:
        moments = (j.kv_story or {}).get("moments") or {}
        arrived, first = moments.get("arrived"), moments.get("first_token")
        if None in (arrived, first, j.first_token_at, j.queued_at):
            continue
        parts.append((j.first_token_at - j.queued_at).total_seconds() - (first - arrived))
    return max(0.0, percentile(parts, 50) if parts else (percentile(claims, 50) or 0.0))


def _pin_units(config: dict, pins: list[dict], source: str) -> list[tuple[tuple, int] | None]:
    """Each pin's sort key, of the jobs' kind (tokens or characters), and its length in
    tokens; None for a pin that cannot be put in the jobs' terms (token ids where the
    jobs were compared as characters)."""
    out: list[tuple[tuple, int] | None] = []
    for pin in pins:
        salt = pin.get("cache_salt") or ""
        unit = None
        if source == "tokens":
            ids = pin.get("token_ids") or inspector.token_ids(config, pin.get("prompt") or "", None)
            if ids:
                unit = ((salt, list(ids)), len(ids))
        elif pin.get("prompt"):
            unit = ((salt, pin["prompt"]), len(pin["prompt"]))
        out.append(unit)
    return out


def _prompt_units(config: dict, jobs: list[Job]) -> tuple[list[tuple], str]:
    """Each job's sort key: (cache salt, token ids), or (salt, text) where the engine's
    tokenizer cannot be read from this process or fails on one of the prompts (a chat
    its template refuses): the same kind of key for every job, so that they compare."""
    salts = [cache_salt(job.owner) or "" for job in jobs]
    if inspector.tokenizer(config) is not None:
        try:
            return [(salt, inspector.job_token_ids(config, job))
                    for salt, job in zip(salts, jobs)], "tokens"
        except Exception as e:  # noqa: BLE001  (any tokenizer or template error)
            log.warning("what-if trace: prompts compared as characters (%s: %s)",
                        type(e).__name__, e)
    return [(salt, render_chat(None, job.messages) if job.messages else job.prompt)
            for salt, job in zip(salts, jobs)], "characters"


def _shared_with_predecessor(order: list[int], units: list[tuple], lengths: list[int],
                             scale: bool) -> list[int]:
    """shared[k]: prompt tokens order[k] shares with order[k - 1] (0 for k = 0, or
    another salt). With characters, the shared characters scaled by the smaller
    tokens-per-character of the two jobs."""
    shared = [0] * len(order)
    for k in range(1, len(order)):
        (salt_a, a), (salt_b, b) = units[order[k - 1]], units[order[k]]
        if salt_a != salt_b:
            continue
        n = _common_prefix(a, b)
        if scale:
            ratio = min(lengths[order[k - 1]] / max(len(a), 1),
                        lengths[order[k]] / max(len(b), 1))
            n = int(n * ratio)
        shared[k] = min(n, lengths[order[k - 1]], lengths[order[k]])
    return shared


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _build_prompts(order: list[int], shared: list[int], lengths: list[int],
                   vocab: int) -> list[list[int]]:
    """In sorted order, each prompt is its predecessor's first shared tokens, then
    tokens of its own (the first of them never its predecessor's next token, so the
    shared part ends where the jobs' did)."""
    prompts: list[list[int]] = [[] for _ in order]
    for k, i in enumerate(order):
        rng = random.Random(i * 7919 + 17)
        head = prompts[order[k - 1]][:shared[k]] if k else []
        tail = [rng.randrange(vocab) for _ in range(lengths[i] - len(head))]
        if tail and k and len(prompts[order[k - 1]]) > len(head) \
                and tail[0] == prompts[order[k - 1]][len(head)]:
            tail[0] = (tail[0] + 1) % vocab
        prompts[i] = head + tail
    return prompts


def _groups(order: list[int], shared: list[int],
            block_size: int) -> tuple[list[int | None], list[int]]:
    """Each job's prefix group (runs of the sorted prompts whose neighbours share at
    least block_size tokens, numbered by their first arrival) and its prefix_len (the
    most it shares with any other job; 0 outside a group)."""
    n = len(order)
    run_of = [0] * n  # by position in `order`
    for k in range(1, n):
        run_of[k] = run_of[k - 1] + (0 if shared[k] >= block_size else 1)
    groups: list[int | None] = [None] * n
    prefix_lens = [0] * n
    first_arrival: dict[int, int] = {}
    for k, i in enumerate(order):
        best = max(shared[k], shared[k + 1] if k + 1 < n else 0)
        if best >= block_size:
            prefix_lens[i] = best
            first_arrival[run_of[k]] = min(first_arrival.get(run_of[k], i), i)
    numbers = {run: g for g, run in enumerate(sorted(first_arrival, key=first_arrival.get))}
    for k, i in enumerate(order):
        if prefix_lens[i]:
            groups[i] = numbers[run_of[k]]
    return groups, prefix_lens
