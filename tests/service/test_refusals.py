"""One table of refusals (kvops/jobs/refusals.py): the REST API and /v1 answer each refusal
of intake and admission with the same status, each in its own body: the REST API's names a
bad field in `fields`, OpenAI's in `param`."""
import json

import pytest
from rest_framework.views import exception_handler

from kvops.api.views import _refused
from kvops.intake import grammar_check, intake, limits
from kvops.jobs import admission, idempotency
from kvops.jobs.throttles import TooManyJobs
from kvops.openai import errors

# (a refusal, the status both APIs answer it with, the field or header it names in /v1)
REFUSALS = [
    (idempotency.BadKey("longer than 128 characters"), 400, idempotency.HEADER),
    (limits.InvalidParam("temperature", "must be at most 2"), 400, "temperature"),
    (limits.NotAllowed("priority", "only operators set it"), 403, "priority"),
    (intake.NotFound("model", "no engine serves it"), 404, "model"),
    (idempotency.KeyReused("used for another request"), 409, idempotency.HEADER),
    (TooManyJobs("over the cap of 4 jobs"), 429, None),
    (admission.Unavailable("Redis is unreachable"), 503, None),
    (grammar_check.Busy("every compiler is busy"), 503, None),
]


@pytest.mark.parametrize("refusal, status, param", REFUSALS,
                         ids=[type(r).__name__ for r, _, _ in REFUSALS])
def test_both_apis_answer_a_refusal_with_one_status(refusal, status, param):
    rest = exception_handler(_refused(refusal), {})
    v1 = errors.refusal(refusal)
    assert rest.status_code == v1.status_code == status
    assert json.loads(v1.content)["error"]["message"] == str(refusal)
    assert json.loads(v1.content)["error"]["param"] == param
    if status in (400, 403):  # a bad field: the REST API names it too
        assert rest.data == {param: [str(refusal)]}
    else:
        assert rest.data == {"detail": str(refusal)}


def test_a_failure_is_no_refusal_in_either_api():
    failure = RuntimeError("the database is on fire")
    assert _refused(failure) is None
    assert errors.refusal(failure) is None
