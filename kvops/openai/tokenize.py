"""POST /tokenize and /detokenize, as vLLM serves them: a prompt (or chat messages) to
the token ids the engine will see, and token ids back to text."""
from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse

from kvops import selectors
from kvops.intake import limits, tool_calls
from kvops.intake.prompts import inspector, prompt_ids
from kvops.openai import base, errors

TOKENIZE_FIELDS = {"model", "prompt", "messages", "tools", "add_special_tokens",
                   "add_generation_prompt", "return_token_strs"}


async def _tokenizer_call(request: HttpRequest, fields: set[str]):
    """Common checks of the two endpoints: (body, engine config, tokenizer) or an error
    response."""
    try:
        body = base.parse_body(request)
        unknown = sorted(set(body) - fields)
        if unknown:
            raise errors.BadRequest(f"unknown field `{unknown[0]}`", unknown[0])
        model = body.get("model")
        config = await sync_to_async(_engine_config_of, thread_sensitive=False)(model)
    except errors.BadRequest as e:
        return errors.error(400, str(e), e.param)
    except LookupError as e:
        return errors.error(404, str(e), "model", code="model_not_found")
    tokenizer = inspector.tokenizer(config)
    if tokenizer is None:
        return errors.error(503, f"the tokenizer of {model!r} is not readable from this web "
                                 "process (its model folder is on the engine's machine)",
                            type_="service_unavailable")
    return body, config, tokenizer


def _engine_config_of(model: Any) -> dict:
    """The config of an engine serving `model` (errors.BadRequest / LookupError as _check_model)."""
    return selectors.engines_serving(_check_model(model))[0].config


def _check_model(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise errors.BadRequest("`model` is required", "model")
    if model not in selectors.served_models():
        raise LookupError(f"model {model!r} is not served here; GET /v1/models lists them")
    return model


@base.v1_view("POST")
async def tokenize(request: HttpRequest, user) -> HttpResponse:
    """{"model", "prompt"} or {"model", "messages"} -> the token ids the engine will see:
    {"count", "max_model_len", "tokens"} (and "token_strs" if return_token_strs)."""
    checked = await _tokenizer_call(request, TOKENIZE_FIELDS)
    if isinstance(checked, HttpResponse):
        return checked
    body, config, tokenizer = checked
    try:
        add_special = base.flag(body, "add_special_tokens", default=True)
        if "messages" in body:
            messages = body["messages"]
            if "prompt" in body or not isinstance(messages, list) or not messages:
                raise errors.BadRequest("send `prompt` or a non-empty list of `messages`",
                                        "messages")
            if not base.flag(body, "add_generation_prompt", default=True):
                raise errors.BadRequest("only add_generation_prompt: true is supported",
                                        "add_generation_prompt")
            tools = body.get("tools")
            if tools is not None:  # checked as a chat's are; rendered as the engine's
                tool_calls.parse({"tools": tools, "tool_choice": "none"})
            tokens = prompt_ids(tokenizer, "", limits.messages(messages), tools)
        else:
            if "tools" in body:
                raise errors.BadRequest("`tools` need `messages`", "tools")
            text = limits.prompt(body.get("prompt"))
            tokens = tokenizer.encode(text) if add_special \
                else tokenizer.encode(text, add_special_tokens=False)
        return_strs = base.flag(body, "return_token_strs")
    except errors.BadRequest as e:
        return errors.error(400, str(e), e.param)
    except (limits.InvalidParam, tool_calls.ToolError) as e:
        return errors.error(400, str(e), e.param)
    answer: dict[str, Any] = {"count": len(tokens), "max_model_len": config.get("max_model_len"),
                              "tokens": tokens}
    if return_strs:
        answer["token_strs"] = [tokenizer.decode([t]) for t in tokens]
    return JsonResponse(answer)


@base.v1_view("POST")
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
        return errors.error(400, f"`tokens` must be a list of token ids in [0, {vocab})", "tokens")
    return JsonResponse({"prompt": tokenizer.decode(tokens)})
