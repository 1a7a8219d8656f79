"""The one way a job comes in. Each request schema has one parser (a REST job,
/v1/completions, /v1/chat/completions); each produces a NewJob with the rules of
kvops/intake/limits.py; check() then holds it against the engines that may run it (the one it
names, those serving its model, else every live one): the model is served, the engine
exists, its chat template can call tools, and the prompt, rendered and tokenized here
once, fits. kvops/jobs/admission.py stores it.

Every refusal is a typed error naming the field as the client sent it, so each API
words it in its own shape (DRF's {"error", "fields"}, OpenAI's {"error": {"message",
"param"}}) with the same message.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvops import selectors
from kvops.intake import limits, tool_calls
from kvops.intake.limits import InvalidParam
from kvops.models import Engine, Job
from kvops.intake.prompts import GIVEN_IDS, ids_for, inspector, prompt_ids, tokenizer_id


class NotFound(LookupError):
    """The model or engine the job names is not here (HTTP 404); param names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


_FIELD_OF = {"structured": "structured_outputs"}  # a concept's field unless told otherwise


@dataclass(slots=True)
class NewJob:
    """What a client asked for, parsed: kvops/jobs/admission.py stores it."""
    owner: Any
    params: dict  # the engine's sampling parameters, and the service's own ("tool_call")
    prompt: str = ""
    messages: list | None = None
    priority: int = 0
    engine: str = ""  # the engine it must run on ("": routed)
    model: str = ""  # the model it asked for ("": any)
    source: str = Job.Source.API
    idempotency_key: str = ""
    token_ids: list[int] | None = None  # its prompt as the engine runs it (check())
    tokenizer: str = ""  # the tokenizer that made token_ids (prompts.tokenizer_id)
    # the field each concept came in as, where the API names it its own way
    # ("structured": "response_format", "prompt_logprobs": "echo"): errors name it so
    fields: dict = field(default_factory=dict)

    def field_name(self, concept: str) -> str:
        return self.fields.get(concept, _FIELD_OF.get(concept, concept))

    @property
    def tools(self) -> list[dict] | None:
        return (self.params.get("tool_call") or {}).get("tools")


# --- the parsers -------------------------------------------------------------------------------
SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "n", "priority",
                   "structured_outputs"}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}
REST_FIELDS = SAMPLING_FIELDS | TOOL_FIELDS | {"prompt", "messages", "logprobs",
                                               "prompt_logprobs", "engine", "model"}
# /v1: vLLM's extra sampling fields (top_k, min_p, repetition_penalty, min_tokens,
# ignore_eos, stop_token_ids, priority, structured_outputs) are taken as vLLM takes them.
# Fields OpenAI's clients send that ask nothing of a self-hosted model: checked, then
# ignored, as vLLM does (docs/api.md says what each would mean): `store` and `metadata`
# (OpenAI keeps the completion for its dashboard), `reasoning_effort` (no model served
# here reasons apart from its answer), `service_tier` (one tier), `user` (an end user's
# id, for OpenAI's abuse checks).
IGNORED_FIELDS = {"store", "metadata", "reasoning_effort", "service_tier", "user"}
OPENAI_FIELDS = SAMPLING_FIELDS | IGNORED_FIELDS | {"model", "stream", "stream_options",
                                                    "response_format"}
COMPLETION_FIELDS = OPENAI_FIELDS | {"prompt", "echo", "logprobs", "best_of", "suffix"}
CHAT_FIELDS = OPENAI_FIELDS | TOOL_FIELDS | {"messages", "max_completion_tokens", "logprobs",
                                             "top_logprobs", "functions", "function_call"}
# Known fields not served yet, with the values that ask for nothing (accepted).
NOT_SUPPORTED = {"best_of": (1,), "suffix": ("",)}
ENGINE_NAME_CHARS = 64


