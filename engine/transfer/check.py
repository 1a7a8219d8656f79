"""A moving request's state, checked whole before it touches the destination.

What arrives on the migration port (engine/transfer/link.py) is the source core's
`Migrator.state_of` (or a fork's offer), and even from a peer of the deployment
it is an input: every field is checked for its type and range here (token ids and
logit_bias keys inside this engine's vocabulary, the computed tokens within the tokens,
logprobs of the shapes the sampler makes, the KV story of the shape kv_story writes)
before a block is taken or a request made, so that nothing malformed can raise inside a
step, where it would end the requests sharing the batch. A bad state is an
InvalidRequestError naming the field.
"""
from __future__ import annotations

import dataclasses

from engine.errors import EngineError, InvalidRequestError
from engine.kv.layout import cdiv
from engine.observe.story import check_document
from engine.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams

HASH_HEX = 64  # a block hash (sha256) as hex
MAX_ID = 256  # characters of a request, job, tenant or engine id


@dataclasses.dataclass(frozen=True, slots=True)
class Destination:
    """What of the destination engine a state is checked against."""
    vocab_size: int
    block_size: int
    max_model_len: int
    num_groups: int  # layer groups, each with a table of its own (1: one table)


def _fail(field: str, what: str) -> None:
    raise InvalidRequestError(f"a moving request's `{field}` {what}")


