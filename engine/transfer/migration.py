"""Moving a running request to another engine of the same model with its KV cache.

Between the source's steps and the destination's, in this order (a stop-and-copy):

1. `source.migration_offer(rid)`: the request's state (everything its next tokens depend
   on: tokens, sampling parameters, its place in its seed's stream, which is its number
   of output tokens, penalties and min_tokens progress, which follow from its tokens,
   logprobs so far) and its blocks' chained hashes.
2. `destination.migration_check(offer)`: refuses what cannot move there (another model
   or block size, no room) and says how many leading blocks it already caches: those
   are not sent.
3. `source.migrate_out(rid, skip)`: the request leaves the batch (its blocks kept) and
   hands over its state now and the K/V of its computed tokens' blocks from `skip` on.
4. `destination.migration_commit(state, blocks, skip)`: the request takes the cached
   blocks and new ones, the K/V is written into the new ones, and it runs from the next
   step as if it had always been there. It raises (and changes nothing) if the blocks
   it said it caches were evicted since, or the pool is now short.
5. `source.migration_done(rid, moved)`: the request ends there ("migrated"), its blocks
   freed; or, when the commit failed, it runs on there.

A staged copy keeps the pause short whatever the context (as Llumnix does): after the
offer, `destination.migration_reserve(offer)` holds blocks for the request's full
computed blocks (its leading ones cached there; fresh ones, not findable by hash until
it runs, for the rest); between the source's steps `source.migration_stage(rid, start,
end)` reads the full blocks computed so far (they no longer change) and
`destination.migration_write(rid, start, blocks)` puts them in the held blocks; the stop
(`migrate_out` from the first block not staged, `migration_commit`) then copies only the
last blocks and the state. `migration_cancel` gives the held blocks back.

A structured-output request's constraint is compiled at the destination and its matcher
told the tokens made so far. A fork moves with all its samples; a request of an engine
with sliding windows or layer groups moves by one stop-and-copy of each group's live
blocks (see below). The transport between processes is engine/transfer/link.py. Not
yet: a fork of a windowed model, and a model split over ranks.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from engine.errors import (InvalidRequestError, InvalidStateError, MigrationFailed,
                           NotEnoughBlocksError)
from engine.kv.layout import cdiv
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

MIGRATED = "migrated"  # the finish reason of a request on the engine it left
GRAMMAR_COMPILE_S = 30.0  # how long a destination compiles a moving request's constraint


def check_movable(engine: LLMEngine) -> None:
    if getattr(engine.runner, "tensor_parallel_size", 1) > 1:
        raise InvalidStateError("moving a request of a model split over ranks is not "
                                "supported yet")


def windowed(engine: LLMEngine) -> bool:
    """Whether the engine's tables are not one plain table: a sliding window gives blocks
    back, or layer groups keep a table each. Such a request moves by one stop-and-copy
    of every group's live blocks into fresh ones (the destination's cache is not looked
    up for them)."""
    return engine.kv.num_groups > 1 or engine.runner.sliding_window is not None


def state_of(engine: LLMEngine, request: Request) -> dict:
    """The request as another engine needs it (JSON-able but for nothing: hashes hex)."""
    return {
        "request_id": request.request_id, "model_id": engine.runner.model_id,
        "block_size": engine.config.block_size, "kv_format": kv_format(engine),
        "engine_seed": engine.config.seed,
        "prompt_token_ids": list(request.prompt_token_ids),
        "output_token_ids": list(request.output_token_ids),
        "output_logprobs": list(request.output_logprobs),
        "prompt_logprobs": list(request.prompt_logprobs),
        "params": dataclasses.asdict(request.sampling_params),
        "priority": request.priority, "job_id": request.job_id, "tenant": request.tenant,
        "arrival_time": request.arrival_time, "root_hash": request.root_hash.hex(),
        "pinned_root": request.pinned_root.hex() if request.pinned_root else None,
        "num_computed_tokens": request.num_computed_tokens,
        "num_cached_tokens": request.num_cached_tokens or 0,
        "num_preemptions": request.num_preemptions,
        "block_hashes": [h.hex() for h in request.block_hashes],
        "engine": engine.config.name,
        "kv_story": engine.kv_story(request.request_id),  # (None without a history)
        "parent_id": request.parent_id, "sample_index": request.sample_index,
        "fork_size": len(engine.scheduler.forks.get(request.parent_id, ()))
        if request.parent_id is not None else 0,
        # sliding windows or layer groups: per group, [blocks given back, blocks held]
        "groups": [[freed, len(ids)] for freed, ids in engine.kv.tables_of(request.request_id)]
        if windowed(engine) else None,
    }


# --- a fork (n > 1) moves as its samples, together --------------------------------------
#
# A forked request is moved by its id (the parent's): every sample goes in one stop-and-
# copy, committed together at the destination or not at all, so that a fork never ends
# up split between two engines. It moves only while all its samples run (one that has
# ended here keeps the fork here). Its samples share their prompt's blocks: a sample's
# blocks that are sample 0's (the same hashes) are not sent again, the destination
# finds them under their hashes once sample 0 is in.

def live_fork(engine: LLMEngine, request_id: str) -> list[Request] | None:
    """The samples of the fork `request_id`, all running; None if it is no fork."""
    ids = engine.scheduler.forks.get(request_id)
    if ids is None:
        return None
    if windowed(engine):
        raise InvalidStateError(f"request {request_id!r}: a fork of a model with sliding "
                                "windows or layer groups does not move yet")
    samples = [engine.scheduler.requests.get(i) for i in ids]
    if any(s is None or s.status is not RequestStatus.RUNNING for s in samples):
        raise InvalidStateError(f"request {request_id!r}: a sample of it has ended or is not "
                                "running; a fork moves only while all its samples run")
    return samples


def fork_state(engine: LLMEngine, request_id: str, samples: list[Request]) -> dict:
    """The offer of a fork: its samples' states, and what every state has at its top."""
    states = [state_of(engine, s) for s in samples]
    return {**{k: states[0][k] for k in ("model_id", "block_size", "kv_format",
                                          "engine_seed", "engine", "job_id")},
            "request_id": request_id, "fork": True, "samples": states,
            "block_hashes": states[0]["block_hashes"], "params": states[0]["params"],
            "num_computed_tokens": sum(st["num_computed_tokens"] for st in states)}