def parse_job(body: Any, owner, source: str = Job.Source.API,
              idempotency_key: str = "") -> NewJob:
    """POST /api/jobs/: `prompt` or `messages`, the sampling fields (greedy and 128
    tokens unless told), `logprobs`/`prompt_logprobs` (how many alternatives per
    token), `structured_outputs`, `tools`, and where to run it (`engine`, `model`)."""
    body = _object(body, REST_FIELDS)
    has_prompt, has_messages = bool(body.get("prompt")), bool(body.get("messages"))
    if has_prompt == has_messages:
        raise InvalidParam("prompt", "give exactly one of `prompt` (non-empty text) or "
                                     "`messages`")
    new = NewJob(owner, {}, source=source, idempotency_key=idempotency_key)
    if has_prompt:
        new.prompt = limits.text("prompt", body["prompt"])
    else:
        new.messages = limits.messages(body["messages"])
    params = limits.sampling(body, body.get("max_tokens"), 128, 0.0)
    params["logprobs"] = limits.integer("logprobs", body.get("logprobs"), None, 0,
                                        limits.MAX_LOGPROBS)
    params["prompt_logprobs"] = limits.integer("prompt_logprobs", body.get("prompt_logprobs"),
                                               None, 0, limits.MAX_LOGPROBS)
    params["structured"] = limits.structured(body.get("structured_outputs"),
                                             "structured_outputs")
    _tools(body, params, new)
    new.params = limits.engine_params({k: v for k, v in params.items() if k != "tool_call"}) \
        | ({"tool_call": params["tool_call"]} if "tool_call" in params else {})
    new.priority = limits.priority(body.get("priority"), owner.is_staff)
    new.engine = _name("engine", body.get("engine"))
    new.model = _name("model", body.get("model"), 255)
    return new


def parse_completion(body: Any, owner, idempotency_key: str = "") -> list[NewJob]:
    """POST /v1/completions (OpenAI's defaults: temperature 1, 16 tokens): a job per
    prompt (`prompt` as text or token ids, one or a list), each with the same
    parameters. `echo` asks for the prompt back, and with `logprobs` its logprobs too
    (vLLM's way)."""
    body = _object(body, COMPLETION_FIELDS)
    new = _openai(body, owner, idempotency_key)
    prompts = limits.prompts(body.get("prompt"))
    if len(prompts) > 1 and idempotency_key:
        raise InvalidParam("Idempotency-Key", "an Idempotency-Key names one job: send a list "
                                              "of prompts without it, or one prompt a call")
    params = limits.sampling(body, body.get("max_tokens"), 16, 1.0)
    params["logprobs"] = limits.integer("logprobs", body.get("logprobs"), None, 0,
                                        limits.MAX_LOGPROBS)
    if limits.flag("echo", body.get("echo")) and params["logprobs"] is not None:
        params["prompt_logprobs"] = params["logprobs"]
        new.fields["prompt_logprobs"] = "echo"
    params["structured"] = _response_format(body, new)
    new.params = limits.engine_params(params)
    news = []
    for prompt in prompts:
        one = dataclasses.replace(new, params=dict(new.params), fields=dict(new.fields))
        if isinstance(prompt, str):
            one.prompt = prompt
        else:
            one.token_ids, one.tokenizer = prompt, GIVEN_IDS
        news.append(one)
    return news


def parse_chat(body: Any, owner, idempotency_key: str = "") -> NewJob:
    """POST /v1/chat/completions (OpenAI's defaults: temperature 1, 256 tokens;
    `max_completion_tokens` before `max_tokens`). `logprobs: true` with
    `top_logprobs`; `tools` and `tool_choice` as kvops/intake/tool_calls.py serves them."""
    body = _object(body, CHAT_FIELDS)
    new = _openai(body, owner, idempotency_key)
    new.messages = limits.messages(body.get("messages"))
    params = limits.sampling(body, body.get("max_completion_tokens", body.get("max_tokens")),
                             256, 1.0)
    if limits.flag("logprobs", body.get("logprobs")):
        params["logprobs"] = limits.integer("top_logprobs", body.get("top_logprobs"), 0, 0,
                                            limits.MAX_LOGPROBS)
    elif body.get("top_logprobs") not in (None, 0):
        raise InvalidParam("top_logprobs", "`top_logprobs` needs `logprobs: true`")
    else:
        params["logprobs"] = None
    params["structured"] = _response_format(body, new)
    _tools(body, params, new)
    tool_call = params.pop("tool_call", None)
    new.params = limits.engine_params(params)
    if tool_call is not None:
        new.params["tool_call"] = tool_call
    return new


