"""What every /v1 endpoint shares: the view decorator (method, Host, bearer token,
errors as JSON), the body parsed as a JSON object, a flag read by the field rules, the
submission rate, and admission with a job-stream subscription bound to each job."""
from __future__ import annotations

import asyncio
import functools

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from kvops.intake import intake, json_body, limits
from kvops.jobs import admission
from kvops.jobs.job_listener import cancel_abandoned
from kvops.jobs.throttles import allow_submission
from kvops.models import Job
from kvops.openai import auth, errors
from kvops.stream.stream_hub import get_hub


def v1_view(method: str):
    """A /v1 view taking `method` only, for an authenticated caller (the view gets its
    user after the request), every answer in OpenAI's shape. The Host header is checked
    against ALLOWED_HOSTS here: /v1 runs without CommonMiddleware."""
    def wrap(view):
        @functools.wraps(view)
        async def checked(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            request.get_host()
            if request.method != method:
                return errors.error(405, f"use {method}")
            user = await auth.authenticate(request)
            if user is None:
                return auth.unauthorized()
            return await view(request, user, *args, **kwargs)
        return errors.json_errors(checked)
    return wrap


def flag(body: dict, name: str, default: bool = False) -> bool:
    try:
        return limits.flag(name, body.get(name), default)
    except limits.InvalidParam as e:
        raise errors.BadRequest(str(e), e.param) from None


def parse_body(request: HttpRequest) -> dict:
    try:
        body = json_body.parse(request.body or b"null")
    except json_body.BadJSON as e:
        raise errors.BadRequest(str(e), e.param) from None
    if not isinstance(body, dict):
        raise errors.BadRequest("the body must be a JSON object")
    return body


async def rate_limited(user) -> JsonResponse | None:
    """A 429 if the user is over the submission rate (staff never are)."""
    if user.is_staff:
        return None
    wait = await sync_to_async(allow_submission)(user)
    if wait is None:
        return None
    rate = settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["jobs"]
    response = errors.error(429, f"too many requests: at most {rate} (KVOPS_JOB_RATE); "
                                 f"retry in {wait:.0f} s", type_="rate_limit_exceeded",
                            code="rate_limit_exceeded")
    response["Retry-After"] = str(max(1, round(wait)))
    return response


async def admit(news: list[intake.NewJob]) -> tuple[list[Job], list]:
    """Store the calls' jobs, each with a hub subscription bound to it before its commit
    dispatches it (so it sees every update). A batch whose job is refused is refused
    whole: the jobs of it already stored are cancelled, as a client gone away cancels."""
    hub = get_hub()
    subs = []
    try:
        for _ in news:
            subs.append(await hub.open())
        outcomes = await asyncio.gather(
            *(admission.admit_async(new, lambda job, sub=sub: sub.hub.bind(sub, job.pk))
              for new, sub in zip(news, subs)), return_exceptions=True)
    except BaseException:
        for sub in subs:
            sub.close()
        raise
    failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
    if failed is not None:
        for outcome, sub in zip(outcomes, subs):
            sub.close()
            if isinstance(outcome, Job):
                cancel_abandoned(outcome.pk)
        raise failed
    return outcomes, subs
