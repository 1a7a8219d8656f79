"""POST /v1/responses and GET /v1/responses/<id>: OpenAI's Responses API, as vLLM
serves it, on the chat path.

A call's `input` (a string, or items: messages, the model's earlier function calls and
their outputs), `instructions`, `tools`, `tool_choice`, `text.format` and
`max_output_tokens` become a chat completion's body, parsed by the same intake
(kvops/intake/intake.py) under the same rules, so a response is a job like any other (its page,
its KV map, operator actions, limits). `previous_response_id` continues a stored
response of the same user: its conversation (without its instructions, as OpenAI does)
and its output come before the new input. A response is stored unless `store` is false:
its job keeps the conversation and the output, and `resp_<job id>` names it.

The answer is a Response object: a `message` item with the text, or `function_call`
items; streamed, the Responses events (`response.created`, `response.output_text.delta`,
... `response.completed`), each with its `sequence_number`.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from functools import partial
from typing import Any, AsyncIterator

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse

from kvops.intake import intake, limits, tool_calls
from kvops.intake.limits import InvalidParam
from kvops.jobs import idempotency, job_store
from kvops.jobs.job_listener import JobFailed, JobListener, cancel_abandoned
from kvops.models import Job
from kvops.openai import base, errors
from kvops.openai.handler import EventStream

RESPONSE_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature",
                   "top_p", "tools", "tool_choice", "parallel_tool_calls", "text", "stream",
                   "store", "previous_response_id", "metadata", "user", "service_tier",
                   "reasoning", "truncation", "include", "top_logprobs", "seed", "stop",
                   "priority", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "ignore_eos"}
# Chat fields that take a Responses field's place: errors name the Responses one.
_RENAMED = {"max_tokens": "max_output_tokens", "messages": "input",
            "response_format": "text.format"}
PREFIX = "resp_"
_RESPONSE_ID = re.compile(PREFIX + r"[0-9]{1,18}")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class NotStored(Exception):
    """previous_response_id names no response of this user that was stored."""


# --- the request: a chat body ------------------------------------------------------------------
def chat_body(body: dict, history: list[dict]) -> dict:
    """The chat completion a Responses call asks for (`history`: the conversation of the
    response it continues, its output included)."""
    unknown = sorted(set(body) - RESPONSE_FIELDS)
    if unknown:
        raise InvalidParam(unknown[0], f"unknown field `{unknown[0]}`")
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidParam("truncation", "`truncation` \"auto\" is not supported: a prompt "
                                         "longer than the model takes is refused")
    include = body.get("include") or []
    if not isinstance(include, list) or any(i != LOGPROBS_INCLUDE for i in include):
        raise InvalidParam("include", f"`include` may ask for {LOGPROBS_INCLUDE!r} only: "
                                      "kvops produces no other additional output")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise InvalidParam("reasoning", "`reasoning` must be an object")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": [
        *instructions(body.get("instructions")), *history, *input_messages(body.get("input"))]}
    for name in ("temperature", "top_p", "seed", "stop", "priority", "top_k", "min_p",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
                 "metadata", "user", "service_tier", "store", "parallel_tool_calls"):
        if name in body:
            chat[name] = body[name]
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("top_logprobs") is not None or include:
        chat["logprobs"] = True
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidParam("tools", "`tools` must be a list")
    if tools:  # an empty list is no tools (the Agents SDK sends one)
        chat["tools"] = [_chat_tool(t) for t in tools]
    choice = body.get("tool_choice")
    if choice is not None and (tools or choice not in ("auto", "none")):
        chat["tool_choice"] = _chat_tool_choice(choice)
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise InvalidParam("text", "`text` must be an object")
        chat_format = _response_format(text.get("format"))
        if chat_format is not None:
            chat["response_format"] = chat_format
    return chat


def instructions(value: Any) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, str):
        raise InvalidParam("instructions", "`instructions` must be a string")
    return [{"role": "system", "content": value}]


def input_messages(value: Any) -> list[dict]:
    """`input` as chat messages: a string is a user message; message items keep their
    role; consecutive function_call items are one assistant message's tool_calls; a
    function_call_output is a tool message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    items = _list("input", value)
    out: list[dict] = []
    for item in items:
        if not isinstance(item, dict):
            raise InvalidParam("input", "each `input` item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            for field in ("call_id", "name"):
                if not isinstance(item.get(field), str) or not item[field]:
                    raise InvalidParam("input", f"a function_call item needs a `{field}` "
                                                "(a non-empty string)")
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") \
                    and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise InvalidParam("input", "a function_call_output item needs the `call_id` "
                                            "of the function_call it answers")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise InvalidParam("input", f"`input` items of type {kind!r} are not supported "
                                        "(message, function_call, function_call_output are)")
    return out


