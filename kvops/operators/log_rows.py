"""The operator log's rows as /actions/ shows them: each parameter and the engine's answer
folded to one line (a list of ids as its length and first few, a long text cut), the
whole value behind an expander. A pin by a job records the 1,500 token ids it ran; shown
whole, they made one row 1,500 px tall."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

BRIEF_ITEMS = 6  # a longer list of numbers shows its length and its first BRIEF_ITEMS
BRIEF_TEXT = 60  # characters of a text shown before it is cut
BRIEF_LINE = 140  # characters of a whole line (a dict's fields together) before it is cut


@dataclass(slots=True)
class Folded:
    brief: str  # one line
    full: str | None  # the whole value, laid out to read; None: the line is all of it


def fold(value: Any) -> Folded:
    """A value as one line, with the whole of it when the line leaves something out (a
    text as it is, anything else as JSON)."""
    if isinstance(value, str):
        line = _cut(value, BRIEF_LINE)
        return Folded(line, None if line == value else value)
    line = _cut(_brief(value, True), BRIEF_LINE)
    return Folded(line, None if line == _brief(value, False) else _pretty(value))


def params_rows(params: dict) -> list[tuple[str, Folded]]:
    """Each parameter by name, folded."""
    return [(name, fold(value)) for name, value in params.items()]


def answer(result: dict) -> Folded:
    """The engine's answer: its error in words, or its result."""
    if result.get("message"):
        return fold(f"{result.get('error', 'error')}: {result['message']}")
    return fold(result.get("result", result))


def _brief(value: Any, short: bool) -> str:
    """The value in one line; short: with its long texts and lists folded."""
    if isinstance(value, str):
        return json.dumps(_cut(value, BRIEF_TEXT) if short else value, ensure_ascii=False)
    if isinstance(value, list):
        if short and len(value) > BRIEF_ITEMS and all(_scalar(v) for v in value):
            first = ", ".join(json.dumps(v) for v in value[:BRIEF_ITEMS])
            noun = "ids" if all(isinstance(v, int) for v in value) else "items"
            return f"{len(value):,} {noun}: [{first}, …]"
        return "[" + ", ".join(_brief(v, short) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_brief(v, short)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _pretty(value: Any, indent: str = "") -> str:
    """JSON laid out to read: a dict's fields and a list of objects one a line, a list of
    numbers or words on one (wrapped by the page), a text as it is."""
    inner = indent + "  "
    if isinstance(value, dict) and value:
        fields = [f"{inner}{json.dumps(k)}: {_pretty(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(fields) + f"\n{indent}}}"
    if isinstance(value, list) and value and not all(_scalar(v) for v in value):
        return "[\n" + ",\n".join(inner + _pretty(v, inner) for v in value) + f"\n{indent}]"
    return json.dumps(value, ensure_ascii=False)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + "…"
