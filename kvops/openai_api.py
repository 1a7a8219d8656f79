"""OpenAI-compatible endpoints under /v1. Each call is a Job like any other, so it shows
up on the dashboard; answers and streams (server-sent events) are read from the job
stream (kvops/stream/job_stream.py) through this process's hub. A client that disconnects
before its job ends cancels it."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from functools import partial
from typing import Any, AsyncIterator, Callable

import msgspec
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.authtoken.models import Token

from kvops import selectors
from kvops.intake import grammar_check, intake, json_body, limits, tool_calls
from kvops.jobs import admission, idempotency
from kvops.openai.handler import EventStream
from kvops.jobs.idempotency import KeyReused
from kvops.jobs.job_listener import JobFailed, JobListener, cancel_abandoned
from kvops.models import Job
from kvops.intake.prompts import inspector, prompt_ids
from kvops.stream.stream_hub import get_hub
from kvops.jobs.throttles import TooManyJobs, allow_submission

log = logging.getLogger(__name__)


def _error(status: int, message: str, param: str | None = None,
           type_: str = "invalid_request_error", code: str | None = None) -> JsonResponse:
    return JsonResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}}, status=status)


def _unauthorized() -> JsonResponse:
    return _error(401, "missing or invalid API key: send `Authorization: Bearer <token>`",
                  type_="authentication_error", code="invalid_api_key")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


TOKEN_CACHE_S = 5.0  # a deleted token or deactivated user is refused this long after, at most


def _token_user(key: str):
    try:
        token = Token.objects.select_related("user").filter(key=key).first()
        return token.user if token is not None and token.user.is_active else None
    finally:
        close_old_connections()


class TokenUsers:
    """Bearer tokens' users, each key looked up at most once every TOKEN_CACHE_S: a
    database read per call (a connection, under SQLite, opened for it) was the largest
    part of a /v1 call's cost. One lookup per key at a time: a burst of calls with a new
    key waits for the first one's answer instead of each opening a connection."""

    def __init__(self, lookup: Callable[[str], Any] = _token_user) -> None:
        self._lookup = lookup
        self._users: dict[str, tuple[float, Any]] = {}  # key -> (checked at, user)
        self._pending: dict[tuple, asyncio.Future] = {}  # (event loop, key) -> its lookup

    async def user(self, key: str):
        now = time.monotonic()
        cached = self._users.get(key)
        if cached is not None and now - cached[0] < TOKEN_CACHE_S:
            return cached[1]
        slot = (asyncio.get_running_loop(), key)
        pending = self._pending.get(slot)
        if pending is None:
            pending = self._pending[slot] = asyncio.ensure_future(
                sync_to_async(self._lookup, thread_sensitive=False)(key))
            pending.add_done_callback(lambda _: self._pending.pop(slot, None))
        user = await asyncio.shield(pending)
        if len(self._users) > 10_000:  # keys that stopped coming are dropped now and then
            self._users.clear()
        self._users[key] = (now, user)
        return user


_tokens = TokenUsers()  # this web process's


