"""What the engine hands back per request per step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.request import Request, RequestStatus

ENDED = frozenset({RequestStatus.FINISHED, RequestStatus.ABORTED})


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # cumulative: every token generated so far
    text: str  # cumulative detokenised output (stop string cut off)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    num_cached_tokens: int  # prompt tokens served from the prefix cache at admission
    num_preemptions: int  # times the request lost its GPU blocks to recompute them (not swaps)
    text_delta: str = ""  # text added since the previous output of this request
    # per output token [sampled logprob, top ids, top logprobs] (SamplingParams.logprobs)
    logprobs: list[list] | None = None
    # per prompt token [token id, logprob (None for the first), top ids, top logprobs]
    # (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[list] | None = None
    # n > 1 (LLMEngine.generate): every sample's output, in order; the fields above are
    # sample 0's
    samples: list[RequestOutput] | None = None
    error: str | None = None  # finish_reason "error": why the engine could not serve it


@dataclass(slots=True)
class CoreOutput:
    """A request's progress in one step as the engine core reports it: token ids, no
    text (whoever reads it detokenises; see LLMEngine.step_core)."""
    request_id: str
    new_token_ids: list[int]  # gained this step (empty when it only ended)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    logprobs: list[list] | None = None  # per new token, if asked: see Request.output_logprobs
    request: Any = field(default=None, repr=False)  # the Request, in-process only
    # with the first token, if asked: see Request.prompt_logprobs
    prompt_logprobs: list[list] | None = None
    error: str | None = None  # finish_reason "error": why the engine could not serve it
    # its KV story (engine/observe/story.py), when it changed in this step
    kv_story: dict | None = None
    # a request that moved between engines (engine/transfer/migration.py): its end at the one it
    # left ({"to": name}, finish_reason "migrated"), and its first output at the one it
    # came to ({"from": name, "job_id", "output_token_ids": made before, "output_logprobs"})
    migration: dict | None = None


def core_output(request: Request, new_token_ids: list[int]) -> CoreOutput:
    """A request's output as it stands, with the tokens it gained (none: it only ended,
    or moved)."""
    # Positional and without the status property: this runs for every request in
    # every step.
    return CoreOutput(request.request_id, new_token_ids, request.status in ENDED,
                      request.finish_reason, len(request.prompt_token_ids),
                      request.num_cached_tokens or 0, request.num_preemptions, None,
                      request, None, request.error)
