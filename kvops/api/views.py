"""REST API (thin: jobs parsed by kvops/intake/intake.py and stored by kvops/jobs/admission.py,
other input validated in serializers, writes in the modules that own them, reads in
selectors)."""
from __future__ import annotations

import re
from datetime import datetime, timezone

from django.http import Http404
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from engine.serve.commands import STATE_COMMANDS
from kvops import selectors
from kvops.dashboard import kv_story_view, visibility
from kvops.intake import intake
from kvops.jobs import admission, idempotency, job_store, refusals
from kvops.operators import operator_actions, pin_target, prefix_lookup
from kvops.what_if import what_if
from kvops.api import errors
from kvops.api.serializers import (DrainSerializer, EmptySerializer, EngineSerializer,
                                   EvictSerializer, MigrateSerializer, RetentionSerializer,
                                   JobSerializer, LimitsSerializer,
                                   OperatorActionSerializer, PrefixLookupSerializer,
                                   PrefixSerializer, TenantLimitsSerializer,
                                   WhatIfRunSerializer, WhatIfSerializer)
from kvops.models import Engine, Job
from kvops.routing import tenancy
from kvops.jobs.throttles import JobSubmitThrottle


class ServiceUnavailable(APIException):
    status_code = 503
    default_detail = "a service this call needs is unreachable; try again"
    default_code = "service_unavailable"


class Refused(APIException):
    """A refusal of intake or admission, answered with the status kvops/jobs/refusals.py
    gives it (the table /v1 answers from too): a bad field's (400, 403) names the field,
    any other's is its message."""

    def __init__(self, e: Exception, refusal: refusals.Refusal) -> None:
        self.status_code = refusal.status
        field = refusal.status in (400, 403)
        super().__init__({refusal.param: [str(e)]} if field else str(e),
                         refusal.code or errors.error_type(refusal.status))


def _refused(e: Exception) -> Refused | None:
    """e as the REST API answers it, if it is a refusal; None: a failure."""
    refusal = refusals.refusal_of(e)
    return None if refusal is None else Refused(e, refusal)


def _idempotency_key(request) -> str:
    try:
        return idempotency.key_of(request.headers)
    except idempotency.BadKey as e:
        raise _refused(e) from None


def _answer(create) -> Response | None:
    """Answer 201 with the job create() returns (None: no answer), marked
    `Idempotent-Replayed: true` if it was stored by an earlier call with the same key."""
    job = create()
    if job is None:
        return None
    response = Response(JobSerializer(job).data, status=status.HTTP_201_CREATED)
    if getattr(job, "replayed", False):
        response["Idempotent-Replayed"] = "true"
    return response


class IsOperator(permissions.BasePermission):
    message = "operator actions need an operator (staff) account"

    def has_permission(self, request, view) -> bool:
        return bool(request.user and request.user.is_staff)


class JobViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                 viewsets.GenericViewSet):
    serializer_class = JobSerializer
    queryset = Job.objects.none()  # the schema's view of it; requests use get_queryset

    def get_throttles(self):
        return [JobSubmitThrottle()] if self.action == "create" else []

    def get_object(self) -> Job:
        try:
            return super().get_object()
        except Http404:  # its message would name neither the job nor whose jobs are seen
            raise NotFound(f"no job {self.kwargs.get('pk')!r} among those you may see "
                           "(GET /api/jobs/ lists them)") from None

    def get_queryset(self):
        qs = selectors.jobs_visible_to(self.request.user)
        params = self.request.query_params
        if "status" in params:
            if params["status"] not in Job.Status.values:
                raise ValidationError({"status": [f"must be one of {', '.join(Job.Status.values)}"]})
            qs = qs.filter(status=params["status"])
        if params.get("engine"):
            qs = qs.filter(engine=params["engine"])
        if params.get("mine") in ("1", "true"):
            qs = qs.filter(owner=self.request.user)
        if self.action == "list":
            qs = qs.defer("kv_story")  # (GET /api/jobs/<id>/kv/ shows it)
        return qs

    @extend_schema(
        request={"application/json": intake.job_schema()}, responses={201: JobSerializer},
        parameters=[OpenApiParameter(
            idempotency.HEADER, str, OpenApiParameter.HEADER, required=False,
            description="a retried submission with the same key (per user) returns the "
                        "job the first one stored; the same key for another job: 409")])
    def create(self, request, *args, **kwargs):
        key = _idempotency_key(request)
        try:
            # A token means a program; a session means someone on the pages.
            new = intake.parse_job(request.data, request.user, Job.Source.API
                                   if request.auth is not None else Job.Source.WEB, key)
            return _answer(lambda: admission.admit(new))
        except Exception as e:  # noqa: BLE001  (each refusal its own status; others are 500s)
            refused = _refused(e)
            if refused is None:
                raise
            raise refused from None

    @extend_schema(request=None, responses={200: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = self.get_object()
        try:
            job = job_store.cancel_job(job)
        except job_store.Conflict as e:
            return errors.error_response(409, str(e), "conflict")
        return Response(JobSerializer(job).data)

    @extend_schema(responses={200: inline_serializer("JobKVStory", {
        "job": serializers.IntegerField(), "status": serializers.CharField(),
        "engine": serializers.CharField(allow_null=True),
        "told": serializers.BooleanField(),
        "block_size": serializers.IntegerField(allow_null=True),
        "prompt_tokens": serializers.IntegerField(),
        "cached_tokens": serializers.DictField(child=serializers.IntegerField()),
        "blocks": serializers.ListField(child=serializers.DictField()),
        "first_miss": serializers.DictField(allow_null=True),
        "preemptions": serializers.ListField(child=serializers.DictField()),
        "routing": serializers.DictField(),
        "copy_on_write": serializers.IntegerField(),
        "window_freed": serializers.IntegerField(),
        "block_seconds": serializers.DictField(child=serializers.FloatField(), allow_null=True),
        "moments": serializers.DictField()})})
    @action(detail=True, methods=["get"])
    def kv(self, request, pk=None):
        """The job's KV story: where each prompt block's K/V came from (GPU, CPU tier,
        or computed), why the first block that missed was not cached (proved from its
        engine's history, "unknown" where that cannot tell), its preemptions and their
        causes, and the router's view when it chose (docs/api.md, "KV story")."""
        return Response(kv_story_view.document(self.get_object(), request.user))


EVENTS_PAGE_MAX = 1000  # KV events per page of /api/engines/<name>/events/


class EngineViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = EngineSerializer
    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9_.-]+"
    pagination_class = None

    def get_queryset(self):
        return selectors.engines()

    def get_object(self) -> Engine:
        return engine_or_404(self.kwargs["name"])

    @extend_schema(responses={200: inline_serializer("EngineDetail", {
        "engine": EngineSerializer(), "snapshot": serializers.DictField(allow_null=True)})})
    def retrieve(self, request, *args, **kwargs):
        engine = self.get_object()
        snapshot = selectors.engine_snapshot(engine.name)
        if snapshot is not None and not visibility.sees_everything(request.user):
            snapshot = visibility.seal_document(snapshot, visibility.viewer_tenant(request.user))
        return Response({"engine": self.get_serializer(engine).data, "snapshot": snapshot})

    @extend_schema(
        parameters=[
            OpenApiParameter("since", str, description="an event id from an earlier page (the "
                             "events after it), or an ISO 8601 time (the events from it on); "
                             "none: from the oldest kept"),
            OpenApiParameter("limit", int, description=f"1-{EVENTS_PAGE_MAX} (default 100)")],
        responses={200: inline_serializer("EngineEvents", {
            "events": serializers.ListField(child=serializers.DictField()),
            "next": serializers.CharField(allow_null=True),
            "oldest": serializers.CharField(allow_null=True)})})
    @action(detail=True, methods=["get"])
    def events(self, request, name=None):
        """The engine's stored KV event history, oldest first, a page at a time: pass
        `next` back as `since` for the following page (null once none is left). The
        history is bounded (KVOPS_EVENT_HISTORY events per engine): `oldest` says where
        it begins now."""
        from kvops import live

        engine = self.get_object()
        after = _events_cursor(request.query_params.get("since"))
        try:
            limit = int(request.query_params.get("limit", 100))
        except ValueError:
            raise ValidationError({"limit": "an integer"}) from None
        if not 1 <= limit <= EVENTS_PAGE_MAX:
            raise ValidationError({"limit": f"between 1 and {EVENTS_PAGE_MAX}"})
        if after == LAST_STREAM_ID:  # nothing can come after it
            events, oldest = [], live.events_page(engine.name, None, 1)[1]
        else:
            events, oldest = live.events_page(engine.name, after, limit)
        if not visibility.sees_everything(request.user):
            events = visibility.seal_events(events)
        return Response({"events": events,
                         "next": events[-1]["id"] if len(events) == limit else None,
                         "oldest": oldest})


LAST_STREAM_ID = f"{2**64 - 1}-{2**64 - 1}"


def _events_cursor(since: str | None) -> str | None:
    """`since` as the stream id to read after: an event id as given, an ISO time as
    the last id before that millisecond."""
    if not since:
        return None
    match = re.fullmatch(r"([0-9]{1,20})-([0-9]{1,20})", since)
    if match:  # a Redis stream id: two unsigned 64-bit integers
        if max(int(match[1]), int(match[2])) >= 2**64:
            raise ValidationError({"since": "an event id's two parts are below 2**64"})
        return since
    try:
        when = datetime.fromisoformat(since.replace("Z", "+00:00"))
    except ValueError:
        raise ValidationError({"since": "an event id (\"<ms>-<n>\") or an ISO 8601 time"}) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    ms = int(when.timestamp() * 1000)
    return f"{ms - 1}-18446744073709551615" if ms > 0 else None


class OperatorActionViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    serializer_class = OperatorActionSerializer

    def get_queryset(self):
        return selectors.operator_actions()


ACTION_RESULT = inline_serializer("OperatorResult", {
    "ok": serializers.BooleanField(), "result": serializers.JSONField(required=False)})
ERROR = inline_serializer("Error", {"error": inline_serializer("ErrorDetail", {
    "type": serializers.CharField(help_text="the kind of error, one per HTTP status"),
    "code": serializers.CharField(help_text="its cause: DRF's or a refusal's code, or the "
                                            "engine's error class (InvalidStateError)"),
    "message": serializers.CharField(),
    "field": serializers.CharField(allow_null=True, help_text="the first field at fault"),
    "fields": serializers.DictField(help_text="each field's messages")})})
OPERATOR_RESPONSES = {200: ACTION_RESULT, 400: ERROR, 403: ERROR, 404: ERROR, 409: ERROR,
                      504: ERROR}


def engine_or_404(name: str) -> Engine:
    """The engine named name; a 404 saying so if there is none (get_object_or_404's
    message would name neither the engine nor where they are listed)."""
    engine = Engine.objects.filter(name=name).first()
    if engine is None:
        raise NotFound(f"no engine is named {name!r} (GET /api/engines/ lists them)")
    return engine


def _checked_action(request, serializer_class, name: str, action: str,
                    target: str) -> Response:
    """The body checked by serializer_class (400 naming the field), then the engine's
    action (404 for an unknown engine) with the fields given, nulls left out."""
    serializer = serializer_class(data=request.data or {})
    serializer.is_valid(raise_exception=True)
    engine = engine_or_404(name)
    arguments = {k: v for k, v in serializer.validated_data.items() if v is not None}
    return _action_answer(request, engine, action, target, arguments)


def _action_answer(request, engine: Engine, action: str, target: str,
                   arguments: dict) -> Response:
    try:
        code, body, replayed = operator_actions.operator_action(
            request.user, engine, action, target, arguments, _idempotency_key(request))
    except idempotency.KeyReused as e:
        raise _refused(e) from None
    # the engine's refusal ({"ok": false, "error": <its class>, "message"}, as the
    # operator log keeps it) in the API's error shape
    response = Response(body, status=code) if code == 200 else errors.error_response(
        code, body.get("message") or body.get("error") or "", body.get("error"))
    if replayed:
        response["Idempotent-Replayed"] = "true"
    return response


IDEMPOTENCY_KEY = OpenApiParameter(
    idempotency.HEADER, str, OpenApiParameter.HEADER, required=False,
    description="a retried call with the same key (per user) gets the first call's answer, "
                "and nothing happens twice; the same key for another request: 409")


class RequestActionView(APIView):
    """POST /api/engines/<name>/requests/<request_id>/<action>/: preempt, swap-out,
    swap-in, abort, or migrate {"to": engine, "staged": true}: move the running request
    with its KV cache to another engine of the same model; answered once it runs there
    (its client's stream goes on from there)."""
    permission_classes = [permissions.IsAuthenticated, IsOperator]
    ACTIONS = ("preempt", "swap-out", "swap-in", "abort", "migrate")

    @extend_schema(request=MigrateSerializer, responses=OPERATOR_RESPONSES, parameters=[
        OpenApiParameter("action", str, OpenApiParameter.PATH, enum=list(ACTIONS)),
        IDEMPOTENCY_KEY], description="The body is {} but for migrate.")
    def post(self, request, name: str, request_id: str, action: str):
        if action not in self.ACTIONS:
            raise NotFound(f"unknown action {action!r}; one of {', '.join(self.ACTIONS)}")
        serializer = (MigrateSerializer if action == "migrate" else EmptySerializer)(
            data=request.data or {})
        serializer.is_valid(raise_exception=True)
        engine = engine_or_404(name)
        return _action_answer(request, engine, action, request_id,
                              {"request_id": request_id, **serializer.validated_data})


class EngineActionView(APIView):
    """POST /api/engines/<name>/pause/ and /resume/: stop running steps (every request
    keeps its place and its KV blocks; new jobs routed here wait) and start again.
    /drain/ and /undrain/: route no new jobs here (its worker leaves the shared queue),
    and let the running ones finish (mode "wait", the default), move them to the other
    engines of its model (mode "migrate", optionally "to" one engine) or end them (mode
    "abort"); the state goes draining, then drained. /undrain/ takes jobs again."""
    permission_classes = [permissions.IsAuthenticated, IsOperator]
    ACTIONS = STATE_COMMANDS

    @extend_schema(request=DrainSerializer, responses=OPERATOR_RESPONSES,
                   parameters=[IDEMPOTENCY_KEY], description="The body is {} but for drain.")
    def post(self, request, name: str, action: str):
        return _checked_action(request, DrainSerializer if action == "drain" else EmptySerializer,
                               name, action, name)


class EngineLimitsView(APIView):
    """POST /api/engines/<name>/limits/ {max_num_seqs, max_num_batched_tokens}: change
    the batch limits live, between two steps, within [1, their value at start]."""
    permission_classes = [permissions.IsAuthenticated, IsOperator]

    @extend_schema(request=LimitsSerializer, responses=OPERATOR_RESPONSES,
                   parameters=[IDEMPOTENCY_KEY])
    def post(self, request, name: str):
        return _checked_action(request, LimitsSerializer, name, "set-limits", name)


class EngineRetentionView(APIView):
    """POST /api/engines/<name>/retention/ {pin_budget}: change what the prefix cache
    keeps, live (audited as every operator action)."""
    permission_classes = [permissions.IsAuthenticated, IsOperator]

    @extend_schema(request=RetentionSerializer, responses=OPERATOR_RESPONSES,
                   parameters=[IDEMPOTENCY_KEY])
    def post(self, request, name: str):
        return _checked_action(request, RetentionSerializer, name, "retention", name)


class EngineTenantView(APIView):
    """POST /api/engines/<name>/tenants/ {user, cache_quota, weight, clear}: one
    tenant's own quota of the GPU pool's cached blocks and its weight under fairness
    vtc, live (audited as every operator action); answers the tenant's limits.
    GET: the tenants the engine names now (its KV by tenant, as of its last heartbeat),
    each with its user's name (null: a label no user has, a deleted user's); the engine
    page asks it for a label it meets without a name."""
    permission_classes = [permissions.IsAuthenticated, IsOperator]

    @extend_schema(request=None, responses={200: inline_serializer("EngineTenants", {
        "engine": serializers.CharField(),
        "tenants": serializers.ListField(child=serializers.DictField()),
        "other": serializers.DictField(allow_null=True)})})
    def get(self, request, name: str):
        engine = engine_or_404(name)
        by_tenant = (engine.metrics or {}).get("kv_by_tenant") or {}
        rows = by_tenant.get("tenants") or []
        names = tenancy.usernames(r["tenant"] for r in rows)
        return Response({"engine": engine.name,
                         "tenants": [{**r, "user": names.get(r["tenant"])} for r in rows],
                         "other": by_tenant.get("other")})

    @extend_schema(request=TenantLimitsSerializer, responses=OPERATOR_RESPONSES,
                   parameters=[IDEMPOTENCY_KEY])
    def post(self, request, name: str):
        serializer = TenantLimitsSerializer(data=request.data or {})
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        user = data.pop("user")
        arguments = {"tenant": tenancy.tenant(user), "user": user.username,
                     **{k: v for k, v in data.items() if v not in (None, [])}}
        return _action_answer(request, engine_or_404(name), "tenant", user.username, arguments)


class PrefixCacheActionView(APIView):
    """POST /api/engines/<name>/prefix-cache/<action>/: evict, reset, or pin and unpin a
    prefix named by `job`, `messages`, `token_ids` or `text` (kvops/operators/pin_target.py)."""
    permission_classes = [permissions.IsAuthenticated, IsOperator]
    SERIALIZERS = {"evict": EvictSerializer, "reset": EmptySerializer,
                   "pin": PrefixSerializer, "unpin": PrefixSerializer}

    @extend_schema(request=PrefixSerializer, responses=OPERATOR_RESPONSES, parameters=[
        OpenApiParameter("action", str, OpenApiParameter.PATH, enum=list(SERIALIZERS)),
        IDEMPOTENCY_KEY])
    def post(self, request, name: str, action: str):
        serializer_class = self.SERIALIZERS.get(action)
        if serializer_class is None:
            raise NotFound(f"unknown action {action!r}; one of {', '.join(self.SERIALIZERS)}")
        if serializer_class is not PrefixSerializer:
            return _checked_action(request, serializer_class, name, action, "")
        serializer = PrefixSerializer(data=request.data or {})
        serializer.is_valid(raise_exception=True)
        engine = engine_or_404(name)
        try:  # a job or a chat made into the token ids the engine cached
            arguments = pin_target.engine_arguments(engine, serializer.validated_data)
        except pin_target.Refused as e:
            code = "invalid" if e.status == 400 else "not_renderable"
            return errors.error_response(e.status, f"{e.field}: {e}", code, {e.field: [str(e)]})
        return _action_answer(request, engine, action, "", arguments)


def _tiers(name: str):
    return inline_serializer(name, {
        "gpu": serializers.IntegerField(),
        "cpu": serializers.IntegerField(allow_null=True),
        "disk": serializers.IntegerField(allow_null=True),
        "total": serializers.IntegerField()}, allow_null=True)


PREFIX_LOOKUP = inline_serializer("PrefixLookup", {
    "model": serializers.CharField(allow_null=True),
    "user": serializers.CharField(help_text="whose cache salt the lookup was under"),
    "salted": serializers.BooleanField(help_text="false: the shared, unsalted cache"),
    "engines": inline_serializer("PrefixLookupEngine", {
        "engine": serializers.CharField(), "model": serializers.CharField(),
        "block_size": serializers.IntegerField(),
        "num_prompt_tokens": serializers.IntegerField(allow_null=True),
        "router": _tiers("PrefixLookupRouter"),
        "engine_cache": _tiers("PrefixLookupEngineCache"),
        "errors": serializers.ListField(child=serializers.CharField())}, many=True)})


class PrefixLookupView(APIView):
    """POST /api/prefix-lookup/: which engine holds this prefix, and where. Name it by
    exactly one of `text` (tokenized as a completion's prompt), `messages` (rendered as
    a chat job's, without the generation prompt), `token_ids` or `job` (what that job
    ran, under its owner's cache salt); `model` picks the engines (all live ones without
    it). Per engine, the leading cached tokens per level (gpu, cpu, disk; null: a level
    that view has not) as the router's prefix index sees them and as the engine itself
    answers. Under your own cache salt; staff may name a `user` to look up under theirs
    (docs/api.md, "Looking up a prefix")."""
    permission_classes = [permissions.IsAuthenticated]

    @extend_schema(request=PrefixLookupSerializer,
                   responses={200: PREFIX_LOOKUP, 400: ERROR, 403: ERROR})
    def post(self, request):
        serializer = PrefixLookupSerializer(data=request.data or {})
        serializer.is_valid(raise_exception=True)
        try:
            return Response(prefix_lookup.look_up(request.user, serializer.validated_data))
        except pin_target.Refused as e:
            code = "permission_denied" if e.status == 403 else "invalid"
            return errors.error_response(e.status, f"{e.field}: {e}", code, {e.field: [str(e)]})


WHAT_IF_RESPONSES = {202: WhatIfRunSerializer, 400: ERROR, 403: ERROR, 404: ERROR, 409: ERROR,
                     503: ERROR}


class WhatIfView(APIView):
    """POST /api/engines/<name>/what-if/: replay the engine's jobs of the last `minutes`
    through the capacity simulator under its own configuration and under the settings
    given (or, with `sweep`, under each value of one setting), on the ops worker;
    answers 202 with the run (poll its `id`). Audited.
    GET: the engine's recent runs, newest first."""
    permission_classes = [permissions.IsAuthenticated, IsOperator]

    @extend_schema(request=WhatIfSerializer, responses=WHAT_IF_RESPONSES,
                   parameters=[IDEMPOTENCY_KEY])
    def post(self, request, name: str):
        serializer = WhatIfSerializer(data=request.data or {})
        serializer.is_valid(raise_exception=True)
        engine = engine_or_404(name)
        data = serializer.validated_data
        try:
            run = what_if.start(request.user, engine, data["minutes"], data["max_jobs"],
                                serializer.changes(), serializer.step_cost(),
                                _idempotency_key(request), data["sweep"])
        except idempotency.KeyReused as e:
            raise _refused(e) from None
        except what_if.Refused as e:
            return errors.error_response(400, str(e), "refused")
        except what_if.Busy as e:
            return errors.error_response(409, str(e), "busy")
        except what_if.Unavailable as e:
            raise ServiceUnavailable(str(e)) from None
        response = Response(WhatIfRunSerializer(run).data, status=status.HTTP_202_ACCEPTED)
        if getattr(run, "replayed", False):
            response["Idempotent-Replayed"] = "true"
        return response

    @extend_schema(responses={200: WhatIfRunSerializer(many=True), 403: ERROR, 404: ERROR})
    def get(self, request, name: str):
        engine = engine_or_404(name)
        runs = [what_if.settle(run) for run in selectors.what_if_runs(engine.name)]
        return Response(WhatIfRunSerializer(runs, many=True).data)


class WhatIfDetailView(APIView):
    """GET /api/engines/<name>/what-if/<id>/: the run's status and progress, then the
    trace it replayed and both replays' results."""
    permission_classes = [permissions.IsAuthenticated, IsOperator]

    @extend_schema(responses={200: WhatIfRunSerializer, 403: ERROR, 404: ERROR})
    def get(self, request, name: str, run_id: int):
        run = selectors.what_if_run(name, run_id)
        if run is None:
            raise NotFound(f"engine {name!r} has no what-if run {run_id}")
        return Response(WhatIfRunSerializer(what_if.settle(run)).data)
