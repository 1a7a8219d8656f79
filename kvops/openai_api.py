"""OpenAI-compatible endpoints under /v1. Each call is a Job like any other, so it shows
up on the dashboard; answers and streams (server-sent events) are read from the job
stream (kvops/job_stream.py) through this process's hub. A client that disconnects
before its job ends cancels it."""
from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any, AsyncIterator

import msgspec
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.authtoken.models import Token

from kvops import grammar_check, json_body, limits, selectors, services, tool_calls
from kvops.admission import get_admissions
from kvops.api_handler import EventStream
from kvops.job_listener import JobFailed, JobListener, cancel_abandoned
from kvops.models import Job
from kvops.prompt_check import DoesNotFit, check_fits
from kvops.prompts import inspector, render_chat
from kvops.stream_hub import Subscription, get_hub
from kvops.throttles import TooManyJobs, allow_submission



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
_token_users: dict[str, tuple[float, Any]] = {}  # key -> (checked at, user)
_token_lookups: dict[tuple, asyncio.Future] = {}  # (event loop, key) -> its lookup under way


async def _authenticate(request: HttpRequest):
    """The user of the request's bearer token, or None. Tokens are looked up once every
    TOKEN_CACHE_S per key: a database read per call (a connection, under SQLite, opened
    for it) was the largest part of a /v1 call's cost."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    now = time.monotonic()
    cached = _token_users.get(key)
    if cached is not None and now - cached[0] < TOKEN_CACHE_S:
        return cached[1]
    # One lookup per key at a time: a burst of calls with a new key waits for the first
    # one's answer instead of each opening a database connection.
    slot = (asyncio.get_running_loop(), key)
    pending = _token_lookups.get(slot)
    if pending is None:
        pending = _token_lookups[slot] = asyncio.ensure_future(
            sync_to_async(_token_user, thread_sensitive=False)(key))
        pending.add_done_callback(lambda _: _token_lookups.pop(slot, None))
    user = await asyncio.shield(pending)
    if len(_token_users) > 10_000:  # keys that stopped coming are dropped now and then
        _token_users.clear()
    _token_users[key] = (now, user)
    return user


def _token_user(key: str):
    try:
        token = Token.objects.select_related("user").filter(key=key).first()
        return token.user if token is not None and token.user.is_active else None
    finally:
        close_old_connections()


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


# Every field a call may send: honoured, or refused with a 400 naming it; an unknown
# field is refused too (a typo must not pass for a default). vLLM's extra sampling fields
# (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority)
# are taken as vLLM takes them.
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p",
                 "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                 "response_format", "structured_outputs",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                 "logit_bias", "n", "priority", "user"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                               "tools", "tool_choice", "functions", "function_call",
                               "parallel_tool_calls"}
# Known fields not served yet, with the value that asks for nothing (accepted).
NOT_SUPPORTED = {"best_of": (1,), "suffix": ("",)}


def _sampling(body: dict, default_max_tokens: int, chat: bool) -> dict:
    _refuse_unknown(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    for name, nothing in NOT_SUPPORTED.items():
        if body.get(name) is not None and body[name] not in nothing:
            raise BadRequest(f"`{name}` is not supported", name)
    n = _number(body, "n", 1, 1, limits.MAX_N, integer=True)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BadRequest("`user` must be a string", "user")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    try:
        stop = limits.stop_strings(body.get("stop"))
        logit_bias = limits.logit_bias(body.get("logit_bias"))
    except limits.InvalidParam as e:
        raise BadRequest(str(e), e.param) from None
    top_k = body.get("top_k")
    top_p = _number(body, "top_p", 1.0, *limits.TOP_P)
    if top_p <= limits.TOP_P[0]:
        raise BadRequest(f"`top_p` must be greater than {limits.TOP_P[0]}", "top_p")
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or len(stop_token_ids) > limits.MAX_STOP_TOKEN_IDS \
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                       for t in stop_token_ids):
        raise BadRequest(f"`stop_token_ids` must be a list of at most "
                         f"{limits.MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
    logprobs = _logprobs(body, chat)
    structured = _structured(body)
    try:
        tools = tool_calls.parse(body) if chat else None
    except tool_calls.ToolError as e:
        raise BadRequest(str(e), e.param) from None
    if tools is not None:
        if structured is not None and tools["structured"] is not None:
            raise BadRequest("tool calls are constrained already: send `tools` or a "
                             "structured output, not both", "tools")
        if n > 1:
            raise BadRequest("tool calls with n > 1 are not served yet", "n")
        if tools["structured"] is not None:
            structured = limits.structured(tools["structured"], "tools")
    if not isinstance(body.get("parallel_tool_calls", True), bool):
        raise BadRequest("`parallel_tool_calls` must be a boolean", "parallel_tool_calls")
    repetition = _number(body, "repetition_penalty", 1.0, *limits.REPETITION_PENALTY)
    if repetition <= limits.REPETITION_PENALTY[0]:
        raise BadRequest("`repetition_penalty` must be greater than 0", "repetition_penalty")
    params = {
        "max_tokens": _number({"max_tokens": max_tokens}, "max_tokens", default_max_tokens, 1,
                              limits.MAX_TOKENS, integer=True),
        "temperature": float(_number(body, "temperature", 1.0, *limits.TEMPERATURE)),
        "top_p": float(top_p),
        "top_k": None if top_k in (None, -1, 0) else _number(body, "top_k", None, 1,
                                                              limits.TOP_K_MAX, integer=True),
        "seed": _number(body, "seed", None, 0, limits.SEED_MAX, integer=True),
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "ignore_eos": _flag(body, "ignore_eos"),
        "min_tokens": _number(body, "min_tokens", 0, 0, limits.MAX_TOKENS, integer=True),
        "min_p": float(_number(body, "min_p", 0.0, *limits.MIN_P)),
        "presence_penalty": float(_number(body, "presence_penalty", 0.0, *limits.PENALTY)),
        "frequency_penalty": float(_number(body, "frequency_penalty", 0.0, *limits.PENALTY)),
        "repetition_penalty": float(repetition),
        "logit_bias": logit_bias,
        "logprobs": logprobs,
        "structured": structured,
        "n": n,
    }
    try:
        limits.sampling_params(params)
    except limits.InvalidParam as e:
        raise BadRequest(str(e), e.param) from None
    if tools is not None:  # the worker keeps this for the prompt and the answer
        params["tool_call"] = {"kind": tools["kind"], "names": tools["names"],
                               "tools": body["tools"]}
    return params


def _refuse_unknown(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown field `{unknown[0]}`", unknown[0])


def _structured(body: dict) -> dict | None:
    """OpenAI's `response_format` (json_object, or json_schema with its schema) or vLLM's
    `structured_outputs` (json, json_object, regex, choice or grammar): the constraint
    the engine applies (engine/structured.py), its shape and size checked here (whether
    it compiles: kvops/grammar_check.py, off the event loop)."""
    response_format, vllm = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and vllm is not None:
        raise BadRequest("send `response_format` or `structured_outputs`, not both",
                         "structured_outputs")
    param, spec = "structured_outputs", vllm
    if response_format is not None:
        param = "response_format"
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            spec = {"json_object": True}
        elif kind == "json_schema":
            json_schema = response_format.get("json_schema")
            if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"),
                                                                   dict):
                raise BadRequest("`response_format.json_schema.schema` must be a JSON schema "
                                 "object", param)
            spec = {"json": json_schema["schema"]}
        else:
            raise BadRequest("`response_format.type` must be text, json_object or "
                             "json_schema", param)
    try:
        return limits.structured(spec, param)
    except limits.InvalidParam as e:
        raise BadRequest(str(e), e.param) from None


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many most likely tokens to report per sampled token, or None: completions'
    `logprobs` (an integer), chat's `logprobs` (a boolean) with `top_logprobs`."""
    if chat:
        if not _flag(body, "logprobs"):
            if body.get("top_logprobs") not in (None, 0):
                raise BadRequest("`top_logprobs` needs `logprobs: true`", "top_logprobs")
            return None
        return _number(body, "top_logprobs", 0, 0, limits.MAX_LOGPROBS, integer=True)
    return _number(body, "logprobs", None, 0, limits.MAX_LOGPROBS, integer=True)


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"`{name}` must be a boolean", name)
    return value


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
        raise BadRequest(str(e)) from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _calls_tools(model: str) -> bool:
    """Does the chat template of this model's engines write tool calls the way `auto`
    parses them? (An engine whose tokenizer is not readable here is given the benefit of
    the doubt.)"""
    for engine in selectors.engines_serving(model):
        tokenizer = inspector.tokenizer(engine.config)
        if tokenizer is None or tool_calls.template_calls_tools(
                getattr(tokenizer, "chat_template", None)):
            return True
    return False