def _object(body: Any, known: set[str]) -> dict:
    if not isinstance(body, dict):
        raise InvalidParam("body", "the body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidParam(unknown[0], f"unknown field `{unknown[0]}`")
    for name, nothing in NOT_SUPPORTED.items():
        if body.get(name) is not None and body[name] not in nothing:
            raise InvalidParam(name, f"`{name}` is not supported")
    return body


def _openai(body: dict, owner, idempotency_key: str) -> NewJob:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidParam("model", "`model` is required")
    _ignored_fields(body)
    return NewJob(owner, {}, model=model, source=Job.Source.OPENAI,
                  idempotency_key=idempotency_key,
                  priority=limits.priority(body.get("priority"), owner.is_staff))


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")


def _ignored_fields(body: dict) -> None:
    """IGNORED_FIELDS: refused only when malformed, as OpenAI would refuse them."""
    for name in ("user", "service_tier", "reasoning_effort"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise InvalidParam(name, f"`{name}` must be a string")
    if body.get("service_tier") not in (None, *SERVICE_TIERS):
        raise InvalidParam("service_tier", f"`service_tier` must be one of {SERVICE_TIERS}")
    if body.get("reasoning_effort") not in (None, *REASONING_EFFORTS):
        raise InvalidParam("reasoning_effort",
                           f"`reasoning_effort` must be one of {REASONING_EFFORTS}")
    limits.flag("store", body.get("store"))
    metadata(body.get("metadata"))


def metadata(value: Any) -> dict[str, str]:
    """OpenAI's `metadata`: at most 16 pairs, keys up to 64 characters, string values up
    to 512."""
    if value is None:
        return {}
    if (not isinstance(value, dict) or len(value) > 16
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                       and len(v) <= 512 for k, v in value.items())):
        raise InvalidParam("metadata", "`metadata` must be an object of at most 16 string "
                                       "values (keys up to 64 characters, values up to 512)")
    return dict(value)


def _name(param: str, value: Any, max_chars: int = ENGINE_NAME_CHARS) -> str:
    if value in (None, ""):
        return ""
    if not isinstance(value, str) or len(value) > max_chars:
        raise InvalidParam(param, f"`{param}` must be a string of at most {max_chars} "
                                  "characters")
    return value


def _response_format(body: dict, new: NewJob) -> dict | None:
    """OpenAI's `response_format` (json_object, or json_schema with its schema) or vLLM's
    `structured_outputs` (json, json_object, regex, choice or grammar): the constraint
    the engine applies (engine/text/structured.py), its shape and size checked here."""
    response_format, vllm = body.get("response_format"), body.get("structured_outputs")
    if response_format is None:
        return limits.structured(vllm, "structured_outputs")
    if vllm is not None:
        raise InvalidParam("structured_outputs", "send `response_format` or "
                                                 "`structured_outputs`, not both")
    new.fields["structured"] = param = "response_format"
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return limits.structured({"json_object": True}, param)
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
            raise InvalidParam(param, "`response_format.json_schema.schema` must be a JSON "
                                      "schema object")
        return limits.structured({"json": json_schema["schema"]}, param)
    raise InvalidParam(param, "`response_format.type` must be text, json_object or "
                              "json_schema")


def _tools(body: dict, params: dict, new: NewJob) -> None:
    """`tools` and `tool_choice` (kvops/intake/tool_calls.py): a named or required call is a
    constraint on the output; the tools themselves are rendered into the prompt."""
    try:
        tools = tool_calls.parse(body)
    except tool_calls.ToolError as e:
        raise InvalidParam(e.param, str(e)) from None
    limits.flag("parallel_tool_calls", body.get("parallel_tool_calls"), True)
    if tools is None:
        return
    if new.messages is None:
        raise InvalidParam("tools", "`tools` need a chat (`messages`)")
    if params["structured"] is not None and tools["structured"] is not None:
        raise InvalidParam("tools", "tool calls are constrained already: send `tools` or a "
                                    "structured output, not both")
    if params["n"] > 1:
        raise InvalidParam("n", "tool calls with n > 1 are not served yet")
    if tools["structured"] is not None:
        params["structured"] = limits.structured(tools["structured"], "tools")
        new.fields["structured"] = "tools"
    # the worker keeps this for the answer; the web renders the tools into the prompt
    params["tool_call"] = {"kind": tools["kind"], "names": tools["names"],
                           "tools": body["tools"]}


# --- the check against the engines -------------------------------------------------------------
def candidates(new: NewJob) -> list[Engine]:
    """The engines that may run the job: the one it names (NotFound if no such engine
    was ever registered), else the live ones serving its model (NotFound if none), else
    every live one (possibly none: the job then waits for one)."""
    if new.engine:
        engines = selectors.candidate_engines(new.engine)
        if not engines and not Engine.objects.filter(name=new.engine).exists():
            raise NotFound("engine", f"no engine named {new.engine!r}")
        return engines
    if new.model:
        engines = selectors.engines_serving(new.model)
        if not engines:
            raise NotFound("model", f"model {new.model!r} is not served here; GET /v1/models "
                                    "lists them")
        return engines
    return selectors.candidate_engines()


def check(new: NewJob) -> None:
    """Hold the job against the engines that may run it, and render its prompt once
    (new.token_ids, with the first of them whose tokenizer is readable here). Raises
    NotFound or InvalidParam; an engine whose tokenizer is not readable from this
    process is given the benefit of the doubt (its worker renders the prompt)."""
    engines = candidates(new)
    if engines and all(e.config.get("simulate") for e in engines):
        where = f"the engines serving {new.model!r}" if new.model else "the engines that may run it"
        if new.params.get("prompt_logprobs") is not None:
            param = new.field_name("prompt_logprobs")
            raise InvalidParam(param, f"`{param}` asks for the prompt's logprobs, which need "
                                      f"a model with logits; {where} simulate one")
        if new.params.get("structured") is not None:
            raise InvalidParam(new.field_name("structured"),
                               f"structured output needs a model with logits; {where} "
                               "simulate one")
    tool_call = new.params.get("tool_call")
    if tool_call is not None and tool_call["kind"] == "auto" and not _calls_tools(engines):
        raise InvalidParam("tool_choice", "tool_choice \"auto\" (the default with tools) needs "
                                          "a chat template that writes tool calls "
                                          f"({tool_calls.CALL_START}...); this model's does "
                                          "not: send tool_choice \"required\" or a named "
                                          "function")
    _render(new, engines)
    refusals = [r for r in (_refusal(e, new) for e in engines)]
    if refusals and all(refusals):
        param = refusals[0][0]
        raise InvalidParam(param, "; ".join(message for _, message in refusals))


def _render(new: NewJob, engines: list[Engine]) -> None:
    if new.tokenizer == GIVEN_IDS:  # sent as token ids: their text, for the job's page
        for engine in engines:
            tokenizer = inspector.tokenizer(engine.config)
            if tokenizer is not None:
                try:
                    new.prompt = tokenizer.decode(new.token_ids)
                except Exception:  # noqa: BLE001  (an id past the vocabulary: refused later)
                    pass
                return
        return
    tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in new.messages or ())
    for engine in engines:
        tokenizer = inspector.tokenizer(engine.config)
        if tokenizer is None:
            continue
        template = getattr(tokenizer, "chat_template", None)
        if tool_turns and template is not None and "tool_calls" not in template:
            raise InvalidParam(new.field_name("messages"),
                               f"{selectors.model_name(engine)!r}'s chat template does not "
                               "render tool calls or tool results: send this chat to a model "
                               "whose template does, or without them")
        try:
            new.token_ids = prompt_ids(tokenizer, new.prompt, new.messages, new.tools)
        except Exception as e:  # noqa: BLE001  (the model's template refuses this chat)
            raise InvalidParam(new.field_name("messages"),
                               f"the chat cannot be rendered with {selectors.model_name(engine)!r}'s "
                               f"chat template: {e}") from None
        new.tokenizer = tokenizer_id(engine.config)
        return