def _shared(state: dict, first: dict) -> int:
    """Leading full blocks of a sample that are sample 0's (the same hashes)."""
    n = 0
    for a, b in zip(state["block_hashes"], first["block_hashes"]):
        if a != b:
            break
        n += 1
    return n


def kv_format(engine: LLMEngine) -> str:
    """How the engine's K/V is stored (Runner.kv_format: its dtype, an fp8 cache's
    scales, the simulator's stand-in size): blocks move only between engines that
    store them alike."""
    return engine.runner.kv_format


def _fits(engine: LLMEngine, state: dict) -> None:
    if state["model_id"] != engine.runner.model_id or \
            state["block_size"] != engine.config.block_size or \
            state.get("kv_format") != kv_format(engine):
        raise InvalidRequestError(
            f"request {state['request_id']!r} runs {state['model_id']} in blocks of "
            f"{state['block_size']} ({state.get('kv_format')}); this engine runs "
            f"{engine.runner.model_id} in blocks of {engine.config.block_size} "
            f"({kv_format(engine)})")
    if state["engine_seed"] != engine.config.seed and state["params"]["seed"] is None:
        raise InvalidRequestError("the engines' seeds differ: an unseeded sampled request "
                                  "would not continue its stream of draws")
    if engine.paused or engine.draining:
        raise InvalidStateError(f"this engine is {engine.state}: it takes no request now")
    if state["request_id"] in engine.scheduler.requests:
        raise InvalidRequestError(f"request {state['request_id']!r} already exists here")
    check_movable(engine)


def check(engine: LLMEngine, offer: dict) -> dict:
    """Destination: whether the request fits here, and the leading blocks cached here."""
    if offer.get("fork"):
        return _check_fork(engine, offer)
    _fits(engine, offer)
    if offer.get("groups") is not None:  # (fresh blocks for every group's live ones)
        return _room(engine, f"request {offer['request_id']!r}",
                     sum(n for _, n in offer["groups"]) + engine.kv.num_groups, 0)
    cached = engine.kv.cached_chain([bytes.fromhex(h) for h in offer["block_hashes"]])
    need = cdiv(offer["num_computed_tokens"] + 1, engine.config.block_size) - len(cached)
    return _room(engine, f"request {offer['request_id']!r}", need, len(cached))


def _room(engine: LLMEngine, who: str, need: int, cached: int) -> dict:
    """check()'s answer, or NotEnoughBlocksError when `need` blocks are not free here
    (`who`: the request, as the error names it)."""
    if need > engine.kv.gpu.num_free:
        raise NotEnoughBlocksError(f"{who} needs {need} free blocks here, "
                                   f"{engine.kv.gpu.num_free} are")
    return {"cached_blocks": cached, "free_blocks": engine.kv.gpu.num_free}


