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
The replay starts with an empty cache: prefixes cached before the window are misses.
Except the engine's pinned prefixes (`active_pins`: the operator log's hard pins since
the last reset, unpinned ones left out): built into the same token space as the jobs'
prompts (each shares with them what its text or tokens did), they are computed and
pinned before the replay, within its pin budget.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone

from engine.sim.replay_stats import percentile
from engine.sim.trace import TraceRequest
from kvops.models import Engine, Job, OperatorAction
from kvops.intake.prompts import inspector, render_chat
from kvops.routing.tenancy import cache_salt

log = logging.getLogger(__name__)

MAX_MINUTES = 24 * 60
MAX_JOBS = 5000


@dataclass(slots=True)
class JobTrace:
    requests: list[TraceRequest]  # in arrival order
    prompts: list[list[int]]  # the token ids each request replays (see the module doc)
    job_ids: list[int]  # the job each request comes from
    summary: dict  # what was replayed, and what the engine recorded for the same jobs
    pins: list[list[int]] = field(default_factory=list)  # pinned before the replay


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
    jobs = list(reversed(window(engine.name, minutes, until).select_related("owner")[:max_jobs]))
    if not jobs:
        raise ValueError(f"engine {engine.name} ran no jobs queued in the last {minutes} "
                         f"minutes: there is nothing to replay")
    units, source = _prompt_units(engine.config, jobs)
    lengths = [job.num_prompt_tokens for job in jobs]
    # the pinned prefixes after the jobs: their prompts are built beside the jobs'
    pin_units = _pin_units(engine.config, active_pins(engine.name, until), source)
    units += [u for u, _ in pin_units]
    lengths += [n for _, n in pin_units]
    order = sorted(range(len(units)), key=lambda i: units[i])
    shared = _shared_with_predecessor(order, units, lengths, source == "characters")
    vocab = int(engine.config.get("vocab_size") or 32000)
    prompts = _build_prompts(order, shared, lengths, vocab)
    groups, prefix_lens = _groups(order, shared, int(engine.config.get("block_size") or 16))
    n = len(jobs)
    prompts, pins = prompts[:n], prompts[n:]
    groups, prefix_lens, lengths = groups[:n], prefix_lens[:n], lengths[:n]
    start = jobs[0].queued_at
    requests = [TraceRequest(arrival_s=(job.queued_at - start).total_seconds(),
                             prompt_len=job.num_prompt_tokens,
                             output_len=max(job.num_output_tokens, 1),
                             prefix_group=groups[i], prefix_len=prefix_lens[i])
                for i, job in enumerate(jobs)]
    prompt_tokens = sum(lengths)
    summary = {
        "jobs": len(jobs), "minutes": minutes, "max_jobs": max_jobs,
        "truncated": window(engine.name, minutes, until)[max_jobs:max_jobs + 1].exists(),
        "from": start.isoformat(), "until": until.isoformat(),
        "span_s": requests[-1].arrival_s,
        "still_running": sum(job.status == Job.Status.RUNNING for job in jobs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": sum(r.output_len for r in requests),
        "prefix_groups": len({g for g in groups if g is not None}),
        "prefixes_from": source,
        "pins": len(pins),
        # the engine's own counts for these jobs, to hold the replay of its own
        # configuration against
        "recorded": recorded(jobs),
    }
    return JobTrace(requests, prompts, [job.pk for job in jobs], summary, pins)


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


def _pin_units(config: dict, pins: list[dict], source: str) -> list[tuple[tuple, int]]:
    """Each pin's sort key, of the jobs' kind (tokens or characters), and its length in
    tokens; a pin that cannot be put in the jobs' terms (token ids where the jobs were
    compared as characters) is left out."""
    out = []
    for pin in pins:
        salt = pin.get("cache_salt") or ""
        if source == "tokens":
            ids = pin.get("token_ids") or inspector.token_ids(config, pin.get("prompt") or "", None)
            if ids:
                out.append(((salt, list(ids)), len(ids)))
        elif pin.get("prompt"):
            out.append(((salt, pin["prompt"]), len(pin["prompt"])))
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
