"""Pages (thin: they render templates; the data comes from the API and websockets)."""

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from engine.observe.story import FIRST_MISS_REASONS
from kvops import selectors
from kvops.dashboard import visibility
from kvops.operators import log_rows
from kvops.routing import tenancy
from kvops.models import Engine, Job

ACTIONS_SHOWN = 200


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    engines = list(selectors.engines())
    cards = [{"name": e.name, "status": e.status, "alive": selectors.engine_alive(e),
              "state": selectors.engine_state(e),
              "config": visibility.config_for(e.config, request.user), "metrics": e.metrics}
             for e in engines]
    return render(request, "kvops/overview.html", {"engines": engines, "cards": cards,
                                                   "models": sorted(selectors.served_models())})


@login_required
def engine_page(request: HttpRequest, name: str) -> HttpResponse:
    engine = get_object_or_404(Engine, name=name)
    # tenant: the label of this user's requests in the engine's state (kvops/routing/tenancy.py)
    # miss_reasons: each first-miss reason in words (the KV stories, static/kvops/kv_story.js)
    page = {"name": engine.name, "operator": request.user.is_staff,
            "config": visibility.config_for(engine.config, request.user),
            "tenant": tenancy.tenant(request.user), "miss_reasons": FIRST_MISS_REASONS}
    return render(request, "kvops/engine.html",
                  {"engine": engine, "page": page, "operator": request.user.is_staff})


@login_required
def jobs_page(request: HttpRequest) -> HttpResponse:
    page = {"engines": [e.name for e in selectors.engines()], "statuses": Job.Status.values,
            "operator": request.user.is_staff}
    return render(request, "kvops/jobs.html", {"page": page})


@login_required
def job_page(request: HttpRequest, job_id: int) -> HttpResponse:
    job = get_object_or_404(selectors.jobs_visible_to(request.user), pk=job_id)
    page = {"id": job.pk, "operator": request.user.is_staff, "miss_reasons": FIRST_MISS_REASONS}
    return render(request, "kvops/job.html", {"job": job, "page": page})


@login_required
def actions_page(request: HttpRequest) -> HttpResponse:
    actions = selectors.operator_actions()
    engine = request.GET.get("engine", "")
    if engine:
        actions = actions.filter(engine=engine)
    rows = []
    for a in actions[:ACTIONS_SHOWN]:  # prompts in an action's params: staff only
        params = selectors.action_params_for(a, request.user)
        rows.append({"action": a, "params": log_rows.params_rows(params),
                     "answer": log_rows.answer(a.result)})
    return render(request, "kvops/actions.html", {
        "rows": rows, "engine": engine, "shown": ACTIONS_SHOWN,
        "engines": [e.name for e in selectors.engines()]})
