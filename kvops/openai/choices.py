"""A finished job's choices in OpenAI's shape: each sample's text or message, its
finish reason, its tool calls and its log-probabilities."""
from __future__ import annotations

from typing import Any

from kvops.intake import tool_calls
from kvops.jobs.job_listener import JobListener
from kvops.models import Job


def finish_reason(state: dict) -> str | None:
    return state.get("finish_reason") or None


def choices_of(listener: JobListener, job: Job, chat: bool, echo: str,
               index_base: int) -> list[dict]:
    """A finished job's choices (n > 1: every sample's outcome is in the row's
    `samples`), numbered from index_base."""
    state = listener.state
    outcomes = state.get("samples") or [{"text": listener.text.text,
                                         "finish_reason": finish_reason(state)}]
    choices = []
    for index, outcome in enumerate(outcomes):
        choice: dict[str, Any] = {"index": index_base + index,
                                  "finish_reason": outcome["finish_reason"] or None,
                                  "logprobs": None}
        if job.params.get("logprobs") is not None:
            prompt = listener.prompt_logprobs or [] if echo else []
            choice["logprobs"] = format_logprobs(prompt + listener.logprobs_of(index), chat, 0)
        if chat:
            choice["message"] = {"role": "assistant", "content": outcome["text"]}
            tool_call = job.params.get("tool_call")
            if tool_call is not None and outcome["finish_reason"] != "abort":
                try:
                    calls = tool_calls.calls_of(tool_call, outcome["text"], f"call_{job.pk}")
                except ValueError:  # cut off by max_tokens: the text as it is
                    calls = None
                if calls:
                    content = tool_calls.split_auto(outcome["text"], tool_call)[0] \
                        if tool_call["kind"] == "auto" else None
                    choice["message"] = {"role": "assistant", "content": content,
                                         "tool_calls": calls}
                    if tool_call["kind"] != "named" and outcome["finish_reason"] == "stop":
                        choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = echo + outcome["text"]
        choices.append(choice)
    return choices


def format_logprobs(entries: list[list], chat: bool, text_offset: int) -> dict:
    """The worker's [token, logprob, [[token, logprob], ...]] per token in OpenAI's shape:
    chat's `content` list, or the completions' parallel lists (text_offset: where the
    first token's text starts in the output)."""
    def number(logprob: float | None) -> float | None:
        return None if logprob is None else max(logprob, -9999.0)  # -inf is not JSON

    if chat:
        return {"content": [
            {"token": token, "logprob": number(logprob), "bytes": list(token.encode()),
             "top_logprobs": [{"token": t, "logprob": number(v), "bytes": list(t.encode())}
                              for t, v in top]}
            for token, logprob, top in entries]}
    offsets = []
    for token, _, _ in entries:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": [e[0] for e in entries], "token_logprobs": [number(e[1]) for e in entries],
            "top_logprobs": [{t: number(v) for t, v in e[2]} if e[1] is not None else None
                             for e in entries],
            "text_offset": offsets}
