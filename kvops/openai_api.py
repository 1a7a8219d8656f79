"""OpenAI-compatible endpoints under /v1. Each call is a Job like any other, so it shows
up on the dashboard; streaming reads the job's channel group (server-sent events)."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.authtoken.models import Token

from kvops import limits, live, selectors, services
from kvops.models import Job
from kvops.prompt_check import PromptTooLong, check_prompt_fits

POLL_S = 2.0  # also re-read the job row this often, in case a message was lost


def _error(status: int, message: str, param: str | None = None,
           type_: str = "invalid_request_error", code: str | None = None) -> JsonResponse:
    return JsonResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}}, status=status)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@sync_to_async
def _authenticate(request: HttpRequest):
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    token = Token.objects.select_related("user").filter(key=key.strip()).first()
    if token is None or not token.user.is_active:
        return None
    return token.user


def _number(body: dict, name: str, default: float, lo: float, hi: float,
            integer: bool = False) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not (lo <= value <= hi):
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"`{name}` must be {kind} in [{lo}, {hi}]", name)
    return value


def _sampling(body: dict, default_max_tokens: int) -> dict:
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest("only n=1 is supported", "n")
    harmless = {"best_of": (None, 1), "echo": (None, False), "logprobs": (None, False),
                "top_logprobs": (None, 0), "logit_bias": (None, {}), "tools": (None, []),
                "functions": (None, []), "suffix": (None, ""), "response_format": (None,)}
    for name, allowed in harmless.items():
        if name in body and body[name] not in allowed:
            raise BadRequest(f"`{name}` is not supported", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise BadRequest(f"`{name}` is not supported (only 0)", name)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 8 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("`stop` must be a string or a list of up to 8 non-empty strings", "stop")
    top_k = body.get("top_k")
    return {
        "max_tokens": _number({"max_tokens": max_tokens}, "max_tokens", default_max_tokens, 1,
                              limits.MAX_TOKENS, integer=True),
        "temperature": float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        "top_p": float(_number(body, "top_p", 1.0, 1e-9, 1.0)),
        "top_k": None if top_k in (None, -1, 0) else _number(body, "top_k", None, 1, 1_000_000,
                                                              integer=True),
        "seed": _number(body, "seed", None, 0, 2**63 - 1, integer=True),
        "stop": stop,
        "stop_token_ids": [],
        "ignore_eos": bool(body.get("ignore_eos", False)),
    }


def _parse(request: HttpRequest) -> dict:
    try:
        body = json.loads(request.body or b"null")
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


@sync_to_async
def _check_model(model: Any) -> str:
    served = selectors.served_models()
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required", "model")
    if model not in served:
        raise LookupError(f"model {model!r} is not served here; GET /v1/models lists them")
    return model


@sync_to_async
def _create(user, **kwargs) -> Job:
    with transaction.atomic():
        return services.create_job(user, source=Job.Source.OPENAI, **kwargs)


@sync_to_async
def _reload(job_id: int) -> Job:
    return Job.objects.get(pk=job_id)


async def _job_updates(job: Job) -> AsyncIterator[dict]:
    """Cumulative job states until the job ends: from its channel group, and from the
    database every POLL_S in case a message was missed."""
    layer = get_channel_layer()
    channel = await layer.new_channel()
    group = live.job_group(job.pk)
    await layer.group_add(group, channel)
    try:
        # Anything published before we joined the group is in the row already.
        message = services.job_payload(await _reload(job.pk))
        yield message
        if message["finished"]:
            return
        while True:
            try:
                message = await asyncio.wait_for(layer.receive(channel), timeout=POLL_S)
            except asyncio.TimeoutError:
                fresh = await _reload(job.pk)
                message = services.job_payload(fresh)
            yield message
            if message.get("finished"):
                return
    finally:
        await layer.group_discard(group, channel)


def _usage(job: Job) -> dict:
    return {"prompt_tokens": job.num_prompt_tokens, "completion_tokens": job.num_output_tokens,
            "total_tokens": job.num_prompt_tokens + job.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": job.num_cached_tokens}}


def _finish_reason(job: Job) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(job.finish_reason,
                                                                      job.finish_reason or None)


async def _handle(request: HttpRequest, chat: bool) -> HttpResponse:
    if request.method != "POST":
        return _error(405, "use POST")
    user = await _authenticate(request)
    if user is None:
        return _error(401, "missing or invalid API key: send `Authorization: Bearer <token>`",
                      type_="authentication_error", code="invalid_api_key")
    try:
        body = _parse(request)
        model = await _check_model(body.get("model"))
        kwargs: dict[str, Any] = {"priority": 0, "engine": ""}
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("`messages` must be a non-empty list", "messages")
            kwargs["messages"] = [_message(m) for m in messages]
        else:
            kwargs["prompt"] = _prompt(body.get("prompt"))
        kwargs["params"] = _sampling(body, default_max_tokens=256 if chat else 16)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("`stream` must be a boolean", "stream")
        try:
            await sync_to_async(check_prompt_fits)(kwargs.get("prompt", ""),
                                                   kwargs.get("messages"))
        except PromptTooLong as e:
            raise BadRequest(str(e), "messages" if chat else "prompt") from None
    except BadRequest as e:
        return _error(400, str(e), e.param)
    except LookupError as e:
        return _error(404, str(e), "model", code="model_not_found")
    job = await _create(user, **kwargs)
    created = int(time.time())
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{job.pk}"
    if stream:
        response = StreamingHttpResponse(_sse(job, ident, model, created, chat),
                                         content_type="text/event-stream")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
        return response
    async for _ in _job_updates(job):
        pass
    job = await _reload(job.pk)
    if job.status == Job.Status.FAILED:
        return _error(500, f"the job failed: {job.error}", type_="server_error")
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish_reason(job), "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": job.output_text}
    else:
        choice["text"] = job.output_text
    return JsonResponse({"id": ident, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": model, "choices": [choice],
                         "usage": _usage(job), "kvops_job_id": job.pk})


def _message(m: Any) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
        raise BadRequest("each message needs a `role` of system, user or assistant", "messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise BadRequest("only text content parts are supported", "messages")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise BadRequest("message `content` must be a string", "messages")
    if len(content) > limits.MAX_PROMPT_CHARS:
        raise BadRequest("message content is too long", "messages")
    return {"role": m["role"], "content": content}


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("`prompt` must be a non-empty string", "prompt")
    if len(prompt) > limits.MAX_PROMPT_CHARS:
        raise BadRequest(f"`prompt` is longer than {limits.MAX_PROMPT_CHARS} characters", "prompt")
    return prompt


async def _sse(job: Job, ident: str, model: str, created: int, chat: bool) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if delta_text:
                delta["content"] = delta_text
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": finish,
                      "logprobs": None}
        data = {"id": ident, "object": kind, "created": created, "model": model,
                "choices": [choice]}
        return f"data: {json.dumps(data)}\n\n"

    if chat:
        yield chunk(None, None, first=True)
    sent = 0
    async for update in _job_updates(job):
        text = update.get("text") or ""
        if len(text) > sent:
            yield chunk(text[sent:], None)
            sent = len(text)
    job = await _reload(job.pk)
    if len(job.output_text) > sent:
        yield chunk(job.output_text[sent:], None)
    if job.status == Job.Status.FAILED:
        err = {"error": {"message": f"the job failed: {job.error}", "type": "server_error"}}
        yield f"data: {json.dumps(err)}\n\n"
    else:
        yield chunk(None, _finish_reason(job) or "stop")
    yield "data: [DONE]\n\n"


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    return await _handle(request, chat=False)


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _handle(request, chat=True)


async def models(request: HttpRequest) -> HttpResponse:
    user = await _authenticate(request)
    if user is None:
        return _error(401, "missing or invalid API key: send `Authorization: Bearer <token>`",
                      type_="authentication_error", code="invalid_api_key")
    served = await sync_to_async(selectors.served_models)()
    return JsonResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "kvops",
         "kvops_engines": engines} for name, engines in sorted(served.items())]})
