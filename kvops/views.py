"""Pages (thin: they render templates; the data comes from the API and websockets)."""

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from engine.observe.story import FIRST_MISS_REASONS
from kvops import selectors
from kvops.dashboard import visibility
from kvops.intake.prompts import inspector
from kvops.operators import log_rows
from kvops.routing import tenancy
from kvops.models import Engine, Job
from kvops.what_if.what_if import engine_step_cost

ACTIONS_SHOWN = 200


def kv_blocks_label(config: dict) -> str:
    """What an engine's KV pool is called on the pages, by the device it lives on (its
    description's `device`): GPU KV blocks on CUDA, CPU KV blocks on the CPU, KV blocks
    otherwise (the simulator's)."""
    device = str(config.get("device") or "")
    if device.startswith("cuda"):
        return "GPU KV blocks"
    return "CPU KV blocks" if device == "cpu" else "KV blocks"


def chat_engines(engines: list[Engine]) -> dict[str, bool | None]:
    """Per engine, whether its model has a chat template (None: not readable here): the
    submit forms default to chat mode for an instruct model."""
    return {e.name: inspector.has_chat_template(e.config) for e in engines}


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    engines = list(selectors.engines())
    chat = chat_engines(engines)
    cards = [{"name": e.name, "status": e.status, "alive": selectors.engine_alive(e),
              "state": selectors.engine_state(e),
              "config": visibility.config_for(e.config, request.user),
              "metrics": visibility.metrics_for(e.metrics, request.user),
              "kv_label": kv_blocks_label(e.config), "chat": chat[e.name]}
             for e in engines]
    return render(request, "kvops/overview.html", {"engines": engines, "cards": cards,
                                                   "models": sorted(selectors.served_models()),
                                                   "chat": chat})


@login_required
def engine_page(request: HttpRequest, name: str) -> HttpResponse:
    engine = get_object_or_404(Engine, name=name)
    # tenant: the label of this user's requests in the engine's state (kvops/routing/tenancy.py)
    # miss_reasons: each first-miss reason in words (the KV stories, static/kvops/kv_story.js)
    page = {"name": engine.name, "operator": request.user.is_staff,
            "config": visibility.config_for(engine.config, request.user),
            "tenant": tenancy.tenant(request.user), "miss_reasons": FIRST_MISS_REASONS}
    if request.user.is_staff:  # the user names of the tenants the engine names now
        rows = ((engine.metrics or {}).get("kv_by_tenant") or {}).get("tenants") or ()
        page["tenant_names"] = tenancy.usernames(r["tenant"] for r in rows)
    return render(request, "kvops/engine.html",
                  {"engine": engine, "page": page, "operator": request.user.is_staff,
                   "kv_label": kv_blocks_label(engine.config),
                   "step_cost": engine_step_cost(engine)[0]})


@login_required
def jobs_page(request: HttpRequest) -> HttpResponse:
    engines = list(selectors.engines())
    page = {"engines": [e.name for e in engines], "statuses": Job.Status.values,
            "operator": request.user.is_staff, "chat": chat_engines(engines)}
    return render(request, "kvops/jobs.html", {"page": page})


@login_required
def job_page(request: HttpRequest, job_id: int) -> HttpResponse:
    job = get_object_or_404(selectors.jobs_visible_to(request.user), pk=job_id)
    engine = Engine.objects.filter(name=job.engine).first() if job.engine else None
    # chat_template: its engine's model has one (a completion that ended at once is told
    # that an instruct model wants chat mode)
    page = {"id": job.pk, "operator": request.user.is_staff, "miss_reasons": FIRST_MISS_REASONS,
            "chat_template": bool(engine and inspector.has_chat_template(engine.config))}
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
