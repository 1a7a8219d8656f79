"""The operator log as a hash chain: each OperatorAction, once final, gets the next
position (`seq`) and a MAC over the previous row's MAC and its own content, keyed by the
server's secret key. Someone who can write the database but lacks the key cannot edit or
delete a row without `manage.py verify_audit` naming the first row that no longer
verifies (deleting the newest rows, or the oldest as a prune does, stays possible: the
chain cannot tell them from a log that ended or began there).

seal() is the one place a row becomes final; a row is never changed after it. Rows are
written by several web and worker processes at once: the chain cannot fork because
`seq` is unique. Two writers that read the same head both try its next position; the
database takes one (PostgreSQL's unique index; SQLite lets one writer in at a time) and
the other gets an IntegrityError, rereads the head and tries again. No lock is held
across processes and the rule is the same on both databases.
"""
from __future__ import annotations

import hashlib
import hmac
import json

from django.conf import settings
from django.db import IntegrityError, transaction

from kvops.models import OperatorAction

_KEY_LABEL = b"kvops audit chain"
_TRIES = 20  # positions taken by concurrent writers before one is ours


class AuditError(RuntimeError):
    """A row was to be sealed twice, or no position could be taken."""


def chain_key(secret_key: str) -> bytes:
    return hmac.new(secret_key.encode(), _KEY_LABEL, hashlib.sha256).digest()


def link(key: bytes, previous_mac: str, row) -> str:
    """The MAC of `row` after a row whose MAC is previous_mac ("" for the first)."""
    content = json.dumps(
        [row.seq, row.pk, row.user_id, row.created_at.isoformat(), row.engine, row.action,
         row.target, row.params, row.ok, row.status_code, row.result, row.idempotency_key],
        sort_keys=True, separators=(",", ":"), default=str)
    return hmac.new(key, previous_mac.encode() + b"\n" + content.encode(),
                    hashlib.sha256).hexdigest()


def seal(row: OperatorAction) -> OperatorAction:
    """Store `row` in its final state (inserted if new) at the head of the chain."""
    if row.seq is not None:
        raise AuditError(f"operator action {row.pk} is sealed already: it is not changed")
    key = chain_key(settings.SECRET_KEY)
    new = row.pk is None
    for _ in range(_TRIES):
        try:
            with transaction.atomic():
                head = OperatorAction.objects.exclude(seq=None).order_by("-seq") \
                    .only("seq", "mac").first()
                row.seq = 1 if head is None else head.seq + 1
                row.save()  # (a new row: its id and created_at, which the MAC covers)
                row.mac = link(key, "" if head is None else head.mac, row)
                row.save(update_fields=["mac"])
            return row
        except IntegrityError:
            taken = OperatorAction.objects.filter(seq=row.seq).exists()
            row.seq, row.mac = None, ""
            if new:
                row.pk = None
            if not taken:
                raise  # another constraint (an idempotency key used already)
    raise AuditError(f"no position in the operator log after {_TRIES} tries")


def verify(secret_key: str, rows) -> tuple[int, OperatorAction | None, str]:
    """Walk `rows` (sealed, in seq order): (rows that verified, the first that did not,
    why)."""
    key = chain_key(secret_key)
    previous, count = None, 0
    for row in rows:
        if previous is None:
            expected_mac = "" if row.seq == 1 else None  # (None: the start was pruned)
        else:
            if row.seq != previous.seq + 1:
                return count, row, (f"the row before it in the chain (position "
                                    f"{previous.seq + 1}) is missing")
            expected_mac = previous.mac
        if expected_mac is not None and not hmac.compare_digest(
                link(key, expected_mac, row), row.mac):
            return count, row, "its content or its MAC was changed"
        previous, count = row, count + 1
    return count, None, ""