def _simulated_only(model: str) -> bool:
    """Are all the live engines that serve this model simulators?"""
    return all(e.config.get("simulate") for e in selectors.engines_serving(model))


def _check_model(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required", "model")
    if model not in selectors.served_models():
        raise LookupError(f"model {model!r} is not served here; GET /v1/models lists them")
    return model


def _checks(model: Any, chat: bool, structured_param: str = "structured_outputs"):
    """The checks a call passes before it is stored (run in the admission batch)."""
    def check(new: services.NewJob) -> None:
        _check_model(model)
        if new.params.get("prompt_logprobs") is not None and _simulated_only(model):
            raise BadRequest("`echo` with `logprobs` needs the prompt's logprobs, which a "
                             f"model with logits computes; the engines serving {model!r} "
                             "simulate one", "echo")
        tool_call = new.params.get("tool_call")
        if tool_call is not None and tool_call["kind"] == "auto" and not _calls_tools(model):
            raise BadRequest(f"tool_choice \"auto\" (the default with tools) needs a chat "
                             f"template that writes tool calls ({tool_calls.CALL_START}...); "
                             f"{model!r}'s does not: send tool_choice \"required\" or a named "
                             "function", "tool_choice")
        if new.params.get("structured") and _simulated_only(model):
            raise BadRequest("structured output needs a model with logits; the engines "
                             f"serving {model!r} simulate one", structured_param)
        try:
            check_fits(new.prompt, new.messages, new.params, model=model)
        except DoesNotFit as e:
            raise BadRequest(str(e), e.param) from None
    return check


async def _admit(user, sub: Subscription, model: Any, chat: bool, kwargs: dict,
                 structured_param: str = "structured_outputs") -> Job:
    """Check the model and the prompt's length, store the job, and bind the listener to
    it before the commit dispatches it (so the listener sees every update). Calls that
    arrive together are stored together (kvops/admission.py)."""
    new = services.NewJob(user, source=Job.Source.OPENAI, **kwargs)
    return await get_admissions().admit(new, _checks(model, chat, structured_param),
                                        lambda job: sub.hub.bind(sub, job.pk))


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
                     state.get("num_cached_tokens", 0))


