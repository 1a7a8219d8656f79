"""Request bodies as JSON: the one parser of every API (REST through DRF's parser class
below, /v1 and /tokenize through parse()), so that what Python's decoder chokes on or
lets through is a 400 naming the problem, never a 500 later on:

* nesting deeper than the decoder recurses (``[[[[…``: a RecursionError);
* NaN and the infinities (not JSON, though Python writes and reads them), and numbers
  too large for a float (`1e400`, which Python reads as infinity);
* a string holding a lone UTF-16 surrogate (``"\\ud800"``): valid JSON, but no text,
  so the tokenizer, the database's UTF-8 and the job stream each fail on it.

The size of a body is bounded before it is read (kvops/openai/body_limit.py).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser as DRFJSONParser

# An escaped surrogate half (\ud800-\udfff). A body without one cannot hold a lone
# surrogate (UTF-8 cannot carry one: the decoder refuses it), so most bodies are never
# walked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class BadJSON(ValueError):
    """The body is not JSON this service takes (HTTP 400); the message says why, and
    param names the top-level field at fault (None: the body as a whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse(raw: bytes) -> Any:
    """The body's JSON value, or BadJSON saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadJSON("the body is not valid JSON: it is not UTF-8 text") from None
    # NaN, the infinities and numbers past a float's range are read as what Python makes
    # of them, then refused by the field that holds the first one
    not_finite: list[str] = []  # their texts, in order

    def constant(name: str) -> float:
        not_finite.append(f"`{name}` is not JSON: send a number")
        return math.nan

    def floating(number: str) -> float:
        value = float(number)
        if not math.isfinite(value):
            not_finite.append(f"the number {number[:40]} is too large for a 64-bit float")
        return value

    try:
        value = json.loads(text, parse_constant=constant, parse_float=floating)
    except RecursionError:
        raise BadJSON("the body's JSON is nested too deeply") from None
    except BadJSON:
        raise
    except ValueError as e:
        raise BadJSON(f"the body is not valid JSON ({e})") from None
    if not_finite:
        where = _field_of(value, _not_finite)
        raise BadJSON(f"`{where}`: {not_finite[0]}", where)
    if _SURROGATE_ESCAPE.search(raw):
        where = _field_of(value, _lone_surrogate)
        if where is not None:
            raise BadJSON(f"`{where}` holds a lone UTF-16 surrogate (such as \\ud800), "
                          "which is not text: send valid Unicode", where)
    return value


def _not_finite(item: Any) -> bool:
    return isinstance(item, float) and not math.isfinite(item)


def _lone_surrogate(item: Any) -> bool:
    """A string that cannot be encoded as UTF-8."""
    return isinstance(item, str) and not _encodes(item)


def _field_of(value: Any, bad) -> str | None:
    """The top-level field (or "body") holding a value, or a key, for which bad() is
    true, or None. Iterative: the value may be nested as deep as the decoder allowed."""
    stack: list[tuple[Any, str]] = [(value, "body")]
    while stack:
        item, field = stack.pop()
        if bad(item):
            return field
        if isinstance(item, dict):
            for key, child in item.items():
                name = key if field == "body" else field
                if bad(key):
                    return name
                stack.append((child, name))
        elif isinstance(item, list):
            stack.extend((child, field) for child in item)
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class JSONParser(DRFJSONParser):
    """DRF's JSON parser with parse()'s rules (the REST API's only parser of JSON)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return parse(stream.read() if stream is not None else b"")
        except BadJSON as e:
            raise ParseError(str(e)) from None