def _int(value: object, field: str, low: int = 0, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or \
            (high is not None and value > high):
        _fail(field, f"must be an integer in [{low}, {'...' if high is None else high}]")
    return value


def _text(value: object, field: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value or len(value) > MAX_ID:
        _fail(field, f"must be a string of 1 to {MAX_ID} characters")


def _float(value: object, field: str, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        _fail(field, "must be a number")


def _list(value: object, field: str, most: int) -> list:
    if not isinstance(value, list) or len(value) > most:
        _fail(field, f"must be a list of at most {most}")
    return value


def _ids(value: object, field: str, vocab: int, most: int) -> list[int]:
    ids = _list(value, field, most)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        _fail(field, f"must hold token ids in [0, {vocab})")
    return ids


def _hash(value: object, field: str) -> None:
    if not isinstance(value, str) or len(value) != HASH_HEX or \
            any(c not in "0123456789abcdef" for c in value):
        _fail(field, "must be a block hash (64 hex digits)")


def _top(ids: object, logprobs: object, field: str, vocab: int) -> None:
    _ids(ids, field, vocab, MAX_LOGPROBS)
    _list(logprobs, field, MAX_LOGPROBS)
    if len(ids) != len(logprobs):
        _fail(field, "must have as many top logprobs as top ids")
    for x in logprobs:
        _float(x, field)


def check_state(dest: Destination, state: object) -> None:
    """One request's state (Migrator.state_of), or a fork's (Migrator.offer), as it may be
    taken here; InvalidRequestError naming the first field that is not."""
    if not isinstance(state, dict):
        _fail("state", "must be a map")
    if state.get("fork") is not None:
        _check_fork(dest, state)
    else:
        _check_one(dest, state)


def _check_fork(dest: Destination, state: dict) -> None:
    if state["fork"] is not True:
        _fail("fork", "must be true")
    _text(state.get("request_id"), "request_id")
    samples = _list(state.get("samples"), "samples", MAX_N)
    if not samples:
        _fail("samples", "must not be empty")
    for i, sample in enumerate(samples):
        if not isinstance(sample, dict):
            _fail("samples", "must hold maps")
        _check_one(dest, sample)
        if sample["parent_id"] != state["request_id"] or sample["sample_index"] != i or \
                sample["request_id"] != f"{state['request_id']}/{i}":
            _fail("samples", f"must be the samples {state['request_id']}/0... in order")
    if "skips" in state:
        skips = _list(state["skips"], "skips", MAX_N)
        if len(skips) != len(samples):
            _fail("skips", "must give one skip per sample")
        for skip, sample in zip(skips, samples):
            _int(skip, "skips", 0, cdiv(sample["num_computed_tokens"], dest.block_size))
    for key in ("model_id", "block_size", "kv_format", "engine_seed", "engine", "job_id",
                "params", "block_hashes", "num_computed_tokens"):
        if key not in state:
            _fail(key, "is missing")


def _check_one(dest: Destination, state: dict) -> None:
    vocab, bs = dest.vocab_size, dest.block_size
    for key in ("request_id", "model_id", "engine"):
        _text(state.get(key), key)
    if not isinstance(state.get("kv_format"), str):
        _fail("kv_format", "must be a string")
    for key in ("job_id", "tenant", "parent_id"):
        _text(state.get(key), key, optional=True)
    _int(state.get("block_size"), "block_size", 1)
    if state.get("engine_seed") is not None:
        _int(state["engine_seed"], "engine_seed", -(1 << 63))
    _int(state.get("priority"), "priority", -(1 << 31), 1 << 31)
    _float(state.get("arrival_time"), "arrival_time")
    params = state.get("params")
    if not isinstance(params, dict):
        _fail("params", "must be a map")
    try:
        parsed = SamplingParams(**params)
    except (EngineError, TypeError, ValueError) as e:
        _fail("params", f"are not valid sampling parameters ({e})")
    if any(t >= vocab for t in parsed.token_ids_used()):
        _fail("params", f"name token ids outside the vocabulary (ids must be below {vocab})")
    prompt = _ids(state.get("prompt_token_ids"), "prompt_token_ids", vocab, dest.max_model_len)
    if not prompt:
        _fail("prompt_token_ids", "must not be empty")
    output = _ids(state.get("output_token_ids"), "output_token_ids", vocab,
                  min(parsed.max_tokens, dest.max_model_len))
    total = len(prompt) + len(output)
    if total > dest.max_model_len:
        _fail("output_token_ids", f"and the prompt make more than {dest.max_model_len} tokens")
    computed = _int(state.get("num_computed_tokens"), "num_computed_tokens", 0, total)
    _int(state.get("num_cached_tokens"), "num_cached_tokens", 0, total)
    _int(state.get("num_preemptions"), "num_preemptions", 0)
    _int(state.get("sample_index", 0), "sample_index", 0, MAX_N - 1)
    _int(state.get("fork_size", 0), "fork_size", 0, MAX_N)
    _hash(state.get("root_hash"), "root_hash")
    if state.get("pinned_root") is not None:
        _hash(state["pinned_root"], "pinned_root")
    for h in _list(state.get("block_hashes"), "block_hashes", total // bs):
        _hash(h, "block_hashes")
    logprobs = _list(state.get("output_logprobs"), "output_logprobs", len(output))
    if logprobs and (parsed.logprobs is None or len(logprobs) != len(output)):
        _fail("output_logprobs", "must hold one entry per output token, if its params ask")
    for entry in logprobs:
        if not isinstance(entry, list) or len(entry) != 3:
            _fail("output_logprobs", "must hold [logprob, top ids, top logprobs] entries")
        _float(entry[0], "output_logprobs")
        _top(entry[1], entry[2], "output_logprobs", vocab)
    for entry in _list(state.get("prompt_logprobs"), "prompt_logprobs", len(prompt)):
        if not isinstance(entry, list) or len(entry) != 4:
            _fail("prompt_logprobs", "must hold [token id, logprob, top ids, top logprobs]")
        _ids([entry[0]], "prompt_logprobs", vocab, 1)
        _float(entry[1], "prompt_logprobs", optional=True)
        _top(entry[2], entry[3], "prompt_logprobs", vocab)
    groups = state.get("groups")
    if groups is not None:
        if len(_list(groups, "groups", dest.num_groups)) != dest.num_groups:
            _fail("groups", f"must give this engine's {dest.num_groups} layer groups")
        for group in groups:
            if not isinstance(group, list) or len(group) != 2:
                _fail("groups", "must hold [blocks given back, blocks held] pairs")
            freed = _int(group[0], "groups", 0, cdiv(computed, bs))
            _int(group[1], "groups", 0, cdiv(computed, bs) + 1 - freed)
    if state.get("kv_story") is not None:
        try:
            check_document(state["kv_story"])
        except (KeyError, TypeError, ValueError) as e:
            _fail("kv_story", f"is not a story ({e!r})")