def _usage_of(prompt: int, output: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": output,
            "total_tokens": prompt + output, "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_reason(state: dict) -> str | None:
    return state.get("finish_reason") or None


async def _handle(request: HttpRequest, chat: bool) -> HttpResponse:
    request.get_host()  # ALLOWED_HOSTS (no CommonMiddleware on /v1): 400 if not allowed
    if request.method != "POST":
        return _error(405, "use POST")
    user = await _authenticate(request)
    if user is None:
        return _unauthorized()
    if not user.is_staff:
        wait = await sync_to_async(allow_submission)(user)
        if wait is not None:
            rate = settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["jobs"]
            response = _error(429, f"too many requests: at most {rate} (KVOPS_JOB_RATE); "
                                   f"retry in {wait:.0f} s", type_="rate_limit_exceeded",
                              code="rate_limit_exceeded")
            response["Retry-After"] = str(max(1, round(wait)))
            return response
    try:
        body = _parse(request)
        model = body.get("model")
        kwargs: dict[str, Any] = {"priority": 0, "engine": ""}
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("`messages` must be a non-empty list", "messages")
            kwargs["messages"] = [_message(m) for m in messages]
        else:
            kwargs["prompt"] = _prompt(body.get("prompt"))
        kwargs["params"] = _sampling(body, default_max_tokens=256 if chat else 16, chat=chat)
        kwargs["priority"] = limits.priority(body.get("priority"), user.is_staff)
        stream = _flag(body, "stream")
        stream_options = _stream_options(body, stream)
        echo = "" if chat or not _flag(body, "echo") else kwargs["prompt"]
        if echo and kwargs["params"]["logprobs"] is not None:  # the prompt's too (vLLM's
            kwargs["params"]["prompt_logprobs"] = kwargs["params"]["logprobs"]  # way)
        structured_param = "tools" if kwargs["params"].get("tool_call") \
            else "response_format" if "response_format" in body else "structured_outputs"
        await grammar_check.check_async(kwargs["params"]["structured"], structured_param,
                                        model=model if isinstance(model, str) else None)
        sub = await get_hub().open()
        try:
            job = await _admit(user, sub, model, chat, kwargs, structured_param)
        except BaseException:
            sub.close()
            raise
    except BadRequest as e:
        return _error(400, str(e), e.param)
    except limits.NotAllowed as e:
        return _error(403, str(e), e.param, type_="permission_error")
    except limits.InvalidParam as e:
        return _error(400, str(e), e.param)
    except LookupError as e:
        return _error(404, str(e), "model", code="model_not_found")
    except (services.Unavailable, grammar_check.Busy) as e:
        return _error(503, str(e), type_="service_unavailable")
    except TooManyJobs as e:
        return _error(429, str(e), type_="rate_limit_exceeded", code="too_many_jobs")
    created = int(time.time())
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{job.pk}"
    listener = JobListener(sub, job)
    sub.on_cut_off = partial(cancel_abandoned, job.pk)
    if stream:
        return EventStream(_sse(listener, ident, model, created, chat,
                                job.params.get("logprobs") is not None,
                                n=job.params.get("n") or 1, echo=echo,
                                tool_call=job.params.get("tool_call"),
                                call_id=f"call_{job.pk}", **stream_options))
    try:
        async for _ in listener.updates():
            pass
    except JobFailed as e:
        cancel_abandoned(job.pk)
        return _error(500, f"the job's updates were lost: {e}", type_="server_error")
    except asyncio.CancelledError:  # the client disconnected
        cancel_abandoned(job.pk)
        raise
    finally:
        sub.close()
    state = listener.state
    if state.get("status") == Job.Status.FAILED:
        return _error(500, f"the job failed: {state.get('error')}", type_="server_error")
    # n > 1: every sample's outcome is in the row's `samples`
    outcomes = state.get("samples") or [{"text": listener.text.text,
                                         "finish_reason": _finish_reason(state)}]
    choices = []
    for index, outcome in enumerate(outcomes):
        choice: dict[str, Any] = {"index": index,
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
    return JsonResponse({"id": ident, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": model, "choices": choices,
                         "usage": _usage(state), "kvops_job_id": job.pk})


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
               call_id: str = "") -> AsyncIterator[str]:
    """The job's output as server-sent events: each chunk holds all the text produced
    since the previous one, and chunks are spaced so that a web process sends at most
    KVOPS_SSE_MAX_CHUNKS_PER_S of them, however many streams it serves. include_usage
    adds a last chunk with the usage (no choices), continuous_usage_stats the usage so
    far to every chunk (stream_options). With n > 1 each sample's chunks carry its
    `index`. `echo` (completions): the prompt, sent first. With a tool call the text is
    the call: a named function's arguments stream as tool_calls deltas; a `required`
    list of calls is sent whole once it is complete."""
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
            choice = {"index": index, "delta": delta, "finish_reason": finish,
                      "logprobs": entries}
        else:
            choice = {"index": index, "text": delta_text or "", "finish_reason": finish,
                      "logprobs": entries}
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
                    if include_usage:
                        yield _event({
                            "id": ident, "object": kind, "created": created, "model": model,
                            "choices": [], "usage": _usage(state)})
        except JobFailed as e:
            yield error(f"the job's updates were lost: {e}")
        except _Diverged:
            yield error("the job ran again after its engine stopped, and its new output "
                        "differs from what was streamed; retry the request")
        yield b"data: [DONE]\n\n"
    finally:
        listener.sub.close()
        if not listener.finished:  # the client went away, or the stream broke
            cancel_abandoned(listener.job_id)


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    return await _handle(request, chat=False)


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _handle(request, chat=True)


async def models(request: HttpRequest) -> HttpResponse:
    request.get_host()
    user = await _authenticate(request)
    if user is None:
        return _unauthorized()
    served = await sync_to_async(selectors.served_models)()
    return JsonResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "kvops",
         "kvops_engines": engines} for name, engines in sorted(served.items())]})


