"""Why a submission is refused, as HTTP: one table from the refusals of intake and admission
to the status each is answered with, for both APIs (the REST API, kvops/api/views.py, and
/v1, kvops/openai/errors.py); each writes its own error body around it."""
from __future__ import annotations

import dataclasses

from kvops.intake import grammar_check, intake, limits
from kvops.jobs import admission, idempotency
from kvops.jobs.throttles import TooManyJobs


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    status: int  # the HTTP status
    param: str | None  # the field (or header) at fault, where one is
    code: str | None  # a reason a program can match, where the APIs give one


# What was refused, its status, where the fault is (the Idempotency-Key header, the field
# the error names, or neither) and its code. The first row that matches answers: NotAllowed
# is an InvalidParam, so it comes first.
_HEADER, _FIELD = "header", "field"
_TABLE: tuple[tuple[type[Exception] | tuple[type[Exception], ...], int, str | None,
                    str | None], ...] = (
    (idempotency.BadKey, 400, _HEADER, None),
    (limits.NotAllowed, 403, _FIELD, None),
    (limits.InvalidParam, 400, _FIELD, None),
    (intake.NotFound, 404, _FIELD, "model_not_found"),
    (idempotency.KeyReused, 409, _HEADER, "idempotency_key_reused"),
    ((admission.Unavailable, grammar_check.Busy), 503, None, None),
    (TooManyJobs, 429, None, "too_many_jobs"),
)


def refusal_of(e: Exception) -> Refusal | None:
    """How the APIs answer e, a refusal of parsing or admission; None: e is no refusal
    (a failure, answered as one)."""
    for kind, status, fault, code in _TABLE:
        if isinstance(e, kind):
            param = idempotency.HEADER if fault == _HEADER \
                else e.param if fault == _FIELD else None
            return Refusal(status, param, code)
    return None