def _check_fork(engine: LLMEngine, offer: dict) -> dict:
    if offer["request_id"] in engine.scheduler.requests or \
            offer["request_id"] in engine.scheduler.forks:
        raise InvalidRequestError(f"request {offer['request_id']!r} already exists here")
    for state in offer["samples"]:
        _fits(engine, state)
    first = offer["samples"][0]
    cached = engine.kv.cached_chain([bytes.fromhex(h) for h in first["block_hashes"]])
    bs = engine.config.block_size
    need = sum(cdiv(st["num_computed_tokens"] + 1, bs) - max(len(cached), _shared(st, first)
                                                            if i else len(cached))
               for i, st in enumerate(offer["samples"]))
    return _room(engine, f"request {offer['request_id']!r} (a fork of "
                 f"{len(offer['samples'])} samples)", need, len(cached))


def take_out(engine: LLMEngine, request_id: str, skip: int) -> tuple[dict, Any]:
    """Source: the request leaves the batch, its blocks kept; its state and the K/V of
    its computed tokens' blocks from `skip` on. A fork: every sample, its state listing
    theirs and `data` a list of theirs (a sample from the first block not sample 0's)."""
    check_movable(engine)
    samples = live_fork(engine, request_id)
    if samples is not None:
        return _take_out_fork(engine, request_id, samples, skip)
    request = engine.scheduler.suspend(request_id)
    try:
        if windowed(engine):  # every group's live blocks, in group order
            data = [engine.runner.read_blocks(ids) if ids else None
                    for _, ids in engine.kv.tables_of(request_id)]
        else:
            n = cdiv(request.num_computed_tokens, engine.config.block_size)
            data = engine.runner.read_blocks(engine.kv.block_ids(request_id)[skip:n])
    except Exception:
        engine.scheduler.resume(request_id)
        raise
    return state_of(engine, request), data  # (a windowed engine's: each group's layout)


def _take_out_fork(engine: LLMEngine, request_id: str, samples: list[Request],
                   skip: int) -> tuple[dict, Any]:
    taken = []
    try:
        for s in samples:
            engine.scheduler.suspend(s.request_id)
            taken.append(s.request_id)
        state = fork_state(engine, request_id, samples)
        first = state["samples"][0]
        skips = [skip] + [max(skip, _shared(st, first)) for st in state["samples"][1:]]
        data = []
        for s, k in zip(samples, skips):
            n = cdiv(s.num_computed_tokens, engine.config.block_size)
            data.append(engine.runner.read_blocks(engine.kv.block_ids(s.request_id)[k:n]))
    except Exception:
        for rid in taken:
            engine.scheduler.resume(rid)
        raise
    state["skips"] = skips
    return state, data


def done(engine: LLMEngine, request_id: str, moved: bool, to: str | None = None,
         reason: str = "migration") -> None:
    """Source: the request ended here (it runs on `to`; the next step reports its end,
    finish_reason "migrated"), or runs on here. A fork: every sample."""
    ids = engine.scheduler.forks.get(request_id)
    if ids is not None and all(i in engine.scheduler.suspended for i in ids):
        for rid in list(ids):
            done(engine, rid, moved, to, reason)
        return
    if not moved:
        engine.scheduler.resume(request_id)
        return
    request = engine.scheduler.suspended[request_id]
    engine.scheduler.finish(request, RequestStatus.FINISHED, MIGRATED)
    out = engine.core_output(request, [])
    out.migration = {"to": to, "reason": reason}
    engine.report_moved(out)


def reserve(engine: LLMEngine, offer: dict) -> dict:
    """Destination, for a staged copy: hold blocks for the offer's full computed blocks
    (its leading ones cached here, fresh ones for the rest), which write() fills while
    the request keeps running at the source. Returns {"cached_blocks": k}: the source
    stages its blocks from k on."""
    if offer.get("fork") or offer.get("groups") is not None:
        raise InvalidRequestError(f"request {offer['request_id']!r} moves in one stop-and-"
                                  "copy, not staged (a fork, or an engine with sliding windows "
                                  "or layer groups)")
    _fits(engine, offer)
    rid = offer["request_id"]
    if rid in engine.incoming_migrations:
        raise InvalidRequestError(f"request {rid!r} is already being copied here")
    request = _request(engine, offer)
    num_full = offer["num_computed_tokens"] // engine.config.block_size
    cached = engine.kv.hold(rid, request.block_hashes, num_full)
    if cached is None:
        raise NotEnoughBlocksError(f"request {rid!r} needs {num_full} blocks here, "
                                   f"{engine.kv.gpu.num_free} are free")
    engine.incoming_migrations[rid] = (request, cached)
    return {"cached_blocks": cached, "reserved_blocks": num_full - cached}


