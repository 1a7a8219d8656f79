"""GET /v1/models and /v1/models/<id>: the models the live engines serve."""
from __future__ import annotations

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse

from kvops import selectors
from kvops.openai import base, errors


def _model_entry(name: str, engines: list) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvops",
            "kvops_engines": engines}


@base.v1_view("GET")
async def models(request: HttpRequest, user) -> HttpResponse:
    served = await sync_to_async(selectors.served_models)()
    return JsonResponse({"object": "list", "data": [
        _model_entry(name, engines) for name, engines in sorted(served.items())]})


@base.v1_view("GET")
async def model(request: HttpRequest, user, model: str) -> HttpResponse:
    """GET /v1/models/<id>: one served model, or a 404 naming it."""
    served = await sync_to_async(selectors.served_models)()
    if model not in served:
        return errors.error(404, f"the model `{model}` does not exist (GET /v1/models lists those "
                                 "served)", "model", code="model_not_found")
    return JsonResponse(_model_entry(model, served[model]))
