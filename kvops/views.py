"""Pages (thin: they render templates; the data comes from the API and websockets)."""
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render

from kvops import selectors
from kvops.models import Engine


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    return render(request, "kvops/overview.html", {"engines": selectors.engines()})


@login_required
def engine_page(request: HttpRequest, name: str) -> HttpResponse:
    engine = get_object_or_404(Engine, name=name)
    return render(request, "kvops/engine.html", {"engine": engine})


@login_required
def jobs_page(request: HttpRequest) -> HttpResponse:
    return render(request, "kvops/jobs.html", {"jobs": selectors.jobs_visible_to(request.user)[:100]})


@login_required
def job_page(request: HttpRequest, job_id: int) -> HttpResponse:
    job = get_object_or_404(selectors.jobs_visible_to(request.user), pk=job_id)
    return render(request, "kvops/job.html", {"job": job})


@login_required
def actions_page(request: HttpRequest) -> HttpResponse:
    return render(request, "kvops/actions.html", {"actions": selectors.operator_actions()[:200]})
