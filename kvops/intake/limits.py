"""What a job may ask for: the one set of field rules every intake applies (the REST
job, /v1/completions and /v1/chat/completions parsers in kvops/intake/intake.py), so that a
value one API refuses the others refuse too, in the same words.

Each rule takes the field's name and the value the client sent (None: not sent) and
returns the value as the job keeps it, or raises InvalidParam naming the field. Types
are not coerced: "0.5" is not a number and `false` is not an integer.
"""
from __future__ import annotations

import re
from typing import Any

from django.conf import settings

from kvops.intake import json_body

MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 256
MAX_STOP_TOKEN_IDS = 64
TOKEN_ID_MAX = 2**31 - 1
TEMPERATURE = (0.0, 2.0)
TOP_P = (0.0, 1.0)  # 0 excluded
TOP_K_MAX = 1_000_000
SEED_MAX = 2**63 - 1
PRIORITY = (-1000, 1000)  # lower runs first under the priority policy; below 0: staff only
PENALTY = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI's range)
REPETITION_PENALTY = (0.0, 10.0)  # 0 excluded; 1 is off
MIN_P = (0.0, 1.0)
LOGIT_BIAS = (-100.0, 100.0)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGPROBS = 20  # as engine.sampling_params.MAX_LOGPROBS
MAX_N = 16  # as engine.sampling_params.MAX_N
ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: as system
MAX_TOOL_CALLS = 64  # in one assistant message


def max_prompt_chars() -> int:
    """Characters, not tokens: the engine checks the token count against its model."""
    return settings.KVOPS_MAX_PROMPT_CHARS


def max_tokens_limit() -> int:
    return settings.KVOPS_MAX_TOKENS


