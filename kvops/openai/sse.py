"""A job's output as server-sent events (OpenAI's streaming chunks), and a batch's
streams merged into one."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import msgspec
from django.conf import settings

from kvops.intake import tool_calls
from kvops.jobs.job_listener import JobFailed, JobListener, cancel_abandoned
from kvops.models import Job
from kvops.openai.choices import finish_reason, format_logprobs
from kvops.openai.usage import total_usage, usage, usage_of


class _Diverged(Exception):
    """A re-run's text does not continue what was streamed."""


_json = msgspec.json.Encoder()


def continues(sent: str, text: str) -> bool:
    """Whether a sample's text so far can still continue what was streamed of it. A job
    that runs again (its engine died, even in the middle of a move) starts its text over:
    while the new text is a prefix of what was sent, nothing is sent and the stream waits
    for it to catch up; only text that departs from what was sent is a divergence."""
    return text.startswith(sent) or sent.startswith(text)


def _event(doc: dict) -> bytes:
    """One server-sent event carrying doc as JSON (msgspec: a fifth of json.dumps's
    cost, and a stream sends one per chunk)."""
    return b"data: " + _json.encode(doc) + b"\n\n"


async def job_events(listener: JobListener, ident: str, model: str, created: int,
                     chat: bool, logprobs: bool = False, include_usage: bool = False,
                     continuous_usage_stats: bool = False, n: int = 1,
                     echo: str = "", tool_call: dict | None = None,
                     call_id: str = "", index_base: int = 0,
                     last: bool = True) -> AsyncIterator[str]:
    """The job's output as server-sent events: each chunk holds all the text produced
    since the previous one, and chunks are spaced so that a web process sends at most
    KVOPS_SSE_MAX_CHUNKS_PER_S of them, however many streams it serves. include_usage
    adds a last chunk with the usage (no choices), continuous_usage_stats the usage so
    far to every chunk (stream_options). With n > 1 each sample's chunks carry its
    `index`. `echo` (completions): the prompt, sent first. With a tool call the text is
    the call: a named function's arguments stream as tool_calls deltas; a `required`
    list of calls is sent whole once it is complete. One prompt of a batch numbers its
    choices from index_base, and leaves the usage chunk and [DONE] to the batch
    (last=False)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    logprobs_sent = [0] * n  # each sample's logprob entries streamed so far
    text_offset = [len(echo)] * n  # and where the next one's text starts

    def chunk(delta_text: str | None, finish: str | None, first: bool = False,
              index: int = 0) -> bytes:
        entries = None
        if logprobs and first and echo:  # the prompt's tokens
            entries = format_logprobs(listener.prompt_logprobs or [], chat, 0)
        elif logprobs and not first:  # the tokens produced since the previous chunk
            new = listener.logprobs_of(index)[logprobs_sent[index]:]
            logprobs_sent[index] += len(new)
            entries = format_logprobs(new, chat, text_offset[index])
            text_offset[index] += sum(len(e[0]) for e in new)
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if delta_text and tool_call is not None and tool_call["kind"] == "named":
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": delta_text}}]
            elif delta_text:
                delta["content"] = delta_text
            choice = {"index": index_base + index, "delta": delta, "finish_reason": finish,
                      "logprobs": entries}
        else:
            choice = {"index": index_base + index, "text": delta_text or "",
                      "finish_reason": finish, "logprobs": entries}
        data = {"id": ident, "object": kind, "created": created, "model": model,
                "choices": [choice]}
        if continuous_usage_stats:
            data["usage"] = usage_of(listener.num_prompt_tokens,
                                     listener.num_all_output_tokens, listener.num_cached_tokens)
        return _event(data)

    def error(message: str) -> bytes:
        return _event({"error": {"message": message, "type": "server_error"}})

    def tool_call_chunk(calls: list[dict] | None, finish: str | None) -> bytes:
        delta = {"tool_calls": calls} if calls else {}
        return _event({
            "id": ident, "object": kind, "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                         "logprobs": None}]})

    max_rate = settings.KVOPS_SSE_MAX_CHUNKS_PER_S
    sent = [""] * n  # each sample's text streamed so far
    try:
        if chat:
            for index in range(n):
                yield chunk(None, None, first=True, index=index)
            if tool_call is not None and tool_call["kind"] == "named":
                yield tool_call_chunk([{"index": 0, "id": f"{call_id}-0", "type": "function",
                                        "function": {"name": tool_call["names"][0],
                                                     "arguments": ""}}], None)
        elif echo and not logprobs:
            for index in range(n):
                yield chunk(echo, None, first=True, index=index)
        echo_pending = bool(echo) and logprobs  # sent with the prompt's logprobs
        auto = tool_call is not None and tool_call["kind"] == "auto"
        try:
            async for _ in listener.updates():
                if tool_call is not None and tool_call["kind"] == "required":
                    continue  # sent whole at the end
                if echo_pending and listener.prompt_logprobs is not None:
                    for index in range(n):
                        yield chunk(echo, None, first=True, index=index)
                    echo_pending = False
                moved = False
                for index in range(n):
                    text = listener.text_of(index)
                    if auto:  # content up to a call; the calls are sent at the end
                        text = tool_calls.visible_auto(text, final=False)
                    if not continues(sent[index], text):
                        raise _Diverged
                    if len(text) > len(sent[index]):
                        yield chunk(text[len(sent[index]):], None, index=index)
                        sent[index], moved = text, True
                if moved:
                    await asyncio.sleep(listener.sub.hub.num_listeners / max_rate)
            else:
                state = listener.state
                if state.get("status") == Job.Status.FAILED:
                    yield error(f"the job failed: {state.get('error')}")
                else:
                    if echo_pending:
                        for index in range(n):
                            yield chunk(echo, None, first=True, index=index)
                    # The final row holds every sample's whole text: send what the stream
                    # had not carried yet (samples 1.. are not in the progress writes).
                    outcomes = state.get("samples") or [
                        {"text": listener.text.text, "finish_reason": finish_reason(state)}]
                    if tool_call is not None and tool_call["kind"] != "named":
                        # auto or required: the calls, sent whole now that they are complete
                        text, finish = outcomes[0]["text"], outcomes[0]["finish_reason"]
                        try:
                            calls = tool_calls.calls_of(tool_call, text, call_id)
                        except ValueError:  # a required list cut off: its text as it is
                            calls = []
                        if calls:
                            before = tool_calls.visible_auto(text, final=True) if auto else ""
                            if len(before) > len(sent[0]):  # auto's content before the calls
                                yield chunk(before[len(sent[0]):], None)
                            yield tool_call_chunk([{"index": i, **c} for i, c in enumerate(calls)],
                                                  None)
                            yield tool_call_chunk(None, "tool_calls" if finish == "stop"
                                                  else finish or "stop")
                            outcomes = []
                        else:
                            tool_call = None  # no call: the text as it is, below
                    for index, outcome in enumerate(outcomes):
                        if not outcome["text"].startswith(sent[index]):
                            raise _Diverged
                        if len(outcome["text"]) > len(sent[index]):
                            yield chunk(outcome["text"][len(sent[index]):], None, index=index)
                        yield chunk(None, outcome["finish_reason"] or "stop", index=index)
                    if include_usage and last:
                        yield _event({
                            "id": ident, "object": kind, "created": created, "model": model,
                            "choices": [], "usage": usage(state)})
        except JobFailed as e:
            yield error(f"the job's updates were lost: {e}")
        except _Diverged:
            yield error("the job ran again after its engine stopped, and its new output "
                        "differs from what was streamed; retry the request")
        if last:
            yield b"data: [DONE]\n\n"
    finally:
        listener.sub.close()
        if not listener.finished:  # the client went away, or the stream broke
            cancel_abandoned(listener.job_id)


async def merged(streams: list[AsyncIterator[bytes]], listeners: list[JobListener],
                 ident: str, model: str, created: int,
                 include_usage: bool) -> AsyncIterator[bytes]:
    """A batch's streams as one: each prompt's chunks (their choice indices its own) as
    they come, then the whole batch's usage if asked, then [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(events: AsyncIterator[bytes]) -> None:
        try:
            async for event in events:
                await queue.put(event)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(events)) for events in streams]
    try:
        running = len(tasks)
        while running:
            event = await queue.get()
            if event is None:
                running -= 1
            else:
                yield event
        if include_usage:
            states = [listener.state for listener in listeners]
            yield _event({"id": ident, "object": "text_completion", "created": created,
                          "model": model, "choices": [],
                          "usage": total_usage([usage(state) for state in states])})
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for events in streams:  # each closes its listener (a client gone: cancels its job)
            await events.aclose()