async def _authenticate(request: HttpRequest):
    """The user of the request's bearer token, or None."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return await _tokens.user(key)


def _flag(body: dict, name: str, default: bool = False) -> bool:
    try:
        return limits.flag(name, body.get(name), default)
    except limits.InvalidParam as e:
        raise BadRequest(str(e), e.param) from None


def _stream_options(body: dict, stream: bool) -> dict:
    """`stream_options`: include_usage (a last chunk with the usage) and, as vLLM has it,
    continuous_usage_stats (the usage so far in every chunk)."""
    options = body.get("stream_options")
    if options is None:
        return {}
    if not stream:
        raise BadRequest("`stream_options` is only allowed with `stream: true`", "stream_options")
    if not isinstance(options, dict):
        raise BadRequest("`stream_options` must be an object", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise BadRequest(f"unknown field `stream_options.{unknown[0]}`", "stream_options")
    return {name: _flag(options, name) for name in ("include_usage", "continuous_usage_stats")}


def _parse(request: HttpRequest) -> dict:
    try:
        body = json_body.parse(request.body or b"null")
    except json_body.BadJSON as e:
        raise BadRequest(str(e), e.param) from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _check_model(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required", "model")
    if model not in selectors.served_models():
        raise LookupError(f"model {model!r} is not served here; GET /v1/models lists them")
    return model


def _format_logprobs(entries: list[list], chat: bool, text_offset: int) -> dict:
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


def _usage(state: dict) -> dict:
    """OpenAI's usage object from a job's state (every sample's tokens, with n > 1)."""
    samples = state.get("samples") or ()
    output = sum(len(s["token_ids"]) for s in samples) if samples \
        else state.get("num_output_tokens", 0)
    return _usage_of(state.get("num_prompt_tokens", 0), output,
                     state.get("num_cached_tokens", 0), state.get("cached_tokens_by_tier"))


def _usage_of(prompt: int, output: int, cached: int, by_tier: dict | None = None) -> dict:
    """by_tier: the cached tokens by tier, a kvops extension beside OpenAI's cached_tokens
    (docs/api.md)."""
    details = {"cached_tokens": cached}
    if by_tier:
        details["cached_tokens_by_tier"] = by_tier
    return {"prompt_tokens": prompt, "completion_tokens": output,
            "total_tokens": prompt + output, "prompt_tokens_details": details}


def _total_usage(usages: list[dict]) -> dict:
    """Several prompts' usage as one (a completion of a list of prompts)."""
    tiers = [u["prompt_tokens_details"].get("cached_tokens_by_tier") for u in usages]
    by_tier = {k: sum(t.get(k, 0) for t in tiers) for k in tiers[0]} \
        if tiers and all(tiers) else None
    return _usage_of(sum(u["prompt_tokens"] for u in usages),
                     sum(u["completion_tokens"] for u in usages),
                     sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages), by_tier)


def _finish_reason(state: dict) -> str | None:
    return state.get("finish_reason") or None


async def _handle(request: HttpRequest, user, chat: bool) -> HttpResponse:
    refusal = await _rate_limited(user)
    if refusal is not None:
        return refusal
    try:
        key = idempotency.key_of(request.headers)
        body = _parse(request)
        news = [intake.parse_chat(body, user, key)] if chat \
            else intake.parse_completion(body, user, key)
        stream = _flag(body, "stream")
        stream_options = _stream_options(body, stream)
        echo = not chat and _flag(body, "echo")
        jobs, subs = await _admit(news)
    except Exception as e:  # noqa: BLE001  (each refusal its own status; others are 500s)
        refusal = _refusal(e)
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
        streams = [_sse(listener, ident, model, created, chat,
                        job.params.get("logprobs") is not None, n=n, echo=prompt,
                        tool_call=job.params.get("tool_call"), call_id=f"call_{job.pk}",
                        index_base=i * n, last=len(jobs) == 1, **stream_options)
                   for i, (listener, job, prompt) in enumerate(zip(listeners, jobs, echoes))]
        if len(streams) == 1:
            return EventStream(streams[0])
        return EventStream(_merged(streams, listeners, ident, model, created,
                                   stream_options.get("include_usage", False)))
    try:
        await asyncio.gather(*(_drain(listener) for listener in listeners))
    except JobFailed as e:
        for job in jobs:
            cancel_abandoned(job.pk)
        return _error(500, f"the job's updates were lost: {e}", type_="server_error")
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
            return _error(500, f"the job failed: {state.get('error')}", type_="server_error")
        choices += _choices(listener, job, chat, prompt, i * n)
        usages.append(_usage(state))
    answer = {"id": ident, "object": "chat.completion" if chat else "text_completion",
              "created": created, "model": model, "choices": choices,
              "usage": _total_usage(usages),
              "kvops_job_id": jobs[0].pk}
    if len(jobs) > 1:
        answer["kvops_job_ids"] = [job.pk for job in jobs]
    return JsonResponse(answer)


