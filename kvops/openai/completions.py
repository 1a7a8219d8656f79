"""POST /v1/completions and /v1/chat/completions: one path for both. Each call is a Job
like any other, so it shows up on the dashboard; answers and streams (server-sent events)
are read from the job stream (kvops/stream/job_stream.py) through this process's hub. A
client that disconnects before its job ends cancels it."""
from __future__ import annotations

import asyncio
import time
from functools import partial

from django.http import HttpRequest, HttpResponse, JsonResponse

from kvops.intake import intake
from kvops.jobs import idempotency
from kvops.jobs.job_listener import JobFailed, JobListener, cancel_abandoned
from kvops.models import Job
from kvops.openai import base, errors
from kvops.openai.choices import choices_of
from kvops.openai.handler import EventStream
from kvops.openai.sse import job_events, merged
from kvops.openai.usage import total_usage, usage


@base.v1_view("POST")
async def completions(request: HttpRequest, user) -> HttpResponse:
    return await _handle(request, user, chat=False)


@base.v1_view("POST")
async def chat_completions(request: HttpRequest, user) -> HttpResponse:
    return await _handle(request, user, chat=True)


async def _handle(request: HttpRequest, user, chat: bool) -> HttpResponse:
    refusal = await base.rate_limited(user)
    if refusal is not None:
        return refusal
    try:
        key = idempotency.key_of(request.headers)
        body = base.parse_body(request)
        news = [intake.parse_chat(body, user, key)] if chat \
            else intake.parse_completion(body, user, key)
        stream = base.flag(body, "stream")
        stream_options = _stream_options(body, stream)
        echo = not chat and base.flag(body, "echo")
        jobs, subs = await base.admit(news)
    except Exception as e:  # noqa: BLE001  (each refusal its own status; others are 500s)
        refusal = errors.refusal(e)
        if refusal is None:
            raise
        return refusal
    created = int(time.time())
    model = news[0].model
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{jobs[0].pk}"
    listeners = []
    for sub, job in zip(subs, jobs):
        listeners.append(JobListener(sub, job))
        sub.on_cut_off = partial(cancel_abandoned, job.pk)
    n = jobs[0].params.get("n") or 1
    # each prompt's prompt text, for echo (a prompt sent as token ids: their text)
    echoes = [new.prompt if echo else "" for new in news]
    if stream:
        streams = [job_events(listener, ident, model, created, chat,
                              job.params.get("logprobs") is not None, n=n, echo=prompt,
                              tool_call=job.params.get("tool_call"), call_id=f"call_{job.pk}",
                              index_base=i * n, last=len(jobs) == 1, **stream_options)
                   for i, (listener, job, prompt) in enumerate(zip(listeners, jobs, echoes))]
        if len(streams) == 1:
            return EventStream(streams[0])
        return EventStream(merged(streams, listeners, ident, model, created,
                                  stream_options.get("include_usage", False)))
    try:
        await asyncio.gather(*(_drain(listener) for listener in listeners))
    except JobFailed as e:
        for job in jobs:
            cancel_abandoned(job.pk)
        return errors.error(500, f"the job's updates were lost: {e}", type_="server_error")
    except asyncio.CancelledError:  # the client disconnected
        for job in jobs:
            cancel_abandoned(job.pk)
        raise
    finally:
        for sub in subs:
            sub.close()
    choices, usages = [], []
    for i, (listener, job, prompt) in enumerate(zip(listeners, jobs, echoes)):
        state = listener.state
        if state.get("status") == Job.Status.FAILED:
            return errors.error(500, f"the job failed: {state.get('error')}", type_="server_error")
        choices += choices_of(listener, job, chat, prompt, i * n)
        usages.append(usage(state))
    answer = {"id": ident, "object": "chat.completion" if chat else "text_completion",
              "created": created, "model": model, "choices": choices,
              "usage": total_usage(usages),
              "kvops_job_id": jobs[0].pk}
    if len(jobs) > 1:
        answer["kvops_job_ids"] = [job.pk for job in jobs]
    return JsonResponse(answer)


def _stream_options(body: dict, stream: bool) -> dict:
    """`stream_options`: include_usage (a last chunk with the usage) and, as vLLM has it,
    continuous_usage_stats (the usage so far in every chunk)."""
    options = body.get("stream_options")
    if options is None:
        return {}
    if not stream:
        raise errors.BadRequest("`stream_options` is only allowed with `stream: true`",
                                "stream_options")
    if not isinstance(options, dict):
        raise errors.BadRequest("`stream_options` must be an object", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise errors.BadRequest(f"unknown field `stream_options.{unknown[0]}`", "stream_options")
    return {name: base.flag(options, name) for name in ("include_usage", "continuous_usage_stats")}


async def _drain(listener: JobListener) -> None:
    async for _ in listener.updates():
        pass