def stage(engine: LLMEngine, request_id: str, start: int,
          end: int | None = None) -> tuple[Any, int]:
    """Source, while the request runs: the K/V of its full computed blocks from `start`
    on (they no longer change; below `end`, the blocks the destination holds), and the
    index after the last one."""
    request = engine.scheduler.get_live(request_id)
    if request.status is not RequestStatus.RUNNING or request_id in engine.scheduler.suspended:
        raise InvalidStateError(f"request {request_id!r} is not running here")
    full = request.num_computed_tokens // engine.config.block_size
    end = full if end is None else min(end, full)
    ids = engine.kv.block_ids(request_id)[start:end]
    return (engine.runner.read_blocks(ids) if ids else None), max(end, start)


def write(engine: LLMEngine, request_id: str, start: int, data: Any) -> None:
    """Destination: staged K/V into the held blocks from index `start` on."""
    if request_id not in engine.incoming_migrations:
        raise InvalidRequestError(f"no copy of request {request_id!r} is under way here")
    _, cached = engine.incoming_migrations[request_id]
    table = engine.kv.block_ids(request_id)
    n = engine.runner.num_blocks_in(data) if data is not None else 0
    if start < cached or start + n > len(table):
        raise InvalidRequestError(f"blocks {start}..{start + n - 1} are not held for request "
                                  f"{request_id!r} (blocks {cached}..{len(table) - 1} are)")
    if n:
        engine.runner.write_blocks(table[start:start + n], data)


def cancel(engine: LLMEngine, request_id: str) -> None:
    """Destination: the copy stopped; the held blocks go back."""
    request, _ = engine.incoming_migrations.pop(request_id)
    engine.kv.free(request, "migration")


def commit(engine: LLMEngine, state: dict, data: Any, skip: int) -> dict:
    """Destination: the request with its blocks (cached here, or new ones given `data`,
    the K/V of its blocks from `skip` on); it runs from the next step. After reserve()
    and write(), the held blocks are its, and `data` is the rest from `skip` on."""
    if state.get("fork"):
        return _commit_fork(engine, state, data)
    if state.get("groups") is not None:
        return _commit_tables(engine, state, data)
    if state["request_id"] in engine.incoming_migrations:
        return _commit_held(engine, state, data, skip)
    return _commit_fresh(engine, state, data, skip)


@contextlib.contextmanager
def _given_back_on_error(engine: LLMEngine, request: Request) -> Iterator[None]:
    """A commit that fails part-way (its blocks taken, its K/V not all written, before
    it runs here) gives back every block the request took or held here and leaves
    nothing of it: a failed move costs the destination nothing. Every commit runs
    inside this, from its first block taken to its arrival."""
    try:
        yield
    except BaseException:
        engine.incoming_migrations.pop(request.request_id, None)
        if request.request_id not in engine.scheduler.requests:
            engine.kv.free(request, "migration")
        raise


def _commit_fresh(engine: LLMEngine, state: dict, data: Any, skip: int) -> dict:
    """A stop-and-copy into fresh blocks (and the ones cached here)."""
    _fits(engine, state)
    request = _request(engine, state)
    with _given_back_on_error(engine, request):
        return _fill_fresh(engine, state, request, data, skip)


def _fill_fresh(engine: LLMEngine, state: dict, request: Request, data: Any,
                skip: int) -> dict:
    kv = engine.kv
    match = kv.find_prefix(request)  # (its story was told on the engine it came from)
    hit_blocks = len(match.blocks) + len(match.tier_blocks)
    if hit_blocks < skip:
        raise MigrationFailed(f"request {request.request_id!r}: {skip} leading blocks were to "
                              f"be cached here, {hit_blocks} are now")
    computed = max(state["num_computed_tokens"], match.num_computed_tokens)
    request.num_computed_tokens = match.num_computed_tokens
    alloc = kv.allocate_slots(request, computed - match.num_computed_tokens, match)
    if alloc is None:
        raise MigrationFailed(f"request {request.request_id!r} needs more free blocks than "
                              f"this engine has now ({kv.gpu.num_free})")
    kv.record_prefix_query(request, match)
    engine.runner.swap_out(kv.flush_offloads())  # reused cached blocks' data first
    if alloc.copies_in:
        engine.runner.swap_in(alloc.copies_in)
    if alloc.copies:
        engine.runner.copy_blocks(alloc.copies)
    request.num_computed_tokens = computed
    # New blocks take the sent K/V; the shared cached blocks already hold it
    shared = len(match.blocks) - (1 if match.cow else 0)
    first = max(skip, shared)
    return _runs_here(engine, state, request, data, skip, first, first, shared)