async def _rate_limited(user) -> JsonResponse | None:
    """A 429 if the user is over the submission rate (staff never are)."""
    if user.is_staff:
        return None
    wait = await sync_to_async(allow_submission)(user)
    if wait is None:
        return None
    rate = settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["jobs"]
    response = _error(429, f"too many requests: at most {rate} (KVOPS_JOB_RATE); "
                           f"retry in {wait:.0f} s", type_="rate_limit_exceeded",
                      code="rate_limit_exceeded")
    response["Retry-After"] = str(max(1, round(wait)))
    return response


def _refusal(e: Exception) -> JsonResponse | None:
    """The answer to a call that parsing or admission refused; None for a failure."""
    if isinstance(e, idempotency.BadKey):
        return _error(400, str(e), idempotency.HEADER)
    if isinstance(e, BadRequest):
        return _error(400, str(e), e.param)
    if isinstance(e, limits.NotAllowed):
        return _error(403, str(e), e.param, type_="permission_error")
    if isinstance(e, limits.InvalidParam):
        return _error(400, str(e), e.param)
    if isinstance(e, intake.NotFound):
        return _error(404, str(e), e.param, code="model_not_found")
    if isinstance(e, KeyReused):
        return _error(409, str(e), idempotency.HEADER, code="idempotency_key_reused")
    if isinstance(e, (admission.Unavailable, grammar_check.Busy)):
        return _error(503, str(e), type_="service_unavailable")
    if isinstance(e, TooManyJobs):
        return _error(429, str(e), type_="rate_limit_exceeded", code="too_many_jobs")
    return None


async def _admit(news: list[intake.NewJob]) -> tuple[list[Job], list]:
    """Store the calls' jobs, each with a hub subscription bound to it before its commit
    dispatches it (so it sees every update). A batch whose job is refused is refused
    whole: the jobs of it already stored are cancelled, as a client gone away cancels."""
    hub = get_hub()
    subs = []
    try:
        for _ in news:
            subs.append(await hub.open())
        outcomes = await asyncio.gather(
            *(admission.admit_async(new, lambda job, sub=sub: sub.hub.bind(sub, job.pk))
              for new, sub in zip(news, subs)), return_exceptions=True)
    except BaseException:
        for sub in subs:
            sub.close()
        raise
    failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
    if failed is not None:
        for outcome, sub in zip(outcomes, subs):
            sub.close()
            if isinstance(outcome, Job):
                cancel_abandoned(outcome.pk)
        raise failed
    return outcomes, subs


async def _drain(listener: JobListener) -> None:
    async for _ in listener.updates():
        pass


def _choices(listener: JobListener, job: Job, chat: bool, echo: str,
             index_base: int) -> list[dict]:
    """A finished job's choices (n > 1: every sample's outcome is in the row's
    `samples`), numbered from index_base."""
    state = listener.state
    outcomes = state.get("samples") or [{"text": listener.text.text,
                                         "finish_reason": _finish_reason(state)}]
    choices = []
    for index, outcome in enumerate(outcomes):
        choice: dict[str, Any] = {"index": index_base + index,
                                  "finish_reason": outcome["finish_reason"] or None,
                                  "logprobs": None}
        if job.params.get("logprobs") is not None:
            prompt = listener.prompt_logprobs or [] if echo else []
            choice["logprobs"] = _format_logprobs(prompt + listener.logprobs_of(index), chat, 0)
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


async def _merged(streams: list[AsyncIterator[bytes]], listeners: list[JobListener],
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
                          "usage": _total_usage([_usage(state) for state in states])})
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for events in streams:  # each closes its listener (a client gone: cancels its job)
            await events.aclose()


class _Diverged(Exception):
    """A re-run's text does not continue what was streamed."""


_json = msgspec.json.Encoder()


