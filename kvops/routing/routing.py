"""Which queue a job goes to.

KVOPS_ROUTING picks the policy for jobs that name no engine:
  prefix (default): the live engine holding the longest cached prefix of the prompt;
                    ties and misses go to the least loaded (waiting + running tokens)
  round-robin:      live engines in turn
  shared:           the shared queue, taken by whichever worker is free
A job naming an engine always goes to that engine's queue.
"""
from __future__ import annotations

from django.conf import settings

from kvops import live, selectors
from kvops.monitoring import metrics_store
from kvops.routing import prefix_index
from kvops.models import Engine, Job
from kvops.intake.prompts import inspector
from kvops.routing.tenancy import cache_salt

SHARED_QUEUE = "jobs"


def engine_queue(name: str) -> str:
    return f"engine.{name}"


def policy() -> str:
    return settings.KVOPS_ROUTING


PENDING_KEY = "kvops:routing:pending:{engine}"


def reset_pending_load(engine_name: str) -> None:
    """The engine's heartbeat now counts what was routed to it."""
    live.redis_client().delete(PENDING_KEY.format(engine=engine_name))


def choose_queue(job: Job) -> tuple[str, dict]:
    """Returns (queue, the decision as shown on the job page)."""
    return choose_queues([job])[0]


def choose_queues(jobs: list[Job]) -> list[tuple[str, dict]]:
    """Per job, in order: (queue, the decision as shown on the job page). Jobs stored
    together are routed together: the engines, their load and the prefix index are read
    once for all of them (one Redis round trip, and one to record the choices), and each
    job sees those routed before it in the batch, as if they had been routed one by one
    (their tokens count as load, their prefixes as cached on the engine they went to).
    A burst of hundreds of jobs used to cost four round trips a job here."""
    out: list[tuple[str, dict] | None] = [None] * len(jobs)
    routed, requested = [], []
    for i, job in enumerate(jobs):
        if job.requested_engine:
            out[i] = engine_queue(job.requested_engine), {
                "policy": "requested", "engine": job.requested_engine,
                "reason": "the job named its engine"}
            requested.append(i)
        else:
            routed.append(i)
    engines = _candidates()
    _choose(jobs, out, routed, requested, engines)
    _pair_with_decode(jobs, out, engines)
    return out


def _choose(jobs: list[Job], out: list, routed: list[int], requested: list[int],
            engines: list[Engine]) -> list:
    mode = policy()
    if not routed and not (requested and mode == "prefix"):
        return out
    allowed = {i: _serving(engines, jobs[i].model) for i in routed}
    if mode == "shared" or not engines:
        reason = ("no live engine takes jobs (draining or none): the first free worker "
                  "takes it") if not engines else "shared queue: the first free worker takes it"
        for i in routed:
            out[i] = SHARED_QUEUE, {"policy": mode, "engine": None, "reason": reason}
        return out
    for i in [i for i in routed if not allowed[i]]:
        out[i] = SHARED_QUEUE, {"policy": mode, "engine": None, "reason": (
            f"no live engine serving {jobs[i].model!r} takes jobs (draining or none): the "
            "first free worker takes it")}
    routed = [i for i in routed if allowed[i]]
    if not routed and not requested:
        return out
    redis = live.redis_client()
    if mode == "round-robin":
        first = redis.incrby("kvops:routing:rr", len(routed)) - len(routed)
        for turn, i in enumerate(routed, start=first):
            chosen = allowed[i][turn % len(allowed[i])]
            out[i] = engine_queue(chosen.name), {
                "policy": mode, "engine": chosen.name,
                "reason": f"turn {turn} of {len(allowed[i])} engines"}
        return out
    # A job that named its engine goes there; the prefixes the others hold are looked
    # up all the same, so that its KV story can say what the router saw (a routing miss)
    # (in the jobs' order: each sees those before it as if routed one by one)
    named = {e.name: e for e in engines}
    requested = {i for i in requested if jobs[i].requested_engine in named}
    order = sorted([*routed, *requested])
    shown = [_with(_serving(engines, jobs[i].model), named[jobs[i].requested_engine])
             if i in requested else _serving(engines, jobs[i].model) for i in order]
    chooseable = [[named[jobs[i].requested_engine]] if i in requested else allowed[i]
                  for i in order]
    decisions = _by_prefix([jobs[i] for i in order], chooseable, engines, redis, shown)
    for i, (queue, decision) in zip(order, decisions):
        out[i] = (queue, {**decision, "policy": "requested", "reason": "the job named its engine"}
                  if i in requested else decision)
    return out


def _with(engines: list[Engine], engine: Engine) -> list[Engine]:
    return engines if engine in engines else [*engines, engine]


def _serving(engines: list[Engine], model: str) -> list[Engine]:
    """The engines that may take a job asking for `model` ("": any): decode engines only
    when no prefill or `both` engine of the model runs (they take the requests prefill
    engines hand them)."""
    serving = [e for e in engines if not model or selectors.model_name(e) == model]
    return [e for e in serving if _role(e) != "decode"] or serving


def _role(engine: Engine) -> str:
    return (engine.config or {}).get("role") or "both"


