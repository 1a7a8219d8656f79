"""What the engine hands back per request per step."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # cumulative: every token generated so far
    text: str  # cumulative detokenised output (stop string cut off)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_cached_tokens: int  # prompt tokens served from the prefix cache at admission
    num_preemptions: int  # times the request lost its GPU blocks
    text_delta: str = ""  # text added since the previous output of this request