def _event(doc: dict) -> bytes:
    """One server-sent event carrying doc as JSON (msgspec: a fifth of json.dumps's
    cost, and a stream sends one per chunk)."""
    return b"data: " + _json.encode(doc) + b"\n\n"


async def _sse(listener: JobListener, ident: str, model: str, created: int,
               chat: bool, logprobs: bool = False, include_usage: bool = False,
               continuous_usage_stats: bool = False, n: int = 1,
               echo: str = "", tool_call: dict | None = None,
               call_id: str = "", index_base: int = 0, last: bool = True) -> AsyncIterator[str]:
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
            entries = _format_logprobs(listener.prompt_logprobs or [], chat, 0)
        elif logprobs and not first:  # the tokens produced since the previous chunk
            new = listener.logprobs_of(index)[logprobs_sent[index]:]
            logprobs_sent[index] += len(new)
            entries = _format_logprobs(new, chat, text_offset[index])
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
            data["usage"] = _usage_of(listener.num_prompt_tokens,
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
                    if not text.startswith(sent[index]):  # a re-run (its worker died)
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
                        {"text": listener.text.text, "finish_reason": _finish_reason(state)}]
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
                        if len(outcome["text"]) > len(sent[index]):
                            yield chunk(outcome["text"][len(sent[index]):], None, index=index)
                        yield chunk(None, outcome["finish_reason"] or "stop", index=index)
                    if include_usage and last:
                        yield _event({
                            "id": ident, "object": kind, "created": created, "model": model,
                            "choices": [], "usage": _usage(state)})
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