# --- /tokenize and /detokenize, as vLLM serves them ----------------------------------------

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens",
                   "add_generation_prompt", "return_token_strs"}


async def _tokenizer_call(request: HttpRequest, fields: set[str]):
    """Common checks of the two endpoints: (body, engine config, tokenizer) or an error
    response."""
    request.get_host()
    if request.method != "POST":
        return _error(405, "use POST")
    user = await _authenticate(request)
    if user is None:
        return _unauthorized()
    try:
        body = _parse(request)
        _refuse_unknown(body, fields)
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


@csrf_exempt
async def tokenize(request: HttpRequest) -> HttpResponse:
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
            text = render_chat(tokenizer, [_message(m) for m in messages])
            tokens = tokenizer.encode(text)
        else:
            text = _prompt(body.get("prompt"))
            tokens = tokenizer.encode(text) if add_special \
                else tokenizer.encode(text, add_special_tokens=False)
        return_strs = _flag(body, "return_token_strs")
    except BadRequest as e:
        return _error(400, str(e), e.param)
    answer: dict[str, Any] = {"count": len(tokens), "max_model_len": config.get("max_model_len"),
                              "tokens": tokens}
    if return_strs:
        answer["token_strs"] = [tokenizer.decode([t]) for t in tokens]
    return JsonResponse(answer)


@csrf_exempt
async def detokenize(request: HttpRequest) -> HttpResponse:
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
