"""Reads: what the API and pages show."""
from __future__ import annotations

import threading
import time

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from kvops import live
from kvops.models import Engine, Job, OperatorAction, WhatIfRun


def jobs_visible_to(user) -> QuerySet[Job]:
    """Staff see every job; other users their own."""
    qs = Job.objects.select_related("owner")
    return qs if user.is_staff else qs.filter(owner=user)


def heartbeat_age_s(engine: Engine) -> float | None:
    if engine.last_heartbeat is None:
        return None
    return (timezone.now() - engine.last_heartbeat).total_seconds()


def engine_alive(engine: Engine) -> bool:
    age = heartbeat_age_s(engine)
    return (engine.status == Engine.Status.READY and age is not None
            and age < settings.KVOPS_ENGINE_DEAD_AFTER_S)


OPERATOR_STATES = ("paused", "draining", "drained")


def engine_state(engine: Engine) -> str:
    """starting, ready, paused, draining or drained (an operator's pause or drain, from
    its last heartbeat), stopped or dead."""
    state = (engine.metrics or {}).get("state")
    if engine.status == Engine.Status.READY and state in OPERATOR_STATES:
        return state
    return engine.status


def engines() -> QuerySet[Engine]:
    return Engine.objects.all()


ENGINES_MAX_AGE_S = 0.5
_engines_lock = threading.Lock()
_engines_read: tuple[float, list[Engine]] = (float("-inf"), [])  # under _engines_lock


def forget_recent_engines() -> None:
    """The next recent_engines() reads the rows afresh (an engine's state just changed)."""
    global _engines_read
    with _engines_lock:
        _engines_read = (float("-inf"), [])


def recent_engines() -> list[Engine]:
    """Every engine row, read at most ENGINES_MAX_AGE_S ago: the per-job path (model
    check, prompt check, routing) reads them for every job, and they change with each
    heartbeat at most."""
    global _engines_read
    now = time.monotonic()
    with _engines_lock:
        read_at, rows = _engines_read
        if now - read_at <= ENGINES_MAX_AGE_S:
            return rows
    rows = list(Engine.objects.all())
    with _engines_lock:
        _engines_read = (now, rows)
    return rows


def engine_snapshot(name: str) -> dict | None:
    """The latest KV snapshot the engine stored (compact per-block arrays)."""
    return live.load_snapshot(name)


def operator_actions() -> QuerySet[OperatorAction]:
    return OperatorAction.objects.select_related("user")


WHAT_IF_LISTED = 20  # runs GET /api/engines/<name>/what-if/ lists
MAX_ID = 2 ** 63 - 1  # the largest id a database column holds


def what_if_runs(engine_name: str) -> list[WhatIfRun]:
    """The engine's what-if runs, newest first."""
    return list(WhatIfRun.objects.filter(engine=engine_name).select_related("user")
                [:WHAT_IF_LISTED])


def what_if_run(engine_name: str, run_id: int) -> WhatIfRun | None:
    if not 0 < run_id <= MAX_ID:  # (a larger id would overflow the query, not miss)
        return None
    return WhatIfRun.objects.filter(engine=engine_name, pk=run_id).select_related("user").first()


# a pin's prefix may be someone's prompt (or chat), and a salt names a tenant's hash chain
PROMPT_PARAMS = ("prompt", "messages", "token_ids", "cache_salt")
HIDDEN = "(hidden: staff only)"


def action_params_for(action: OperatorAction, viewer) -> dict:
    """The action's parameters as this viewer may see them: prompts (a pinned or evicted
    prefix) only for staff."""
    params = dict(action.params or {})
    if getattr(viewer, "is_staff", False):
        return params
    return {k: HIDDEN if k in PROMPT_PARAMS else v for k, v in params.items()}


def served_models() -> dict[str, list[str]]:
    """Model name -> engines serving it (live ones)."""
    out: dict[str, list[str]] = {}
    for engine in recent_engines():
        if engine_alive(engine):
            out.setdefault(model_name(engine), []).append(engine.name)
    return out


def candidate_engines(engine_name: str = "", model: str | None = None) -> list[Engine]:
    """The engines that may run a job: the one it names (alive or not), else the live
    engines serving `model`, else (no model) every live engine."""
    if engine_name:
        return [e for e in recent_engines() if e.name == engine_name]
    return [e for e in recent_engines() if engine_alive(e)
            and (model is None or model_name(e) == model)]


def engines_serving(model: str) -> list[Engine]:
    """The live engines whose model clients call `model` (see served_models)."""
    return [e for e in recent_engines() if engine_alive(e) and model_name(e) == model]


def model_name(engine: Engine) -> str:
    """The name clients use for an engine's model: its folder name."""
    return config_model_name(engine.config)


def config_model_name(config: dict) -> str:
    """The model's name in an engine's config (describe_config): its folder's name."""
    model = str((config or {}).get("model") or "unknown")
    return model.rstrip("/").split("/")[-1].split(":")[0]