def _commit_tables(engine: LLMEngine, state: dict, data: list) -> dict:
    """A request of a windowed engine: fresh tables laid out as the source's, every
    group's live blocks written into them."""
    _fits(engine, state)
    if not windowed(engine):
        raise InvalidRequestError(f"request {state['request_id']!r} comes from an engine "
                                  "with sliding windows or layer groups; this one has none")
    request = _request(engine, state)
    layout = [tuple(g) for g in state["groups"]]
    tables = engine.kv.adopt_tables(request.request_id, layout)
    if tables is None:
        raise MigrationFailed(f"request {request.request_id!r} needs more free blocks than "
                              f"this engine has now ({engine.kv.gpu.num_free})")
    with _given_back_on_error(engine, request):
        for ids, blocks in zip(tables, data, strict=True):
            if ids:
                engine.runner.write_blocks(ids, blocks)
        request.num_computed_tokens = state["num_computed_tokens"]
        sent = sum(len(ids) for ids in tables)  # (every block was sent: all are written)
        return _arrive(engine, state, request, sent, 0, sent)


def _commit_fork(engine: LLMEngine, state: dict, data: list) -> dict:
    """Every sample, in order, or none: a sample that cannot come gives back the ones
    that came before it."""
    rid = state["request_id"]
    if rid in engine.scheduler.requests or rid in engine.scheduler.forks:
        raise InvalidRequestError(f"request {rid!r} already exists here")
    results = []
    try:
        for sample, blocks, skip in zip(state["samples"], data, state["skips"], strict=True):
            results.append(commit(engine, sample, blocks, skip))
    except Exception:
        for result in results:
            _give_back(engine, result["request_id"])
        raise
    engine.scheduler.forks[rid] = [r["request_id"] for r in results]
    return {"request_id": rid, "samples": len(results),
            "num_blocks": sum(r["num_blocks"] for r in results),
            "blocks_written": sum(r["blocks_written"] for r in results),
            "blocks_cached": results[0]["blocks_cached"] if results else 0}


def _give_back(engine: LLMEngine, request_id: str) -> None:
    """Undo a sample's commit (its fork could not come whole): its blocks go back, and
    nothing of it is reported."""
    request = engine.scheduler.requests.pop(request_id)
    engine.scheduler.running.remove(request)
    engine.kv.free(request, "migration")
    engine.unreport_moved(request_id)
    if engine.stories is not None:
        engine.stories.discard(request_id)


def _commit_held(engine: LLMEngine, state: dict, data: Any, skip: int) -> dict:
    request, _ = engine.incoming_migrations[state["request_id"]]
    with _given_back_on_error(engine, request):
        return _fill_held(engine, state, data, skip)


def _fill_held(engine: LLMEngine, state: dict, data: Any, skip: int) -> dict:
    rid = state["request_id"]
    request, cached = engine.incoming_migrations[rid]
    kv = engine.kv
    if skip < cached:
        raise InvalidRequestError(f"request {rid!r}: blocks from {skip} sent, but blocks "
                                  f"below {cached} are shared cached blocks here")
    made = state["output_token_ids"][len(request.output_token_ids):]
    for token in made:
        request.append_output_token(token)  # (made at the source since the offer)
    _replay(request, made)
    request.output_logprobs = list(state["output_logprobs"])
    request.num_preemptions = state["num_preemptions"]
    if not _same_blocks(request, state):
        raise MigrationFailed(f"request {rid!r}: its tokens changed since the offer")
    request.num_computed_tokens = state["num_computed_tokens"]
    if kv.allocate_more(request, 0) is None:  # (room for the tail; full blocks offered)
        raise MigrationFailed(f"request {rid!r} needs more free blocks than this engine "
                              f"has now ({kv.gpu.num_free})")
    del engine.incoming_migrations[rid]
    # (the blocks from `cached` on were sent: staged, and from `skip` on at the stop)
    return _runs_here(engine, state, request, data, skip, skip, cached, cached)


