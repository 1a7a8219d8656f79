"""A move's ticket: the service's word that one request may move from one engine to
another, once, before a deadline.

Whoever starts a move (an operator's, a drain's, a prefill engine's hand-over) is a
worker of the service, and it signs a ticket with the deployment's "migration ticket"
key (engine/keys.py); the source core sends it with its first message, and the
destination core takes the move only if the ticket names this request, this engine as
the destination, the engine the request comes from and (when it has one) its job, has
not expired, and has not been used (its nonce). The messages of a move after its first
come from the peer that opened it, and only those; a peer's `cancel` and `abort` touch
only the moves it opened. So a peer on the migration port can move nothing that the
service did not send, and nothing twice.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import time

from engine.errors import MigrationRefused
from engine.keys import derive

FIELDS = ("request_id", "job_id", "source", "destination", "expires", "nonce")


@dataclasses.dataclass(frozen=True, slots=True)
class Ticket:
    request_id: str
    job_id: str | None  # the request's job; None for a request without one
    source: str  # the engine the request runs on (its name)
    destination: str  # the engine it may move to (its name)
    expires: float  # Unix time: the move's first message must arrive before it
    nonce: str  # makes each ticket single-use at the destination


def _mac(key: bytes, ticket: Ticket) -> str:
    # Each field as its repr, one per line: no field's text can shift into another's
    text = "\n".join(repr(getattr(ticket, f)) for f in FIELDS)
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def sign(secret: str, request_id: str, job_id: str | None, source: str, destination: str,
         expires: float) -> dict:
    """A ticket for one move, as the source's messages carry it."""
    ticket = Ticket(request_id, None if job_id is None else str(job_id), source, destination,
                    float(expires), secrets.token_hex(16))
    return {**dataclasses.asdict(ticket), "mac": _mac(derive(secret, "migration ticket"), ticket)}


def verify(key: bytes, raw: object, destination: str, now: float | None = None) -> Ticket:
    """The ticket in `raw` if it is signed with `key` (derive(secret, "migration ticket")),
    is for `destination` and has not expired; MigrationRefused otherwise (a message that
    says which check failed, never what the ticket should have been)."""
    if not isinstance(raw, dict) or set(raw) != {*FIELDS, "mac"}:
        raise MigrationRefused("the move carries no ticket")
    kinds = {"request_id": str, "source": str, "destination": str, "nonce": str, "mac": str}
    if any(not isinstance(raw[f], t) for f, t in kinds.items()) or \
            not (raw["job_id"] is None or isinstance(raw["job_id"], str)) or \
            not isinstance(raw["expires"], float):
        raise MigrationRefused("the move's ticket is malformed")
    ticket = Ticket(*(raw[f] for f in FIELDS))
    if not hmac.compare_digest(_mac(key, ticket), raw["mac"]):
        raise MigrationRefused("the move's ticket is not signed by this deployment")
    if ticket.destination != destination:
        raise MigrationRefused(f"the move's ticket is for engine {ticket.destination!r}")
    if (time.time() if now is None else now) > ticket.expires:
        raise MigrationRefused("the move's ticket has expired")
    return ticket
