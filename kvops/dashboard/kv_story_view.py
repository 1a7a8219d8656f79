"""A job's KV story as GET /api/jobs/<id>/kv/ and the job page show it: the story its
engine told (engine/observe/story.py, kept on the job's row) with what only the service
knows added: the router's view when it chose (`routing`: the hit on the engine chosen
and the best one), the routing miss it implies (`other_engine`), and for a viewer who
is not staff, other users' request ids hidden and a miss under another tenant's cache
salt told as `never_cached`."""
from __future__ import annotations

import re
from datetime import datetime, timezone

from kvops.dashboard import visibility
from kvops.models import Job

# request ids the service gives: "job-<job id>-<attempt>", a sample's "/<i>" after it
_REQUEST_ID = re.compile(r"job-(\d+)-\d+(?:/\d+)?")
# first-miss reasons a routing miss explains better (the engine could prove nothing else)
_ROUTING_MAY_EXPLAIN = ("never_cached", "unknown")


def document(job: Job, viewer) -> dict:
    """The story of `job` for `viewer` (who may see the job: its owner or staff)."""
    story = _with_iso_times(job.kv_story or {})
    bs = story.get("block_size")
    routing = _routing(job, bs)
    doc = {
        "job": job.pk, "status": job.status, "engine": job.engine or None,
        "request_id": job.request_id or None, "told": bool(story),
        "block_size": bs, "prompt_tokens": story.get("prompt_tokens", job.num_prompt_tokens),
        "cached_tokens": story.get("cached_tokens") or {"gpu": 0, "cpu": 0, "disk": 0},
        "blocks": _blocks(story), "first_miss": story.get("first_miss"),
        **_counted_apart(story.get("preemptions", []), story.get("swaps"),
                         story.get("moves")),
        "routing": routing, "final_blocks": story.get("final_blocks"),
        "copy_on_write": story.get("copy_on_write", 0),
        "window_freed": story.get("window_freed", 0),
        # KV blocks held x seconds by pool, so far or to its end (None: a story told
        # before the engine counted them)
        "block_seconds": story.get("block_seconds"),
        "moments": story.get("moments") or {"admitted": None, "first_token": None,
                                             "preemptions": [], "ended": None},
    }
    if not story:
        doc["detail"] = untold_detail(job.status)
    miss = doc["first_miss"]
    if miss and miss["reason"] == "salt" and not visibility.sees_everything(viewer):
        # (before the routing's reading, which a never_cached miss would get)
        miss = doc["first_miss"] = _never_cached(miss["block"])
    if miss and miss["reason"] in _ROUTING_MAY_EXPLAIN and routing["best_engine"] and \
            routing["best_engine"] != job.engine and \
            routing["best_hit_tokens"] > miss["block"] * bs:
        doc["first_miss"] = {
            **miss, "reason": "other_engine", "by": None,
            "detail": f"engine {routing['best_engine']} held {routing['best_hit_tokens']} "
                      f"tokens of this prompt's prefix when the job was routed, engine "
                      f"{job.engine} held {routing['hit_tokens'] or 'none'}; it ran on "
                      f"{job.engine} ({_why_there(job)})"}
    if not visibility.sees_everything(viewer):
        _seal(doc, viewer)
    return doc


def untold_detail(status: str) -> str:
    """Why a job's row holds no story yet, by its status: a running job's comes with its
    progress (its engine hands it out with the first token, or the end if sooner)."""
    if status == Job.Status.QUEUED:
        return "its engine has not admitted it yet"
    if status == Job.Status.RUNNING:
        return "the job is running, waiting for its story (its engine sends it with the " \
               "job's first token)"
    return "its engine told no KV story (it keeps no KV history, or the job ran before " \
           "stories were kept)"


def _counted_apart(preemptions: list[dict], swaps: list[dict] | None,
                   moves: list[dict] | None) -> dict:
    """Preemptions (recompute), swaps and moves, each counted as the engine counts them
    (engine/sched/scheduler.py, above SchedulerCounters). A story kept before swaps and
    moves were told apart (None) had them among its preemptions: they are sorted out."""
    if swaps is not None and moves is not None:
        return {"preemptions": preemptions, "swaps": swaps, "moves": moves}
    kept, swaps, moves = [], [], []
    for p in preemptions:
        if p.get("reason") == "migration":
            moves.append({"at": p["at"], "from": p.get("by"),
                          "blocks_sent": p.get("swapped_blocks", 0)})
        elif p.get("swapped_blocks"):
            swaps.append({"at": p["at"], "direction": "out", "reason": p.get("reason"),
                          "by": p.get("by"), "needed_blocks": p.get("needed_blocks"),
                          "free_blocks": p.get("free_blocks"), "blocks": p["swapped_blocks"]})
        else:
            kept.append({k: v for k, v in p.items() if k != "swapped_blocks"})
    return {"preemptions": kept, "swaps": swaps, "moves": moves}


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat()