def _text(content: Any) -> Any:
    """A message item's content: a string, or its input_text / output_text parts."""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in
                    ("input_text", "output_text", "text") and isinstance(part.get("text"), str)):
                raise InvalidParam("input", "only text content parts (input_text, "
                                            "output_text) are supported")
            parts.append(part["text"])
        return "".join(parts)
    return content


def _list(name: str, value: Any) -> list:
    if not isinstance(value, list) or not value:
        raise InvalidParam(name, f"`{name}` must be a string or a non-empty list"
                           if name == "input" else f"`{name}` must be a non-empty list")
    return value


def _chat_tool(tool: Any) -> dict:
    """A Responses function tool ({"type", "name", "parameters", ...}) as chat's."""
    if not (isinstance(tool, dict) and tool.get("type") == "function"):
        raise InvalidParam("tools", "only function tools are supported: {\"type\": "
                                    "\"function\", \"name\": ..., \"parameters\": {...}}")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(fmt: Any) -> dict | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise InvalidParam("text.format", "`text.format` must be text, json_object or "
                                      "json_schema")


def parse(body: dict, owner, idempotency_key: str, history: list[dict]) -> intake.NewJob:
    """The Responses call as a chat's NewJob (errors name the Responses fields)."""
    try:
        new = intake.parse_chat(chat_body(body, history), owner, idempotency_key)
    except InvalidParam as e:
        param = _RENAMED.get(e.param, e.param)
        message = str(e).replace(f"`{e.param}`", f"`{param}`") if param != e.param else str(e)
        raise InvalidParam(param, message) from None
    limits.flag("store", body.get("store"))
    # what the checks against the engines refuse, they name as this API does
    new.fields.update({"messages": "input", "structured": "text.format"})
    new.params["response"] = {
        # what the Response repeats of its request
        "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "text": body.get("text") or {"format": {"type": "text"}},
        "store": body.get("store", True) is not False,
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "metadata": intake.metadata(body.get("metadata"))}
    return new


# --- stored responses ----------------------------------------------------------------------
def job_id_of(response_id: Any, field: str) -> int:
    """The job id in a response id ("resp_<digits>"); InvalidParam naming `field` for
    anything else (ASCII digits only: "²".isdigit() is True, and int() refuses it; at
    most 18, so that the id fits the database's integer)."""
    if not isinstance(response_id, str) or not _RESPONSE_ID.fullmatch(response_id):
        raise InvalidParam(field, f"`{field}` must be a response id, {PREFIX} followed by "
                                  f"digits (not {str(response_id)[:40]!r})")
    return int(response_id[len(PREFIX):])


def history_of(response_id: Any, owner) -> list[dict]:
    """The conversation a stored response of `owner` ends with, its output included, for
    a call that continues it (its instructions left out, as OpenAI leaves them)."""
    job_id = job_id_of(response_id, "previous_response_id")
    job = Job.objects.filter(pk=job_id, owner=owner).first()
    meta = (job.params or {}).get("response") if job is not None else None
    if meta is None or not meta.get("store"):
        raise NotStored(f"no stored response {response_id!r}")
    if job.status != Job.Status.FINISHED:
        raise NotStored(f"response {response_id!r} is {job.status}, not completed")
    messages = list(job.messages or [])
    if meta.get("instructions") is not None and messages and messages[0]["role"] == "system":
        messages = messages[1:]
    return messages + _output_messages(job)


def _output_messages(job: Job) -> list[dict]:
    """A finished job's output as the chat messages that continue its conversation."""
    items = output_items(job.pk, job.output_text, (job.params or {}).get("tool_call"))
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


