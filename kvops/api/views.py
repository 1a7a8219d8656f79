"""REST API (thin: validation in serializers, work in services, reads in selectors)."""
from __future__ import annotations

from django.db import transaction
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import mixins, permissions, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from kvops import selectors, services
from kvops.api.serializers import (EmptySerializer, EngineSerializer, EvictSerializer,
                                   JobCreateSerializer, JobSerializer,
                                   OperatorActionSerializer, PrefixSerializer)
from kvops.models import Engine, Job
from kvops.prompt_check import PromptTooLong, check_prompt_fits


class ServiceUnavailable(APIException):
    status_code = 503
    default_detail = "a service this call needs is unreachable; try again"
    default_code = "service_unavailable"


class IsOperator(permissions.BasePermission):
    message = "operator actions need an operator (staff) account"

    def has_permission(self, request, view) -> bool:
        return bool(request.user and request.user.is_staff)


class JobViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                 viewsets.GenericViewSet):
    serializer_class = JobSerializer

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
        return qs

    @extend_schema(
        request=JobCreateSerializer, responses={201: JobSerializer},
        parameters=[OpenApiParameter("status", str, enum=Job.Status.values, required=False)])
    def create(self, request, *args, **kwargs):
        serializer = JobCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        kwargs = serializer.job_kwargs()
        if kwargs["engine"] and not Engine.objects.filter(name=kwargs["engine"]).exists():
            raise NotFound(f"no engine named {kwargs['engine']!r}")
        try:
            check_prompt_fits(kwargs["prompt"], kwargs["messages"], kwargs["engine"])
        except PromptTooLong as e:
            raise ValidationError({"prompt": [str(e)]}) from None
        try:
            with transaction.atomic():
                # A token means a program; a session means someone on the pages.
                source = Job.Source.API if request.auth is not None else Job.Source.WEB
                job = services.create_job(request.user, source=source, **kwargs)
        except services.Unavailable as e:
            raise ServiceUnavailable(str(e)) from None
        return Response(JobSerializer(job).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = self.get_object()
        try:
            job = services.cancel_job(job)
        except services.Conflict as e:
            return Response({"error": str(e)}, status=status.HTTP_409_CONFLICT)
        return Response(JobSerializer(job).data)


class EngineViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = EngineSerializer
    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9_.-]+"
    pagination_class = None

    def get_queryset(self):
        return selectors.engines()

    @extend_schema(responses={200: inline_serializer("EngineDetail", {
        "engine": EngineSerializer(), "snapshot": serializers.DictField(allow_null=True)})})
    def retrieve(self, request, *args, **kwargs):
        engine = self.get_object()
        return Response({"engine": EngineSerializer(engine).data,
                         "snapshot": selectors.engine_snapshot(engine.name)})


class OperatorActionViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    serializer_class = OperatorActionSerializer

    def get_queryset(self):
        return selectors.operator_actions()


ACTION_RESULT = inline_serializer("OperatorResult", {
    "ok": serializers.BooleanField(), "result": serializers.JSONField(required=False),
    "error": serializers.CharField(required=False),
    "message": serializers.CharField(required=False)})
ERROR = inline_serializer("Error", {"error": serializers.CharField()})
OPERATOR_RESPONSES = {200: ACTION_RESULT, 400: ERROR, 403: ERROR, 404: ACTION_RESULT,
                      409: ACTION_RESULT, 504: ACTION_RESULT}


class RequestActionView(APIView):
    """POST /api/engines/<name>/requests/<request_id>/<action>/"""
    permission_classes = [permissions.IsAuthenticated, IsOperator]
    ACTIONS = ("preempt", "swap-out", "swap-in", "abort")

    @extend_schema(request=EmptySerializer, responses=OPERATOR_RESPONSES, parameters=[
        OpenApiParameter("action", str, OpenApiParameter.PATH, enum=list(ACTIONS))])
    def post(self, request, name: str, request_id: str, action: str):
        if action not in self.ACTIONS:
            raise NotFound(f"unknown action {action!r}; one of {', '.join(self.ACTIONS)}")
        EmptySerializer(data=request.data or {}).is_valid(raise_exception=True)
        engine = get_object_or_404(Engine, name=name)
        code, body = services.operator_action(request.user, engine, action, request_id,
                                              {"request_id": request_id})
        return Response(body, status=code)


class PrefixCacheActionView(APIView):
    """POST /api/engines/<name>/prefix-cache/<action>/"""
    permission_classes = [permissions.IsAuthenticated, IsOperator]
    SERIALIZERS = {"evict": EvictSerializer, "reset": EmptySerializer,
                   "pin": PrefixSerializer, "unpin": PrefixSerializer}

    @extend_schema(request=PrefixSerializer, responses=OPERATOR_RESPONSES, parameters=[
        OpenApiParameter("action", str, OpenApiParameter.PATH, enum=list(SERIALIZERS))])
    def post(self, request, name: str, action: str):
        serializer_class = self.SERIALIZERS.get(action)
        if serializer_class is None:
            raise NotFound(f"unknown action {action!r}; one of {', '.join(self.SERIALIZERS)}")
        serializer = serializer_class(data=request.data or {})
        serializer.is_valid(raise_exception=True)
        engine = get_object_or_404(Engine, name=name)
        arguments = {k: v for k, v in serializer.validated_data.items() if v is not None}
        code, body = services.operator_action(request.user, engine, action, "", arguments)
        return Response(body, status=code)
