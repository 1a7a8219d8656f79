"""Moving a running request to another engine of the same model with its KV cache (the
first step of request migration: one stop-and-copy between two steps of each engine).

Between the source's steps and the destination's, in this order:

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

Not yet: copying full blocks in stages while the request keeps decoding (so that the
pause does not grow with the context), layer groups and sliding windows, forks,
structured output, a model split over ranks, and the transport between processes.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError, InvalidStateError, NotEnoughBlocksError
from engine.kv_layout import cdiv
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

MIGRATED = "migrated"  # the finish reason of a request on the engine it left


class MigrationFailed(InvalidStateError):
    """The destination cannot take the request now (nothing changed there)."""


def check_movable(engine: LLMEngine) -> None:
    if engine.kv.num_groups > 1 or engine.runner.sliding_window is not None:
        raise InvalidStateError("moving a request of a model with sliding windows or layer "
                                "groups is not supported yet")


def state_of(engine: LLMEngine, request: Request) -> dict:
    """The request as another engine needs it (JSON-able but for nothing: hashes hex)."""
    return {
        "request_id": request.request_id, "model_id": engine.runner.model_id,
        "block_size": engine.config.block_size, "engine_seed": engine.config.seed,
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
    }


def _fits(engine: LLMEngine, state: dict) -> None:
    if state["model_id"] != engine.runner.model_id or \
            state["block_size"] != engine.config.block_size:
        raise InvalidRequestError(
            f"request {state['request_id']!r} runs {state['model_id']} in blocks of "
            f"{state['block_size']}; this engine runs {engine.runner.model_id} in blocks of "
            f"{engine.config.block_size}")
    if state["engine_seed"] != engine.config.seed and state["params"]["seed"] is None:
        raise InvalidRequestError("the engines' seeds differ: an unseeded sampled request "
                                  "would not continue its stream of draws")
    if state["request_id"] in engine.scheduler.requests:
        raise InvalidRequestError(f"request {state['request_id']!r} already exists here")
    check_movable(engine)


def check(engine: LLMEngine, offer: dict) -> dict:
    """Destination: whether the request fits here, and the leading blocks cached here."""
    _fits(engine, offer)
    cached = engine.kv.cached_chain([bytes.fromhex(h) for h in offer["block_hashes"]])
    need = cdiv(offer["num_computed_tokens"] + 1, engine.config.block_size) - len(cached)
    if need > engine.kv.gpu.num_free:
        raise NotEnoughBlocksError(f"request {offer['request_id']!r} needs {need} free "
                                   f"blocks here, {engine.kv.gpu.num_free} are")
    return {"cached_blocks": len(cached), "free_blocks": engine.kv.gpu.num_free}


def take_out(engine: LLMEngine, request_id: str, skip: int) -> tuple[dict, Any]:
    """Source: the request leaves the batch, its blocks kept; its state and the K/V of
    its computed tokens' blocks from `skip` on."""
    check_movable(engine)
    request = engine.scheduler.suspend(request_id)
    try:
        n = cdiv(request.num_computed_tokens, engine.config.block_size)
        data = engine.runner.read_blocks(engine.kv.block_ids(request_id)[skip:n])
    except Exception:
        engine.scheduler.resume(request_id)
        raise
    return state_of(engine, request), data


def done(engine: LLMEngine, request_id: str, moved: bool) -> None:
    """Source: the request ended here (it runs elsewhere), or runs on here."""
    if not moved:
        engine.scheduler.resume(request_id)
        return
    request = engine.scheduler.suspended[request_id]
    engine.scheduler.finish(request, RequestStatus.FINISHED, MIGRATED)


def commit(engine: LLMEngine, state: dict, data: Any, skip: int) -> dict:
    """Destination: the request with its blocks (cached here, or new ones given `data`,
    the K/V of its blocks from `skip` on); it runs from the next step."""
    _fits(engine, state)
    bs, kv = engine.config.block_size, engine.kv
    request = _request(engine, state)
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
    table = kv.block_ids(request.request_id)
    shared = len(match.blocks) - (1 if match.cow else 0)
    first = max(skip, shared)
    last = cdiv(computed, bs)
    if first < last:
        engine.runner.write_blocks(table[first:last], data[first - skip:last - skip])
    kv.mark_computed()  # (between steps: only its new blocks wait to be computed)
    engine.scheduler.adopt(request)
    engine.version += 1
    return {"request_id": request.request_id, "num_blocks": len(table),
            "blocks_written": max(0, last - first), "blocks_cached": shared}


def _request(engine: LLMEngine, state: dict) -> Request:
    params = SamplingParams(**state["params"])
    request = Request(
        request_id=state["request_id"], prompt_token_ids=list(state["prompt_token_ids"]),
        sampling_params=params, arrival_time=state["arrival_time"],
        index=engine.next_request_index(), root_hash=bytes.fromhex(state["root_hash"]),
        pinned_root=bytes.fromhex(state["pinned_root"]) if state["pinned_root"] else None,
        block_size=engine.config.block_size, priority=state["priority"],
        job_id=state["job_id"], tenant=state["tenant"],
        eos_token_ids=engine.tokenizer.eos_token_ids)
    for token in state["output_token_ids"]:
        request.append_output_token(token)
    request.output_logprobs = list(state["output_logprobs"])
    request.prompt_logprobs = list(state["prompt_logprobs"])
    request.num_cached_tokens = state["num_cached_tokens"]
    request.num_preemptions = state["num_preemptions"]
    if [h.hex() for h in request.block_hashes] != state["block_hashes"]:
        raise InvalidRequestError(f"request {request.request_id!r}: its block hashes differ "
                                  "here (another model identity or cache salt)")
    return request