class InvalidParam(ValueError):
    """A field's value breaks a rule (HTTP 400); param names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class NotAllowed(InvalidParam):
    """The value is valid but this user may not ask for it (HTTP 403)."""


# --- types -----------------------------------------------------------------------------------
def is_number(value: Any) -> bool:
    """A JSON number: an int or a float, not a boolean (which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(name: str, value: Any, default: Any, lo: int, hi: int) -> Any:
    """An integer in [lo, hi] (a boolean is not one); default if not sent."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidParam(name, f"`{name}` must be an integer in [{lo}, {hi}]")
    return value


def number(name: str, value: Any, default: float | None, lo: float, hi: float,
           above_lo: bool = False) -> float | None:
    """A number in [lo, hi] (in (lo, hi] if above_lo) as a float; default if not sent."""
    if value is None:
        return default
    if not is_number(value) or not lo <= value <= hi:
        raise InvalidParam(name, f"`{name}` must be a number in "
                                 f"{'(' if above_lo else '['}{lo:g}, {hi:g}]")
    if above_lo and value <= lo:
        raise InvalidParam(name, f"`{name}` must be greater than {lo:g}")
    return float(value)


def flag(name: str, value: Any, default: bool = False) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParam(name, f"`{name}` must be a boolean")
    return value


def text(name: str, value: Any, max_chars: int | None = None) -> str:
    """A non-empty string of at most max_chars (the prompt limit by default) characters,
    without NUL (no database stores it in text)."""
    limit = max_prompt_chars() if max_chars is None else max_chars
    if not isinstance(value, str) or not value:
        raise InvalidParam(name, f"`{name}` must be a non-empty string")
    if len(value) > limit:
        raise InvalidParam(name, f"`{name}` is longer than {limit} characters")
    if "\x00" in value:
        raise InvalidParam(name, f"`{name}` must not contain NUL characters (U+0000)")
    return value


# --- fields ----------------------------------------------------------------------------------
def prompt(value: Any) -> str:
    """A prompt as text (REST's `prompt`)."""
    return text("prompt", value)


MAX_TOKEN_ID = 2**31 - 1


def prompts(value: Any) -> list[str | list[int]]:
    """A completion's `prompt` in any of OpenAI's forms: a string, a list of strings, a
    list of token ids, or a list of such lists; each prompt a string or a list of ids.
    At most max_batch_prompts() of them (the body's size bounds them all together)."""
    if isinstance(value, str):
        return [text("prompt", value)]
    if not isinstance(value, list) or not value:
        raise InvalidParam("prompt", "`prompt` must be a string, a list of strings, a list "
                                     "of token ids or a list of lists of token ids")
    if all(_is_id(t) for t in value):
        return [_token_prompt(value)]
    if len(value) > max_batch_prompts():
        raise InvalidParam("prompt", f"`prompt`: at most {max_batch_prompts()} prompts in "
                                     "one request (KVOPS_MAX_BATCH_PROMPTS)")
    if all(isinstance(p, str) for p in value):
        return [text("prompt", p) for p in value]
    if all(isinstance(p, list) for p in value):
        return [_token_prompt(p) for p in value]
    raise InvalidParam("prompt", "`prompt`: a list of prompts must hold only strings or only "
                                 "lists of token ids")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_prompt(ids: list) -> list[int]:
    if not ids or not all(_is_id(t) and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise InvalidParam("prompt", "a prompt of token ids must be a non-empty list of "
                                     "non-negative integers")
    if len(ids) > max_prompt_chars():
        raise InvalidParam("prompt", f"`prompt` is longer than {max_prompt_chars()} tokens")
    return ids


def max_batch_prompts() -> int:
    return settings.KVOPS_MAX_BATCH_PROMPTS


def messages(value: Any) -> list[dict]:
    """A chat: a non-empty list of {"role", "content": text or a list of text parts}, as
    OpenAI's chat completions take it, an agent's tool loop included: an assistant
    message may carry `tool_calls` (its content then null), a `tool` message answers
    one (`tool_call_id`), and `developer` is a system message. Kept as the model's chat
    template expects them, as transformers passes them: parts joined, a call's
    `arguments` as the object they encode, a null content empty."""
    if not isinstance(value, list) or not value:
        raise InvalidParam("messages", "`messages` must be a non-empty list")
    out = []
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidParam("messages", "each message needs a `role` of system, developer, "
                                           "user, assistant or tool")
        kept: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"]}
        content = m.get("content")
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            kept["tool_calls"] = _tool_calls(m["tool_calls"])
            if content is None:
                content = ""
        if m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id or len(call_id) > 256:
                raise InvalidParam("messages", "a `tool` message needs the `tool_call_id` "
                                               "(a string) of the call it answers")
            kept["tool_call_id"] = call_id
        if isinstance(m.get("name"), str) and m["role"] in ("tool", "user", "assistant"):
            kept["name"] = m["name"][:256]
        if isinstance(content, list):  # content parts: the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text", ""), str) for p in content):
                raise InvalidParam("messages", "only text content parts are supported")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise InvalidParam("messages", "message `content` must be a string")
        if len(content) > max_prompt_chars():
            raise InvalidParam("messages", f"message `content` is longer than "
                                           f"{max_prompt_chars()} characters")
        if "\x00" in content:
            raise InvalidParam("messages", "message `content` must not contain NUL "
                                           "characters (U+0000)")
        kept["content"] = content
        out.append(kept)
    return out


def _tool_calls(value: Any) -> list[dict]:
    """An assistant message's `tool_calls`: [{"id", "type": "function", "function":
    {"name", "arguments": JSON text}}]; kept with `arguments` decoded (chat templates
    write them with tojson)."""
    if not isinstance(value, list) or len(value) > MAX_TOOL_CALLS:
        raise InvalidParam("messages", f"`tool_calls` must be a list of at most "
                                       f"{MAX_TOOL_CALLS} calls")
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or call.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise InvalidParam("messages", "each of `tool_calls` needs `type` \"function\" "
                                           "and a `function` with its `name` and `arguments`")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json_body.parse((arguments or "{}").encode("utf-8", "replace"))
            except ValueError:
                raise InvalidParam("messages", f"tool call {function['name']!r}: `arguments` "
                                               "is not JSON") from None
        if not isinstance(arguments, dict):
            raise InvalidParam("messages", f"tool call {function['name']!r}: `arguments` must "
                                           "encode a JSON object")
        kept = {"type": "function", "function": {"name": function["name"],
                                                 "arguments": arguments}}
        if isinstance(call.get("id"), str):
            kept["id"] = call["id"][:256]
        calls.append(kept)
    return calls


def stop_strings(value) -> list[str]:
    """A string or a list of up to MAX_STOP_STRINGS non-empty strings of at most
    MAX_STOP_CHARS characters each; returns the list."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise InvalidParam("stop", "`stop` must be a string or a list of non-empty strings")
    if len(value) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in value):
        raise InvalidParam("stop", f"`stop`: at most {MAX_STOP_STRINGS} strings of at most "
                                   f"{MAX_STOP_CHARS} characters each")
    return value


def stop_token_ids(value) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= TOKEN_ID_MAX
            for t in value):
        raise InvalidParam("stop_token_ids", f"`stop_token_ids` must be a list of at most "
                                             f"{MAX_STOP_TOKEN_IDS} token ids")
    return value


def top_k(value) -> int | None:
    """vLLM's: an integer of at least 1; 0 and -1 (and not sent) mean no limit."""
    if not isinstance(value, bool) and value in (None, -1, 0):
        return None
    return integer("top_k", value, None, 1, TOP_K_MAX)


def priority(value, is_staff: bool) -> int:
    """An integer in PRIORITY; below 0 (ahead of everyone's default) only for staff."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) \
            or not PRIORITY[0] <= value <= PRIORITY[1]:
        raise InvalidParam("priority", f"`priority` must be an integer in "
                                       f"[{PRIORITY[0]}, {PRIORITY[1]}]")
    if value < 0 and not is_staff:
        raise NotAllowed("priority", "only staff may set a priority below 0 (it runs ahead "
                                     "of everyone's jobs); use 0 or more")
    return value


_TOKEN_ID_DIGITS = 10  # token ids are below 2**31
_TOKEN_ID = re.compile(rf"[0-9]{{1,{_TOKEN_ID_DIGITS}}}")  # ASCII digits: "²".isdigit() is True


def logit_bias(value) -> dict | None:
    """A map of token id (a string of digits, as JSON has it, or an integer) to a bias in
    LOGIT_BIAS, at most MAX_LOGIT_BIAS_ENTRIES of them; keys come back as strings."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParam("logit_bias", "`logit_bias` must be an object mapping token ids "
                                         "to biases")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParam("logit_bias", f"`logit_bias`: at most {MAX_LOGIT_BIAS_ENTRIES} "
                                         "entries")
    out = {}
    for key, bias in value.items():
        if not _TOKEN_ID.fullmatch(str(key)):
            shown = repr(key) if len(str(key)) <= 20 else repr(str(key)[:20]) + "…"
            raise InvalidParam("logit_bias", f"`logit_bias` keys must be token ids (at most "
                                             f"{_TOKEN_ID_DIGITS} digits 0-9), not {shown}")
        if not is_number(bias) or not LOGIT_BIAS[0] <= bias <= LOGIT_BIAS[1]:
            raise InvalidParam("logit_bias", f"`logit_bias` values must be numbers in "
                                             f"[{LOGIT_BIAS[0]:g}, {LOGIT_BIAS[1]:g}]")
        out[str(int(key))] = float(bias)
    return out or None


def structured(value, param: str) -> dict | None:
    """A structured-output constraint (engine/text/structured.py: json, json_object, regex,
    choice or grammar) of the right shape and within the bounds on what one may be.
    Whether it compiles is checked apart (kvops/intake/grammar_check.py: it can take seconds),
    still before the job exists."""
    if value is None:
        return None
    from engine.errors import InvalidRequestError
    from engine.text.structured import check_spec
    try:
        check_spec(value)
    except InvalidRequestError as e:
        raise InvalidParam(param, f"`{param}`: {e}") from None
    return value


def sampling(body: dict, max_tokens: Any, default_max_tokens: int,
             default_temperature: float) -> dict:
    """The sampling fields every intake shares (max_tokens given apart: chat also calls
    it max_completion_tokens), as the engine's SamplingParams takes them. Which of
    them the engine refuses together (min_tokens above max_tokens...) is checked by
    engine_params()."""
    return {
        "max_tokens": integer("max_tokens", max_tokens, default_max_tokens, 1,
                              max_tokens_limit()),
        "temperature": number("temperature", body.get("temperature"), default_temperature,
                              *TEMPERATURE),
        "top_p": number("top_p", body.get("top_p"), 1.0, *TOP_P, above_lo=True),
        "top_k": top_k(body.get("top_k")),
        "seed": integer("seed", body.get("seed"), None, 0, SEED_MAX),
        "stop": stop_strings(body.get("stop")),
        "stop_token_ids": stop_token_ids(body.get("stop_token_ids")),
        "ignore_eos": flag("ignore_eos", body.get("ignore_eos")),
        "min_tokens": integer("min_tokens", body.get("min_tokens"), 0, 0, max_tokens_limit()),
        "min_p": number("min_p", body.get("min_p"), 0.0, *MIN_P),
        "presence_penalty": number("presence_penalty", body.get("presence_penalty"), 0.0,
                                   *PENALTY),
        "frequency_penalty": number("frequency_penalty", body.get("frequency_penalty"), 0.0,
                                    *PENALTY),
        "repetition_penalty": number("repetition_penalty", body.get("repetition_penalty"), 1.0,
                                     *REPETITION_PENALTY, above_lo=True),
        "logit_bias": logit_bias(body.get("logit_bias")),
        "n": integer("n", body.get("n"), 1, 1, MAX_N),
    }


def engine_params(params: dict) -> dict:
    """The job's sampling parameters as the engine will take them, or InvalidParam naming
    the field the engine refuses (min_tokens above max_tokens...): every API answers 400
    before the job exists rather than failing it on the engine."""
    from engine.errors import InvalidRequestError
    from engine.sampling_params import SamplingParams
    try:
        SamplingParams(**params)
    except InvalidRequestError as e:
        message = str(e)
        raise InvalidParam(message.split(" ", 1)[0], message) from None
    return params
