"""GET /api/usage/: the bill, per user or tenant, as JSON or CSV (kvops/jobs/usage.py adds
it up; docs/api.md, "Usage")."""
from __future__ import annotations

import csv
import io
from datetime import timedelta

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import renderers, serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from kvops.jobs import usage

DEFAULT_PERIOD = timedelta(hours=24)


class UsageQuerySerializer(serializers.Serializer):
    by = serializers.ChoiceField(choices=usage.GROUPINGS, default="user")
    since = serializers.DateTimeField(required=False)
    until = serializers.DateTimeField(required=False)
    user = serializers.CharField(required=False, allow_blank=True)

    def validate(self, data: dict) -> dict:
        until = data.get("until") or timezone.now()
        since = data.get("since") or until - DEFAULT_PERIOD
        if since >= until:
            field = "since" if "since" in data else "until"
            raise ValidationError({field: [f"since ({since.isoformat()}) must be before "
                                           f"until ({until.isoformat()})"]})
        return {**data, "since": since, "until": until}


class CSVRenderer(renderers.BaseRenderer):
    """A usage report's rows, one line each, under a header (?format=csv)."""
    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None) -> bytes:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        columns = [data["by"], "jobs", *usage.COUNTS]
        writer.writerow(columns)
        for row in data["rows"]:
            writer.writerow([row[c] for c in columns])
        return out.getvalue().encode()


_ROW_FIELDS = {
    "user": serializers.CharField(required=False, help_text="with by=user"),
    "tenant": serializers.CharField(required=False, help_text="with by=tenant"),
    "jobs": serializers.IntegerField(),
    **{name: serializers.FloatField() if name.startswith("kv_block_seconds")
       else serializers.IntegerField() for name in usage.COUNTS}}


class UsageView(APIView):
    renderer_classes = [renderers.JSONRenderer, CSVRenderer]

    @extend_schema(
        parameters=[
            OpenApiParameter("by", str, enum=list(usage.GROUPINGS),
                             description="a row per user (username) or per tenant label "
                                         "(staff's jobs: \"staff\"); default user"),
            OpenApiParameter("since", str, description="ISO 8601: jobs ended at or after "
                                                       "(default: until less 24 h)"),
            OpenApiParameter("until", str, description="ISO 8601: jobs ended before "
                                                       "(default: now)"),
            OpenApiParameter("user", str, description="staff: only this user's jobs"),
            OpenApiParameter("format", str, enum=["json", "csv"],
                             description="csv: the same rows as CSV")],
        responses={200: inline_serializer("Usage", {
            "by": serializers.CharField(), "since": serializers.DateTimeField(),
            "until": serializers.DateTimeField(), "rows": inline_serializer("UsageRow", _ROW_FIELDS, many=True)})})
    def get(self, request):
        """What ended jobs (finished, failed, cancelled) used over a period, a row per
        user or tenant: tokens, cached tokens by tier, KV block-seconds by pool. Staff
        see everyone's; another user only their own jobs."""
        params = UsageQuerySerializer(data=request.query_params)
        params.is_valid(raise_exception=True)
        p = params.validated_data
        query = usage.UsageQuery(p["by"], p["since"], p["until"])
        rows = usage.report(request.user, query, p.get("user") or None)
        response = Response({"by": query.by, "since": query.since.isoformat(),
                             "until": query.until.isoformat(), "rows": rows})
        if getattr(request, "accepted_renderer", None) is not None and \
                request.accepted_renderer.format == "csv":
            response["Content-Disposition"] = 'attachment; filename="usage.csv"'
        return response

    def finalize_response(self, request, response, *args, **kwargs):
        # an error answers in the /api error shape, as JSON, whatever format was asked,
        # and so does anything but the report itself (OPTIONS: the view's description)
        if response.status_code >= 400 or request.method not in ("GET", "HEAD"):
            request.accepted_renderer = renderers.JSONRenderer()
            request.accepted_media_type = "application/json"
        return super().finalize_response(request, response, *args, **kwargs)