def _runs_here(engine: LLMEngine, state: dict, request: Request, data: Any, skip: int,
               first: int, sent_from: int, cached: int) -> dict:
    """The request's table is complete: `data` (its blocks from `skip` on) goes into its
    blocks from `first` on, and it runs from the next step; its story goes on here (the
    blocks from `sent_from` on came from the source; its first `cached` were here)."""
    kv = engine.kv
    table = kv.block_ids(request.request_id)
    last = cdiv(request.num_computed_tokens, engine.config.block_size)
    if first < last:
        engine.runner.write_blocks(table[first:last], engine.runner.blocks_between(
            data, first - skip, last - skip))
    return _arrive(engine, state, request, max(0, last - sent_from), cached,
                   len(table), max(0, last - first))


def _arrive(engine: LLMEngine, state: dict, request: Request, blocks_sent: int, cached: int,
            num_blocks: int, written: int | None = None) -> dict:
    """The request, its blocks in place, runs here from the next step; its first output
    here says where it came from, and its story goes on here."""
    engine.kv.mark_computed()  # (between steps: only its blocks wait to be computed)
    engine.scheduler.adopt(request)
    engine.version += 1
    # its first output here says where it came from and what it had made (whoever reads
    # the outputs picks up its text where the source left it)
    out = engine.core_output(request, [])
    out.migration = {"from": state["engine"], "job_id": state["job_id"],
                     "output_token_ids": list(state["output_token_ids"]),
                     "output_logprobs": list(state["output_logprobs"])}
    if state.get("parent_id") is not None:  # a sample of a fork: which, of how many
        out.migration["fork"] = {"parent": state["parent_id"], "index": state["sample_index"],
                                 "n": state["fork_size"]}
    engine.report_moved(out)
    if engine.stories is not None and state.get("kv_story"):
        engine.stories.arrived(state["kv_story"], state["engine"], blocks_sent)
    return {"request_id": request.request_id, "num_blocks": num_blocks,
            "blocks_written": blocks_sent if written is None else written,
            "blocks_cached": cached}


def _replay(request: Request, tokens: list[int]) -> None:
    """Tell the request's grammar matcher (if any) the tokens made at the source."""
    if request.grammar is None:
        return
    for token in tokens:
        if request.grammar.is_terminated():
            break
        if not request.grammar.accept_token(token):
            raise InvalidRequestError(f"request {request.request_id!r}: token {token} does "
                                      "not follow its structured-output constraint here")


def _same_blocks(request: Request, state: dict) -> bool:
    """Whether the request's block hashes here are the ones the source sent."""
    return [h.hex() for h in request.block_hashes] == state["block_hashes"]


def _request(engine: LLMEngine, state: dict) -> Request:
    params = SamplingParams(**state["params"])
    request = Request(
        request_id=state["request_id"], prompt_token_ids=list(state["prompt_token_ids"]),
        sampling_params=params, arrival_time=state["arrival_time"],
        index=engine.next_request_index(), root_hash=bytes.fromhex(state["root_hash"]),
        pinned_root=bytes.fromhex(state["pinned_root"]) if state["pinned_root"] else None,
        block_size=engine.config.block_size, priority=state["priority"],
        job_id=state["job_id"], tenant=state["tenant"],
        eos_token_ids=engine.tokenizer.eos_token_ids, parent_id=state.get("parent_id"),
        sample_index=state.get("sample_index") or 0)
    for token in state["output_token_ids"]:
        request.append_output_token(token)
    if params.structured is not None:
        # Its constraint, compiled here (xgrammar caches it), its matcher brought to where
        # the source's was by the tokens made so far
        compiled = engine.structured_outputs().compile(params.structured).result(
            GRAMMAR_COMPILE_S)
        request.compiled_grammar = compiled
        request.grammar = engine.structured_outputs().matcher(compiled)
        _replay(request, state["output_token_ids"])
    request.output_logprobs = list(state["output_logprobs"])
    request.prompt_logprobs = list(state["prompt_logprobs"])
    request.num_cached_tokens = state["num_cached_tokens"]
    request.num_preemptions = state["num_preemptions"]
    if not _same_blocks(request, state):
        raise InvalidRequestError(f"request {request.request_id!r}: its block hashes differ "
                                  "here (another model identity or cache salt)")
    return request
