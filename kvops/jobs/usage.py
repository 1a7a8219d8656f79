"""The bill: what ended jobs used, per user or per tenant, over a period.

One formula per number, applied to each job (job_usage) and added up over the rows the
period selects (report): a row of the report is exactly the sum of its jobs' own usage.
The KV figures come from each job's KV story as its engine told it (engine/observe/story.py):
its prompt's cached tokens by tier and its KV block-seconds by pool
(engine/kv/block_seconds.py). A job without a story (its engine kept no KV history, or it
failed before it ran) adds its tokens and nothing by tier; `jobs_untold` counts them.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from engine.observe.tenants import STAFF_TENANT  # (staff's jobs' label: they have none)
from kvops.models import Job
from kvops.routing import tenancy

GROUPINGS = ("user", "tenant")
ENDED = (Job.Status.FINISHED, Job.Status.FAILED, Job.Status.CANCELLED)
TIERS = ("gpu", "cpu", "disk")
POOLS = ("gpu", "cpu")
# A row's numbers, in the order the CSV writes them (after the key and `jobs`)
COUNTS = ("prompt_tokens", "prompt_tokens_computed", "cached_tokens",
          *(f"cached_tokens_{t}" for t in TIERS), "output_tokens",
          *(f"kv_block_seconds_{p}" for p in POOLS), "jobs_untold")
_FIELDS = ("owner__username", "owner__is_staff", "num_prompt_tokens", "num_cached_tokens",
           "num_output_tokens", "samples", "kv_story")


@dataclass(frozen=True, slots=True)
class UsageQuery:
    by: str  # "user" or "tenant"
    since: datetime  # ended at or after (aware)
    until: datetime  # ended before (aware)

    def __post_init__(self) -> None:
        if self.by not in GROUPINGS:
            raise ValueError(f"by must be one of {', '.join(GROUPINGS)}, got {self.by!r}")
        if self.since >= self.until:
            raise ValueError("since must be before until")


def output_tokens(samples: list | None, num_output_tokens: int) -> int:
    """A job's output tokens: every sample's with n > 1 (num_output_tokens counts sample
    0's), else num_output_tokens."""
    if samples:
        return sum(len(s["token_ids"]) for s in samples)
    return num_output_tokens


def job_usage(job: Job) -> dict[str, float]:
    """One job's own numbers, by COUNTS' names."""
    story = job.kv_story or {}
    cached = story.get("cached_tokens") or {}
    held = story.get("block_seconds") or {}
    return {
        "prompt_tokens": job.num_prompt_tokens,
        "prompt_tokens_computed": job.num_prompt_tokens - job.num_cached_tokens,
        "cached_tokens": job.num_cached_tokens,
        **{f"cached_tokens_{t}": cached.get(t, 0) for t in TIERS},
        "output_tokens": output_tokens(job.samples, job.num_output_tokens),
        **{f"kv_block_seconds_{p}": held.get(p, 0.0) for p in POOLS},
        "jobs_untold": 0 if story else 1,
    }


def key_of(job: Job, by: str) -> str:
    """The row a job adds to: its owner's username, or its owner's tenant label."""
    if by == "user":
        return job.owner.username
    return tenancy.tenant(job.owner) or STAFF_TENANT


def ended_jobs(viewer, query: UsageQuery, username: str | None = None):
    """The jobs the report adds up: ended in [since, until), the viewer's own unless the
    viewer is staff (then everyone's, or `username`'s)."""
    jobs = Job.objects.filter(status__in=ENDED, finished_at__gte=query.since,
                              finished_at__lt=query.until)
    if not viewer.is_staff:
        jobs = jobs.filter(owner=viewer)
    elif username:
        jobs = jobs.filter(owner__username=username)
    return jobs.select_related("owner").only(*_FIELDS).order_by("pk")


def report(viewer, query: UsageQuery, username: str | None = None) -> list[dict]:
    """One row per user or tenant label, sorted by it: {by: key, "jobs": n, **COUNTS}."""
    rows: dict[str, dict] = {}
    for job in ended_jobs(viewer, query, username).iterator(chunk_size=500):
        key = key_of(job, query.by)
        row = rows.get(key)
        if row is None:
            row = rows[key] = {query.by: key, "jobs": 0, **{name: 0 for name in COUNTS}}
        row["jobs"] += 1
        for name, value in job_usage(job).items():
            row[name] += value
    return [rows[key] for key in sorted(rows)]
