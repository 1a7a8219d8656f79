"""Operator commands by name: what a service applies to an engine between two steps.

One table for every way in (the worker's control command, the engine core process):
name -> function(engine, arguments) -> a JSON-able result. A refused command raises an
EngineError subclass; bad arguments raise InvalidRequestError.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.block_hash import short
from engine.errors import EngineError, InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.wire import AddRequest, Refusal


def _int_or_none(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(f"{name} must be a non-negative integer")
    return value


def _prompt_arg(arguments: dict) -> str | list[int]:
    if "token_ids" in arguments and arguments["token_ids"] is not None:
        return arguments["token_ids"]
    if "prompt" in arguments and arguments["prompt"] is not None:
        return arguments["prompt"]
    raise InvalidRequestError("give `prompt` (text) or `token_ids`")


def _abort_result(output: RequestOutput) -> dict:
    return {"request_id": output.request_id, "status": "aborted",
            "num_output_tokens": len(output.output_token_ids)}


def _request_id(arguments: dict) -> str:
    request_id = arguments.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError("`request_id` must be a non-empty string")
    return request_id


# Commands that change the engine's state (LLMEngine.state): whoever relays one passes
# the new state on at once (the core's next metrics, the worker's heartbeat, routing).
STATE_COMMANDS = ("pause", "resume", "drain", "undrain")

def _soft(arguments: dict) -> dict:
    """A pin's soft-pin arguments (none: a hard pin)."""
    if not arguments.get("soft"):
        return {}
    return {"soft": True, "priority": int(arguments.get("priority") or 0),
            "ttl_s": float(arguments.get("ttl_s") or SOFT_PIN_TTL_S)}


SOFT_PIN_TTL_S = 3600.0  # a soft pin's time to live when none is given


def _clear(arguments: dict) -> tuple[str, ...]:
    """A tenant command's limits going back to everyone's."""
    clear = arguments.get("clear") or ()
    if not isinstance(clear, (list, tuple)) or not all(isinstance(c, str) for c in clear):
        raise InvalidRequestError("`clear` must be a list of limit names")
    return tuple(clear)


def _by(arguments: dict) -> str:
    """Who sent the command (the service passes the operator's name), for KV stories."""
    by = arguments.get("by")
    return by if isinstance(by, str) and by else "operator"


OPERATOR_COMMANDS: dict[str, Callable[[LLMEngine, dict], Any]] = {
    "preempt": lambda e, a: e.preempt(_request_id(a), _by(a)),
    "swap-out": lambda e, a: e.swap_out(_request_id(a), _by(a)),
    "swap-in": lambda e, a: e.swap_in(_request_id(a), _by(a)),
    "abort": lambda e, a: _abort_result(e.abort(_request_id(a))),
    "evict": lambda e, a: {"num_evicted": e.evict_cached_blocks(
        _int_or_none(a.get("num_blocks"), "num_blocks"), _by(a))},
    "reset": lambda e, a: e.reset_prefix_cache(_by(a)),
    "pin": lambda e, a: e.pin_prefix(_prompt_arg(a), a.get("cache_salt"), **_soft(a)),
    "unpin": lambda e, a: e.unpin_prefix(_prompt_arg(a), a.get("cache_salt"),
                                         soft=bool(a.get("soft"))),
    "snapshot": lambda e, a: e.snapshot(compact=bool(a.get("compact", True))),
    "metrics": lambda e, a: e.metrics(),
    # the GPU pool's cached hashes, or the CPU tier's with {"pool": "cpu"}
    "prefix-hashes": lambda e, a: [short(h) for h in (
        e.kv.cpu if a.get("pool") == "cpu" else e.kv.gpu).cached],
    # read-only: the leading tokens of a prompt each level of the prefix cache holds
    "prefix-lookup": lambda e, a: e.lookup_prefix(_prompt_arg(a), a.get("cache_salt")),
    "pause": lambda e, a: e.pause(),
    "resume": lambda e, a: e.resume(),
    "drain": lambda e, a: e.drain(),
    "undrain": lambda e, a: e.undrain(),
    "set-limits": lambda e, a: e.set_limits(a.get("max_num_seqs"), a.get("max_num_batched_tokens")),
    # what the prefix cache keeps (the pin budget), changed live
    "retention": lambda e, a: e.set_retention(a.get("pin_budget"), a.get("eviction_policy"),
                                              a.get("tenant_cache_quota")),
    "tenant": lambda e, a: e.set_tenant(a.get("tenant"), a.get("cache_quota"), a.get("weight"),
                                        _clear(a)),
    # the live requests' ids by where they are (a drain by migration moves the running)
    "live-requests": lambda e, a: {
        "running": [r.request_id for r in e.scheduler.running],
        "waiting": [r.request_id for r in (*e.scheduler.waiting, *e.scheduler.swapped)]
        + list(e.scheduler.compiling),
        "moving": list(e.scheduler.suspended)},
}


def run_command(engine: LLMEngine, name: str, arguments: dict) -> Any:
    """Apply one operator command (call between two steps, on the engine's thread)."""
    op = OPERATOR_COMMANDS.get(name)
    if op is None:
        raise InvalidRequestError(f"unknown command {name!r}")
    return op(engine, arguments)


def add_requests(engine: LLMEngine, items: list[AddRequest]) -> list[Refusal | None]:
    """Add several requests between two steps. Per item None (added) or why it was
    refused (e.g. a prompt too long): one bad request does not stop the others."""
    results: list[Refusal | None] = []
    for item in items:
        try:
            engine.add_request(item.request_id, item.prompt, SamplingParams(**item.params),
                               priority=item.priority, job_id=item.job_id,
                               cache_salt=item.cache_salt, tenant=item.tenant)
            results.append(None)
        except EngineError as e:
            results.append(Refusal.of(e))
        except (KeyError, TypeError, ValueError) as e:
            results.append(Refusal("InvalidRequestError", f"bad arguments: {e}"))
    return results