def _calls_tools(engines: list[Engine]) -> bool:
    """Does the chat template of these engines write tool calls the way `auto` parses
    them? (An engine whose tokenizer is not readable here is given the benefit of the
    doubt; so is a job no live engine may run yet.)"""
    if not engines:
        return True
    for engine in engines:
        tokenizer = inspector.tokenizer(engine.config)
        if tokenizer is None or tool_calls.template_calls_tools(
                getattr(tokenizer, "chat_template", None)):
            return True
    return False


def _refusal(engine: Engine, new: NewJob) -> tuple[str, str] | None:
    """(field, why) if this engine cannot take the job, else None."""
    vocab = engine.config.get("vocab_size")
    if vocab:
        for name in ("stop_token_ids", "logit_bias"):
            ids = [int(t) for t in new.params.get(name) or ()]
            if ids and max(ids) >= vocab:
                return name, (f"`{name}` names token id {max(ids)}; engine {engine.name}'s "
                              f"model has {vocab} tokens (ids below {vocab})")
    limit = engine.config.get("max_model_len")
    token_ids = ids_for(new.tokenizer, new.token_ids, engine.config)
    if token_ids is None:
        token_ids = inspector.token_ids(engine.config, new.prompt, new.messages, new.tools)
    if token_ids and vocab and new.tokenizer == GIVEN_IDS and max(token_ids) >= vocab:
        return "prompt", (f"`prompt` holds token id {max(token_ids)}; engine {engine.name}'s "
                          f"model has {vocab} tokens (ids below {vocab})")
    if token_ids is not None and limit and len(token_ids) >= limit:
        return (new.field_name("messages") if new.messages else "prompt",
                f"the prompt is too long: {len(token_ids)} tokens on engine {engine.name}, "
                f"whose model takes at most {limit - 1} prompt tokens")
    return None