def _with_iso_times(story: dict) -> dict:
    """The engine's Unix times as ISO 8601."""
    if not story:
        return story
    story = dict(story)
    if story.get("first_miss"):
        story["first_miss"] = {**story["first_miss"], "at": _iso(story["first_miss"]["at"])}
    for key in ("preemptions", "swaps", "moves"):
        if key in story:
            story[key] = [{**p, "at": _iso(p["at"])} for p in story[key]]
    moments = story.get("moments") or {}
    story["moments"] = {"admitted": _iso(moments.get("admitted")),
                        "first_token": _iso(moments.get("first_token")),
                        "preemptions": [_iso(t) for t in moments.get("preemptions", [])],
                        "ended": _iso(moments.get("ended"))}
    return story


def _blocks(story: dict) -> list[dict]:
    """One entry per prompt block: its hash and where its K/V came from (the trailing,
    partly filled block has no hash and is always computed)."""
    if not story:
        return []
    hashes, sources, bs = story["hashes"], story["sources"], story["block_size"]
    gpu, cpu, disk = sources.get("gpu", 0), sources.get("cpu", 0), sources.get("disk", 0)
    out = [{"index": i, "hash": h,
            "source": "gpu" if i < gpu else "cpu" if i < gpu + cpu
            else "disk" if i < gpu + cpu + disk else "computed"}
           for i, h in enumerate(hashes)]
    if story["prompt_tokens"] % bs:
        out.append({"index": len(hashes), "hash": None, "source": "computed"})
    return out


def _routing(job: Job, block_size: int | None) -> dict:
    """The router's view when it chose: hit tokens on the engine that ran the job and
    on the best engine (Llumnix's routing-regret pair). Routers that looked at no
    prefixes (round-robin, the shared queue) give nulls."""
    routing = job.routing or {}
    cached = routing.get("cached_blocks") or {}
    out = {"policy": routing.get("policy"), "engine": job.engine or None,
           "hit_tokens": None, "best_engine": None, "best_hit_tokens": None}
    if not cached or not block_size:
        return out
    best = max(sorted(cached), key=lambda name: cached[name])
    hit = cached.get(job.engine, 0) * block_size
    out.update(hit_tokens=hit, best_engine=best if cached[best] else None,
               best_hit_tokens=cached[best] * block_size)
    return out


def _why_there(job: Job) -> str:
    routing = job.routing or {}
    if routing.get("policy") == "requested":
        return "the job named it"
    return routing.get("reason") or f"routing policy {routing.get('policy')!r}"


def _never_cached(block: int) -> dict:
    """A first miss at `block` as the engine tells one it never held (its words, so that
    a sealed `salt` miss reads as any other)."""
    return {"block": block, "reason": "never_cached", "at": None, "by": None,
            "detail": f"no block on this engine has held block {block}'s hash since it "
                      "started"}


def _seal(doc: dict, viewer) -> None:
    """Other users' request ids become "another user's request" for a viewer who is not
    staff (operators' names and the viewer's own requests stay). A `salt` miss reads
    `never_cached`, without the other tenant's hash: told "cached under another salt", a
    user could test guesses of another tenant's prompt (docs/security.md)."""
    ids = {_REQUEST_ID.fullmatch(x["by"])
           for x in [doc["first_miss"] or {}, *doc["preemptions"], *doc["swaps"]] if x.get("by")}
    job_ids = {int(m[1]) for m in ids if m}
    mine = set(Job.objects.filter(pk__in=job_ids, owner=viewer).values_list("pk", flat=True))

    def sealed(by: str | None) -> str | None:
        match = _REQUEST_ID.fullmatch(by or "")
        return "another user's request" if match and int(match[1]) not in mine else by

    if doc["first_miss"]:
        doc["first_miss"] = {**doc["first_miss"], "by": sealed(doc["first_miss"]["by"])}
        if doc["first_miss"]["by"] == "another user's request":
            doc["first_miss"]["detail"] = _REQUEST_ID.sub("another user's request",
                                                          doc["first_miss"]["detail"])
    for key in ("preemptions", "swaps"):
        doc[key] = [{**p, "by": sealed(p.get("by"))} for p in doc[key]]