# --- the answer -------------------------------------------------------------------------------
def output_items(job_id: int, text: str, tool_call: dict | None, status: str = "completed",
                 logprobs: list | None = None) -> list[dict]:
    """The Response's `output`: a message with the text (its logprobs if asked),
    function_call items for the calls the answer makes (auto: any text before them as a
    message too)."""
    calls = []
    if tool_call is not None:
        try:
            calls = tool_calls.calls_of(tool_call, text, f"call_{job_id}")
        except ValueError:  # cut off by the token limit: the text as it is
            calls = []
        if calls and tool_call["kind"] == "auto":
            text = tool_calls.split_auto(text, tool_call)[0] or ""
        elif calls:
            text = ""
    items: list[dict] = []
    if text or not calls:
        items.append(_message_item(job_id, text, status, logprobs if not calls else None))
    for i, call in enumerate(calls):
        items.append({"type": "function_call", "id": f"fc_{job_id}_{i}",
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def _message_item(job_id: int, text: str, status: str = "completed",
                  logprobs: list | None = None) -> dict:
    return {"type": "message", "id": f"msg_{job_id}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": _logprobs(logprobs or [])}]}


def _logprobs(entries: list) -> list[dict]:
    """The job's logprob entries ([token, logprob, [[token, logprob], ...]]) in the
    Responses API's shape."""
    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return [{**one(e[0], e[1]), "top_logprobs": [one(t, lp) for t, lp in (e[2] or [])]}
            for e in entries]


def response_object(job_id: int, state: dict, text: str, created: int,
                    model: str, params: dict, status: str | None = None,
                    logprobs: list | None = None) -> dict:
    meta = params.get("response") or {}
    finish = state.get("finish_reason")
    failed = state.get("status") == Job.Status.FAILED
    if status is None:
        status = "failed" if failed else "incomplete" if finish == "length" else "completed"
    output = [] if status in ("in_progress", "failed") else \
        output_items(job_id, text, params.get("tool_call"), status, logprobs)
    prompt, cached = state.get("num_prompt_tokens") or 0, state.get("num_cached_tokens") or 0
    produced = state.get("num_output_tokens") or 0
    return {
        "id": f"{PREFIX}{job_id}", "object": "response", "created_at": created,
        "status": status, "model": model, "output": output,
        "output_text": "".join(p["text"] for i in output if i["type"] == "message"
                               for p in i["content"]),
        "error": {"code": "server_error", "message": state.get("error") or "failed"}
        if failed else None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": meta.get("instructions"), "metadata": meta.get("metadata") or {},
        "previous_response_id": meta.get("previous_response_id"),
        "max_output_tokens": params.get("max_tokens"),
        "temperature": params.get("temperature"), "top_p": params.get("top_p"),
        "parallel_tool_calls": meta.get("parallel_tool_calls", True),
        "tool_choice": meta.get("tool_choice", "auto"), "tools": meta.get("tools", []),
        "store": meta.get("store", True), "text": meta.get("text", {"format": {"type": "text"}}),
        "usage": {"input_tokens": prompt, "input_tokens_details": {
                      "cached_tokens": cached,
                      **({"cached_tokens_by_tier": state["cached_tokens_by_tier"]}
                         if state.get("cached_tokens_by_tier") else {})},
                  "output_tokens": produced,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt + produced},
        "kvops_job_id": job_id}


# --- the endpoints ------------------------------------------------------------------------------
@base.v1_view("POST")
async def responses(request: HttpRequest, user) -> HttpResponse:
    refusal = await base.rate_limited(user)
    if refusal is not None:
        return refusal
    try:
        key = idempotency.key_of(request.headers)
        body = base.parse_body(request)
        previous = body.get("previous_response_id")
        history = [] if previous is None else \
            await sync_to_async(history_of, thread_sensitive=False)(previous, user)
        new = parse(body, user, key, history)
        stream = base.flag(body, "stream")
        jobs, subs = await base.admit([new])
    except NotStored as e:
        return errors.error(404, str(e), "previous_response_id",
                            code="response_not_found")
    except Exception as e:  # noqa: BLE001  (the chat path's refusals, the same way)
        refusal = errors.refusal(e)
        if refusal is None:
            raise
        return refusal
    job, sub = jobs[0], subs[0]
    created = int(time.time())
    listener = JobListener(sub, job)
    sub.on_cut_off = partial(cancel_abandoned, job.pk)
    if stream:
        return EventStream(_events(listener, job, new.model, created))
    try:
        async for _ in listener.updates():
            pass
    except JobFailed as e:
        cancel_abandoned(job.pk)
        return errors.error(500, f"the job's updates were lost: {e}",
                            type_="server_error")
    except asyncio.CancelledError:
        cancel_abandoned(job.pk)
        raise
    finally:
        sub.close()
    state = listener.state
    return JsonResponse(response_object(job.pk, state, listener.text.text, created,
                                        new.model, job.params,
                                        logprobs=listener.logprobs_of(0)))