# --- the REST job schema (OpenAPI), from the same limits -------------------------------------
def job_schema() -> dict:
    """POST /api/jobs/'s body as OpenAPI describes it (drf-spectacular)."""
    def integer(lo, hi, nullable=False, **extra):
        return {"type": "integer", "minimum": lo, "maximum": hi, "nullable": nullable, **extra}

    def number(lo, hi, **extra):
        return {"type": "number", "minimum": lo, "maximum": hi, **extra}

    text = {"type": "string", "maxLength": limits.max_prompt_chars()}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": list(limits.ROLES)},
        "content": {**text, "nullable": True}, "tool_calls": {"type": "array"},
        "tool_call_id": {"type": "string"}, "name": {"type": "string"}}}
    return {"type": "object", "additionalProperties": False, "properties": {
        "prompt": {**text, "description": "the text to continue (or `messages`)"},
        "messages": {"type": "array", "items": message, "minItems": 1,
                     "description": "a chat, rendered with the model's template"},
        "max_tokens": integer(1, limits.max_tokens_limit(), default=128),
        "temperature": number(*limits.TEMPERATURE, default=0.0),
        "top_p": number(*limits.TOP_P, exclusiveMinimum=True, default=1.0),
        "top_k": integer(-1, limits.TOP_K_MAX, True, description="0 or -1: no limit"),
        "min_p": number(*limits.MIN_P, default=0.0),
        "seed": integer(0, limits.SEED_MAX, True),
        "stop": {"oneOf": [{"type": "string", "maxLength": limits.MAX_STOP_CHARS},
                           {"type": "array", "maxItems": limits.MAX_STOP_STRINGS,
                            "items": {"type": "string", "maxLength": limits.MAX_STOP_CHARS}}]},
        "stop_token_ids": {"type": "array", "maxItems": limits.MAX_STOP_TOKEN_IDS,
                           "items": integer(0, limits.TOKEN_ID_MAX)},
        "ignore_eos": {"type": "boolean", "default": False},
        "min_tokens": integer(0, limits.max_tokens_limit(), default=0),
        "presence_penalty": number(*limits.PENALTY, default=0.0),
        "frequency_penalty": number(*limits.PENALTY, default=0.0),
        "repetition_penalty": number(*limits.REPETITION_PENALTY, exclusiveMinimum=True,
                                     default=1.0),
        "logit_bias": {"type": "object", "nullable": True,
                       "maxProperties": limits.MAX_LOGIT_BIAS_ENTRIES,
                       "additionalProperties": number(*limits.LOGIT_BIAS)},
        "n": integer(1, limits.MAX_N, default=1,
                     description="samples of the prompt (the job's `samples`)"),
        "logprobs": integer(0, limits.MAX_LOGPROBS, True, description="the job's "
                            "`output_logprobs`: each token's and the k most likely"),
        "prompt_logprobs": integer(0, limits.MAX_LOGPROBS, True,
                                   description="the same for each prompt token"),
        "structured_outputs": {"type": "object", "nullable": True, "description":
                               "one of json (a JSON schema), json_object (true), regex, "
                               "choice (a list of strings), grammar (EBNF)"},
        "tools": {"type": "array", "items": {"type": "object"},
                  "description": "OpenAI's tools, rendered into the chat"},
        "tool_choice": {"description": "none, auto, required or a named function"},
        "parallel_tool_calls": {"type": "boolean"},
        "priority": integer(*limits.PRIORITY, default=0,
                            description="lower runs first (below 0: staff only)"),
        "engine": {"type": "string", "maxLength": ENGINE_NAME_CHARS,
                   "description": "run on this engine (default: routed)"},
        "model": {"type": "string", "maxLength": 255,
                  "description": "run on an engine serving this model (GET /v1/models)"},
    }}