def _json_errors(view):
    """Every answer of a /v1 view in OpenAI's error shape, a failure's 500 included
    (Django's would be an HTML page, of which clients print only the status)."""
    @functools.wraps(view)
    async def wrapped(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        try:
            return await view(request, *args, **kwargs)
        except DisallowedHost:
            return _error(400, "this host is not allowed (KVOPS_ALLOWED_HOSTS)")
        except Exception as e:  # noqa: BLE001  (the client gets JSON whatever failed)
            log.exception("%s %s failed", request.method, request.path)
            return _error(500, f"internal error: {type(e).__name__}", type_="server_error")
    return csrf_exempt(wrapped)


def v1_view(method: str):
    """A /v1 view taking `method` only, for an authenticated caller (the view gets its
    user after the request), every answer in OpenAI's shape. The Host header is checked
    against ALLOWED_HOSTS here: /v1 runs without CommonMiddleware."""
    def wrap(view):
        @functools.wraps(view)
        async def checked(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            request.get_host()
            if request.method != method:
                return _error(405, f"use {method}")
            user = await _authenticate(request)
            if user is None:
                return _unauthorized()
            return await view(request, user, *args, **kwargs)
        return _json_errors(checked)
    return wrap


@v1_view("POST")
async def completions(request: HttpRequest, user) -> HttpResponse:
    return await _handle(request, user, chat=False)


@v1_view("POST")
async def chat_completions(request: HttpRequest, user) -> HttpResponse:
    return await _handle(request, user, chat=True)


def _model_entry(name: str, engines: list) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvops",
            "kvops_engines": engines}


@v1_view("GET")
async def models(request: HttpRequest, user) -> HttpResponse:
    served = await sync_to_async(selectors.served_models)()
    return JsonResponse({"object": "list", "data": [
        _model_entry(name, engines) for name, engines in sorted(served.items())]})


@v1_view("GET")
async def model(request: HttpRequest, user, model: str) -> HttpResponse:
    """GET /v1/models/<id>: one served model, or a 404 naming it."""
    served = await sync_to_async(selectors.served_models)()
    if model not in served:
        return _error(404, f"the model `{model}` does not exist (GET /v1/models lists those "
                           "served)", "model", code="model_not_found")
    return JsonResponse(_model_entry(model, served[model]))


@_json_errors
async def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """Any other /v1 path: a 404 in OpenAI's shape."""
    return _error(404, f"no such endpoint: {request.method} {request.path}",
                  code="unknown_url")


# --- /tokenize and /detokenize, as vLLM serves them ----------------------------------------

TOKENIZE_FIELDS = {"model", "prompt", "messages", "tools", "add_special_tokens",
                   "add_generation_prompt", "return_token_strs"}


async def _tokenizer_call(request: HttpRequest, fields: set[str]):
    """Common checks of the two endpoints: (body, engine config, tokenizer) or an error
    response."""
    try:
        body = _parse(request)
        unknown = sorted(set(body) - fields)
        if unknown:
            raise BadRequest(f"unknown field `{unknown[0]}`", unknown[0])
        model = body.get("model")
        config = await sync_to_async(_engine_config_of, thread_sensitive=False)(model)
    except BadRequest as e:
        return _error(400, str(e), e.param)
    except LookupError as e:
        return _error(404, str(e), "model", code="model_not_found")
    tokenizer = inspector.tokenizer(config)
    if tokenizer is None:
        return _error(503, f"the tokenizer of {model!r} is not readable from this web process "
                           "(its model folder is on the engine's machine)",
                      type_="service_unavailable")
    return body, config, tokenizer


def _engine_config_of(model: Any) -> dict:
    """The config of an engine serving `model` (BadRequest / LookupError as _check_model)."""
    return selectors.engines_serving(_check_model(model))[0].config


@v1_view("POST")
async def tokenize(request: HttpRequest, user) -> HttpResponse:
    """{"model", "prompt"} or {"model", "messages"} -> the token ids the engine will see:
    {"count", "max_model_len", "tokens"} (and "token_strs" if return_token_strs)."""
    checked = await _tokenizer_call(request, TOKENIZE_FIELDS)
    if isinstance(checked, HttpResponse):
        return checked
    body, config, tokenizer = checked
    try:
        add_special = _flag(body, "add_special_tokens", default=True)
        if "messages" in body:
            messages = body["messages"]
            if "prompt" in body or not isinstance(messages, list) or not messages:
                raise BadRequest("send `prompt` or a non-empty list of `messages`", "messages")
            if not _flag(body, "add_generation_prompt", default=True):
                raise BadRequest("only add_generation_prompt: true is supported",
                                 "add_generation_prompt")
            tools = body.get("tools")
            if tools is not None:  # checked as a chat's are; rendered as the engine's
                tool_calls.parse({"tools": tools, "tool_choice": "none"})
            tokens = prompt_ids(tokenizer, "", limits.messages(messages), tools)
        else:
            if "tools" in body:
                raise BadRequest("`tools` need `messages`", "tools")
            text = limits.prompt(body.get("prompt"))
            tokens = tokenizer.encode(text) if add_special \
                else tokenizer.encode(text, add_special_tokens=False)
        return_strs = _flag(body, "return_token_strs")
    except BadRequest as e:
        return _error(400, str(e), e.param)
    except (limits.InvalidParam, tool_calls.ToolError) as e:
        return _error(400, str(e), e.param)
    answer: dict[str, Any] = {"count": len(tokens), "max_model_len": config.get("max_model_len"),
                              "tokens": tokens}
    if return_strs:
        answer["token_strs"] = [tokenizer.decode([t]) for t in tokens]
    return JsonResponse(answer)


@v1_view("POST")
async def detokenize(request: HttpRequest, user) -> HttpResponse:
    """{"model", "tokens": [ids]} -> {"prompt": their text}."""
    checked = await _tokenizer_call(request, {"model", "tokens"})
    if isinstance(checked, HttpResponse):
        return checked
    body, config, tokenizer = checked
    tokens = body.get("tokens")
    vocab = config.get("vocab_size") or 2**31
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        return _error(400, f"`tokens` must be a list of token ids in [0, {vocab})", "tokens")
    return JsonResponse({"prompt": tokenizer.decode(tokens)})