@base.v1_view("GET")
async def response(request: HttpRequest, user, response_id: str) -> HttpResponse:
    """GET /v1/responses/<id>: a stored response of the caller's."""

    try:
        job_id = job_id_of(response_id, "response_id")
    except InvalidParam as e:
        return errors.error(400, str(e), e.param)

    def read() -> Job | None:
        job = Job.objects.filter(pk=job_id, owner=user).first()
        meta = (job.params or {}).get("response") if job is not None else None
        return job if meta is not None and meta.get("store") else None

    job = await sync_to_async(read, thread_sensitive=False)()
    if job is None:
        return errors.error(404, f"no stored response {response_id!r}", "response_id",
                            code="response_not_found")
    status = "in_progress" if job.status in (Job.Status.QUEUED, Job.Status.RUNNING) else None
    # (the state its answer had: the cached tokens by tier from the story in its row)
    state = job_store.job_payload(job)
    return JsonResponse(response_object(job.pk, state, job.output_text,
                                        int(job.queued_at.timestamp()), job.model,
                                        job.params or {}, status, job.output_logprobs))


async def _events(listener: JobListener, job: Job, model: str,
                  created: int) -> AsyncIterator[bytes]:
    """The Responses stream: created and in_progress, the message item with its text's
    deltas as the job produces it (with tools: its items whole at the end, once the calls
    are known), then completed (or incomplete, failed) with the whole response."""
    seq = 0

    def event(kind: str, **fields) -> bytes:
        nonlocal seq
        doc = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(doc).encode() + b"\n\n"

    params = job.params or {}
    streaming_text = params.get("tool_call") is None
    item_id = f"msg_{job.pk}"
    sent = ""
    state: dict = {"status": "in_progress"}
    try:
        begun = response_object(job.pk, state, "", created, model, params, "in_progress")
        yield event("response.created", response=begun)
        yield event("response.in_progress", response=begun)
        if streaming_text:
            yield event("response.output_item.added", output_index=0,
                        item=_message_item(job.pk, "", "in_progress") | {"content": []})
            yield event("response.content_part.added", item_id=item_id, output_index=0,
                        content_index=0, part={"type": "output_text", "text": "",
                                               "annotations": [], "logprobs": []})
        try:
            async for _ in listener.updates():
                text = listener.text.text
                if streaming_text and len(text) > len(sent):
                    yield event("response.output_text.delta", item_id=item_id,
                                output_index=0, content_index=0, delta=text[len(sent):],
                                logprobs=[])
                    sent = text
        except JobFailed as e:
            state = {"status": Job.Status.FAILED, "error": f"the job's updates were lost: {e}"}
        else:
            state = listener.state
        final = response_object(job.pk, state, listener.text.text, created, model, params,
                                logprobs=listener.logprobs_of(0))
        if final["status"] == "failed":
            yield event("response.failed", response=final)
            return
        if streaming_text:
            text = final["output"][0]["content"][0]["text"] if final["output"] else sent
            if len(text) > len(sent):
                yield event("response.output_text.delta", item_id=item_id, output_index=0,
                            content_index=0, delta=text[len(sent):], logprobs=[])
            yield event("response.output_text.done", item_id=item_id, output_index=0,
                        content_index=0, text=text, logprobs=[])
            yield event("response.content_part.done", item_id=item_id, output_index=0,
                        content_index=0, part=final["output"][0]["content"][0])
            yield event("response.output_item.done", output_index=0, item=final["output"][0])
        else:
            for index, item in enumerate(final["output"]):
                yield event("response.output_item.added", output_index=index, item=item)
                if item["type"] == "function_call":
                    yield event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, arguments=item["arguments"])
                else:
                    part = item["content"][0]
                    yield event("response.content_part.added", item_id=item["id"],
                                output_index=index, content_index=0,
                                part={**part, "text": ""})
                    yield event("response.output_text.delta", item_id=item["id"],
                                output_index=index, content_index=0, delta=part["text"],
                                logprobs=[])
                    yield event("response.output_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=part["text"],
                                logprobs=[])
                    yield event("response.content_part.done", item_id=item["id"],
                                output_index=index, content_index=0, part=part)
                yield event("response.output_item.done", output_index=index, item=item)
        yield event("response.incomplete" if final["status"] == "incomplete"
                    else "response.completed", response=final)
    finally:
        listener.sub.close()
        if not listener.finished:
            cancel_abandoned(listener.job_id)
