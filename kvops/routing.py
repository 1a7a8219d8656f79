"""Which queue a job goes to.

KVOPS_ROUTING picks the policy for jobs that name no engine:
  prefix (default): the live engine holding the longest cached prefix of the prompt;
                    ties and misses go to the least loaded (waiting + running tokens)
  round-robin:      live engines in turn
  shared:           the shared queue, taken by whichever worker is free
A job naming an engine always goes to that engine's queue.
"""
from __future__ import annotations

import os

from kvops import live, prefix_index, selectors
from kvops.models import Engine, Job
from kvops.prompts import inspector
from kvops.tenancy import cache_salt

SHARED_QUEUE = "jobs"


def engine_queue(name: str) -> str:
    return f"engine.{name}"


def policy() -> str:
    return os.environ.get("KVOPS_ROUTING", "prefix")


PENDING_KEY = "kvops:routing:pending:{engine}"


def _load(engine: Engine) -> int:
    """Tokens the engine holds or waits on (its last heartbeat) plus tokens routed to it
    since (a burst of jobs must not all go to the engine that looked idle)."""
    m = engine.metrics or {}
    pending = live.redis_client().get(PENDING_KEY.format(engine=engine.name))
    return int(m.get("running_tokens", 0)) + int(m.get("waiting_tokens", 0)) + int(pending or 0)


def reset_pending_load(engine_name: str) -> None:
    """The engine's heartbeat now counts what was routed to it."""
    live.redis_client().delete(PENDING_KEY.format(engine=engine_name))


def choose_queue(job: Job) -> tuple[str, dict]:
    """Returns (queue, the decision as shown on the job page)."""
    if job.requested_engine:
        return engine_queue(job.requested_engine), {
            "policy": "requested", "engine": job.requested_engine,
            "reason": "the job named its engine"}
    mode = policy()
    engines = [e for e in selectors.recent_engines() if selectors.engine_alive(e)]
    # Paused and draining engines take no routed jobs while another engine does; when
    # every engine is paused, jobs go to them and wait for a resume; draining ones never
    # take any (with none left, jobs wait in the shared queue, which their workers left).
    states = {e.name: selectors.engine_state(e) for e in engines}
    engines = [e for e in engines if states[e.name] == "ready"] or [
        e for e in engines if states[e.name] == "paused"]
    if mode == "shared" or not engines:
        reason = ("no live engine takes jobs (draining or none): the first free worker "
                  "takes it") if not engines else "shared queue: the first free worker takes it"
        return SHARED_QUEUE, {"policy": mode, "engine": None, "reason": reason}
    if mode == "round-robin":
        i = live.redis_client().incr("kvops:routing:rr") - 1
        chosen = engines[i % len(engines)]
        return engine_queue(chosen.name), {
            "policy": mode, "engine": chosen.name, "reason": f"turn {i} of {len(engines)} engines"}
    cached, on_gpu, hashes = {}, {}, {}
    salt = cache_salt(job.owner)  # its blocks are found under its owner's salt only
    for engine in engines:
        token_ids = inspector.token_ids(engine.config, job.prompt, job.messages)
        hashes[engine.name] = inspector.short_hashes(engine.config, token_ids, salt)
        cached[engine.name], on_gpu[engine.name] = prefix_index.cached_prefix_blocks(
            engine.name, hashes[engine.name])
    load = {e.name: _load(e) for e in engines}
    # The longest prefix wins, held in either tier (copying a block back from the CPU
    # costs far less than recomputing it); then more of it on the GPU; then load.
    chosen = min(engines, key=lambda e: (-cached[e.name], -on_gpu[e.name], load[e.name],
                                         e.name))
    if cached[chosen.name]:
        tier = cached[chosen.name] - on_gpu[chosen.name]
        reason = (f"holds the longest cached prefix ({cached[chosen.name]} blocks"
                  + (f", {tier} of them on its CPU tier)" if tier else ")"))
    else:
        reason = "no engine holds a prefix of it: least loaded"
    # The chosen engine will hold this prefix once the job runs: say so now, so that jobs
    # of the same burst follow it (the engine's next full index rewrite corrects this).
    prefix_index.expect(chosen.name, hashes[chosen.name])
    tokens = len(hashes[chosen.name]) * int(chosen.config.get("block_size") or 1)
    live.redis_client().incrby(PENDING_KEY.format(engine=chosen.name), max(tokens, 1))
    return engine_queue(chosen.name), {
        "policy": "prefix", "engine": chosen.name, "reason": reason,
        "cached_blocks": cached, "gpu_cached_blocks": on_gpu, "load_tokens": load}
