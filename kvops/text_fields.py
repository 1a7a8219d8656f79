"""Text and JSON columns that hold whatever a model or a client writes, U+0000 included.

PostgreSQL refuses the NUL character in `text` and in `jsonb` strings, and models emit it
(a byte-level tokenizer has a token for it; the default model's decodes to it). On
PostgreSQL these fields store text with a prefix-free escape that keeps every other
character as it is: NUL becomes ESCAPE + "0" and ESCAPE itself ESCAPE + "~", ESCAPE being
U+FFFE, a noncharacter no text is meant to carry. The escape of a concatenation is the
concatenation of the escapes, so SQL that appends a piece to a stored text (`output_text
|| %s`) keeps working when the piece is escaped with `escape_text`. SQLite stores NUL as
it is: there the fields are Django's own.
"""
from __future__ import annotations

import re
from typing import Any

from django.db import models

ESCAPE = "\ufffe"
_TO_DB = str.maketrans({"\x00": ESCAPE + "0", ESCAPE: ESCAPE + "~"})
_FROM_DB = re.compile(ESCAPE + "(.)", re.DOTALL)


def _unescape_match(m: re.Match) -> str:
    return "\x00" if m.group(1) == "0" else ESCAPE


def escape_text(text: str, connection) -> str:
    """`text` as stored on this connection's database (see the module's docstring)."""
    if connection.vendor != "postgresql" or ("\x00" not in text and ESCAPE not in text):
        return text
    return text.translate(_TO_DB)


def unescape_text(text: str) -> str:
    return _FROM_DB.sub(_unescape_match, text) if ESCAPE in text else text


def _walk(value: Any, change) -> Any:
    """value with every string in it (dict keys too) passed through change."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, list):
        return [_walk(v, change) for v in value]
    if isinstance(value, tuple):
        return tuple(_walk(v, change) for v in value)
    if isinstance(value, dict):
        return {_walk(k, change): _walk(v, change) for k, v in value.items()}
    return value


def _has_text_to_escape(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value or ESCAPE in value
    if isinstance(value, (list, tuple)):
        return any(_has_text_to_escape(v) for v in value)
    if isinstance(value, dict):
        return any(_has_text_to_escape(k) or _has_text_to_escape(v) for k, v in value.items())
    return False


class StoredTextField(models.TextField):
    """A TextField that takes NUL on PostgreSQL too."""

    def get_db_prep_value(self, value, connection, prepared=False):
        value = super().get_db_prep_value(value, connection, prepared)
        return escape_text(value, connection) if isinstance(value, str) else value

    def from_db_value(self, value, expression, connection):
        if isinstance(value, str) and connection.vendor == "postgresql":
            return unescape_text(value)
        return value


class StoredJSONField(models.JSONField):
    """A JSONField whose strings may hold NUL on PostgreSQL too."""

    def get_db_prep_value(self, value, connection, prepared=False):
        if (connection.vendor == "postgresql" and not prepared
                and not hasattr(value, "as_sql") and _has_text_to_escape(value)):
            value = _walk(value, lambda s: escape_text(s, connection))
        return super().get_db_prep_value(value, connection, prepared)

    def from_db_value(self, value, expression, connection):
        escaped = connection.vendor == "postgresql" and isinstance(value, str) and ESCAPE in value
        value = super().from_db_value(value, expression, connection)
        return _walk(value, unescape_text) if escaped else value