def _pair_with_decode(jobs: list[Job], out: list, engines: list[Engine]) -> None:
    """Prefill/decode: a job going to a prefill engine gets the decode engine it moves to
    once its first token is out (KVOPS_ENGINE_ROLE): the least loaded one of its model,
    counting the prompts paired with it in this batch."""
    decoders = [e for e in engines if _role(e) == "decode"]
    if not decoders:
        return
    roles = {e.name: _role(e) for e in engines}
    load = {e.name: load_tokens(e) for e in decoders}
    for job, routed in zip(jobs, out):
        if routed is None or roles.get(routed[1].get("engine")) != "prefill":
            continue
        model = job.model
        mine = [e for e in decoders if not model or selectors.model_name(e) == model]
        if not mine:
            continue
        chosen = min(mine, key=lambda e: (load[e.name], e.name))
        load[chosen.name] += len(job.prompt_token_ids or ()) or 1
        routed[1]["decode_engine"] = chosen.name
        routed[1]["reason"] += f"; it decodes on {chosen.name} (least loaded decode engine)"


def _candidates() -> list[Engine]:
    """Live engines that take routed jobs. Paused and draining engines take none while
    another engine does; when every engine is paused, jobs go to them and wait for a
    resume; draining ones never take any (with none left, jobs wait in the shared queue,
    which their workers left)."""
    engines = [e for e in selectors.recent_engines() if selectors.engine_alive(e)]
    states = {e.name: selectors.engine_state(e) for e in engines}
    return [e for e in engines if states[e.name] == "ready"] or [
        e for e in engines if states[e.name] == "paused"]


def load_tokens(engine: Engine, pending: bytes | None = None) -> int:
    """Tokens the engine holds or waits on (its last heartbeat) plus tokens routed to it
    since (`pending`: a burst of jobs must not all go to the engine that looked idle)."""
    m = engine.metrics or {}
    return int(m.get("running_tokens", 0)) + int(m.get("waiting_tokens", 0)) + int(pending or 0)


def _by_prefix(jobs: list[Job], allowed: list[list[Engine]], engines: list[Engine],
               redis, shown: list[list[Engine]] | None = None) -> list[tuple[str, dict]]:
    """The longest prefix wins, held in either tier (copying a block back from the CPU
    costs far less than recomputing it); then more of it on the GPU; then load. Each
    job goes to one of its `allowed` engines (those serving its model), and its prefix
    is hashed from the token ids rendered at intake (on engines of another tokenizer,
    rendered here). `shown`: per job, the engines whose cached prefix the decision
    shows (by default its allowed ones; always a superset of them)."""
    shown = shown or allowed
    names = [e.name for e in engines]
    hashes: list[dict[str, list[str]]] = []  # per job, per allowed engine
    memo: dict[tuple, list[str]] = {}  # engines of one model share a prompt's hashes
    pipe = redis.pipeline(transaction=False)
    for e in engines:
        pipe.get(PENDING_KEY.format(engine=e.name))
    for job, its_engines in zip(jobs, shown):
        salt = cache_salt(job.owner)  # its blocks are found under its owner's salt only
        per_engine = {}
        for e in its_engines:
            key = (inspector.tokenizer_key(e.config), e.config.get("block_size"),
                   e.config.get("model"), salt)
            if key not in memo:
                token_ids = inspector.job_token_ids(e.config, job)
                memo[key] = inspector.short_hashes(e.config, token_ids, salt)
            per_engine[e.name] = memo[key]
            prefix_index.look_up(pipe, e.name, per_engine[e.name])
        hashes.append(per_engine)
        memo.clear()
    replies = iter(pipe.execute())
    load = {e.name: load_tokens(e, next(replies)) for e in engines}
    routed_tokens = dict.fromkeys(names, 0)
    expected: dict[str, set[str]] = {name: set() for name in names}
    decisions = []
    regrets = []  # per job: (engine chosen, tokens the best engine held beyond it)
    for _job, per_engine, its_engines in zip(jobs, hashes, allowed):
        cached, on_gpu = {}, {}
        for name in per_engine:
            chain = per_engine[name]
            on_gpu_read, on_cpu_read = (next(replies), next(replies)) if chain else ([], [])
            cached[name], on_gpu[name] = prefix_index.leading_blocks(
                chain, on_gpu_read, on_cpu_read, expected[name])
        shown_load = dict(load)
        chosen = min(its_engines, key=lambda e: (-cached[e.name], -on_gpu[e.name], load[e.name],
                                             e.name))
        if cached[chosen.name]:
            tier = cached[chosen.name] - on_gpu[chosen.name]
            reason = (f"holds the longest cached prefix ({cached[chosen.name]} blocks"
                      + (f", {tier} of them on its CPU tier)" if tier else ")"))
        else:
            reason = "no engine holds a prefix of it: least loaded"
        # The chosen engine will hold this prefix once the job runs: count it so, so that
        # jobs of the same burst follow it (the engine's next full index rewrite corrects
        # this), and count its tokens as that engine's load until its next heartbeat.
        chain = per_engine[chosen.name]
        block_size = int(chosen.config.get("block_size") or 1)
        regrets.append((chosen.name, (max(cached.values()) - cached[chosen.name]) * block_size))
        expected[chosen.name].update(chain)
        tokens = max(len(chain) * int(chosen.config.get("block_size") or 1), 1)
        load[chosen.name] += tokens
        routed_tokens[chosen.name] += tokens
        decisions.append((engine_queue(chosen.name), {
            "policy": "prefix", "engine": chosen.name, "reason": reason,
            "cached_blocks": cached, "gpu_cached_blocks": on_gpu,
            "load_tokens": shown_load}))
    pipe = redis.pipeline(transaction=False)
    for name, regret in regrets:
        metrics_store.count_routing(pipe, name, regret)
    for name in names:
        prefix_index.expect(pipe, name, expected[name])
        if routed_tokens[name]:
            pipe.incrby(PENDING_KEY.format(engine=name), routed_tokens[name])
    pipe.execute()
    return decisions
