"""Tool calls on /v1/chat/completions, the way vLLM serves a named or required
tool_choice: the output is constrained (engine/text/structured.py) to the called function's
arguments (a named function) or to a JSON list of {name, parameters} calls (`required`),
and the answer carries OpenAI's `tool_calls` instead of text.

`tool_choice: "auto"` (the default with tools) lets the model decide, for chat templates
that write calls the Hermes way (Qwen2.5, Hermes, and others): `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks in the text, rendered into the prompt with the
tools and parsed out of the answer. A template without that format gets a 400.
`"none"` (and no tools) leaves the answer as text.
"""
from __future__ import annotations

import json
import re
from typing import Any

MAX_TOOLS = 64
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_START) + r"\s*(.*?)\s*" + re.escape(CALL_END), re.DOTALL)


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse(body: dict) -> dict | None:
    """The call mode asked for: {"kind": "named" | "required", "names": [...],
    "structured": the constraint}, or None (no tools, or tool_choice "none")."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if body.get("functions") or body.get("function_call") not in (None, "none"):
        raise ToolError("`functions` and `function_call` are deprecated: send `tools` and "
                        "`tool_choice`", "functions")
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("`tool_choice` needs `tools`", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"`tools` must be a list of at most {MAX_TOOLS} tools", "tools")
    schemas: dict[str, dict] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(function, dict) and isinstance(function.get("name"), str)
                and function["name"]):
            raise ToolError("each tool must be {\"type\": \"function\", \"function\": "
                            "{\"name\": ..., \"parameters\": {...}}}", "tools")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ToolError(f"tool {function['name']!r}: `parameters` must be a JSON schema",
                            "tools")
        schemas[function["name"]] = parameters or {"type": "object"}
    if choice == "none":
        return None
    if choice in (None, "auto"):  # checked against the model's template at admission
        return {"kind": "auto", "names": list(schemas), "structured": None}
    if choice == "required":
        calls = {"anyOf": [{"type": "object", "additionalProperties": False,
                            "required": ["name", "parameters"],
                            "properties": {"name": {"const": name}, "parameters": schema}}
                           for name, schema in schemas.items()]}
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls}
        if body.get("parallel_tool_calls") is False:
            array["maxItems"] = 1
        return {"kind": "required", "names": list(schemas), "structured": {"json": array}}
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(name, str) and name):
        raise ToolError("`tool_choice` must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in schemas:
        raise ToolError(f"tool_choice names {name!r}, which is not in `tools`", "tool_choice")
    return {"kind": "named", "names": [name], "structured": {"json": schemas[name]}}


def template_calls_tools(chat_template: str | None) -> bool:
    """Does this chat template write tool calls the way `auto` parses them?"""
    return bool(chat_template) and CALL_START in chat_template


def split_auto(text: str, mode: dict) -> tuple[str | None, list[tuple[str, str]]]:
    """An `auto` answer: (its content, or None when it is only calls; the calls as
    (name, arguments JSON)). Blocks that do not parse as a call of a given tool stay in
    the content."""
    calls, kept, end = [], [], 0
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        if name not in mode["names"]:
            continue
        kept.append(text[end:match.start()])
        end = match.end()
        calls.append((name, arguments if isinstance(arguments, str) else json.dumps(arguments)))
    kept.append(text[end:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def visible_auto(text: str, final: bool) -> str:
    """The part of an `auto` answer that streams as content now: up to the first call
    (and, until the end, short of what could be the start of one)."""
    start = text.find(CALL_START)
    if start >= 0:
        return text[:start]
    return text if final else text[:max(0, len(text) - len(CALL_START) + 1)]


def calls_of(mode: dict, text: str, call_id: str) -> list[dict]:
    """OpenAI's tool_calls for the output `text` (call ids call_id-<i>); for `auto`, the
    calls it made (possibly none)."""
    if mode["kind"] == "named":
        calls = [(mode["names"][0], text)]
    elif mode["kind"] == "auto":
        calls = split_auto(text, mode)[1]
    else:
        calls = [(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
    return [{"id": f"{call_id}-{i}", "type": "function",
             "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(calls)]
