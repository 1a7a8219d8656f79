"""GET /api/engines/<name>/timeline/ (what the engine's KV history holds) and
/api/engines/<name>/timeline/state/?at=... (the keyframe and deltas that rebuild its state
at a moment): the engine page's timeline, kept by kvops/dashboard/timeline.py."""
from __future__ import annotations

import math
from datetime import datetime, timezone

import redis
from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import permissions, serializers
from rest_framework.exceptions import NotFound
from rest_framework.response import Response
from rest_framework.views import APIView

from kvops.dashboard import timeline, visibility
from kvops.api.views import ERROR, ServiceUnavailable, engine_or_404

THROUGH = ("at", "window")


class MomentField(serializers.Field):
    """A moment: Unix time in seconds, or an ISO 8601 time (UTC unless it says)."""

    def to_internal_value(self, data) -> float:
        text = str(data).strip()
        try:
            value = float(text)
        except ValueError:
            value = _iso_seconds(text)
        if not math.isfinite(value):
            raise serializers.ValidationError("must be a finite number of seconds")
        return value

    def to_representation(self, value):
        return value


def _iso_seconds(text: str) -> float:
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        return when.timestamp()
    except (ValueError, OverflowError, OSError):
        raise serializers.ValidationError(
            "a Unix time in seconds (e.g. 1796126400.5) or an ISO 8601 time "
            "(e.g. 2026-12-01T12:00:00Z)") from None


class TimelineStateQuery(serializers.Serializer):
    at = MomentField()
    through = serializers.ChoiceField(choices=THROUGH, default="at")


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    try:
        return datetime.fromtimestamp(ts, timezone.utc).isoformat()
    except (ValueError, OverflowError, OSError):  # out of the calendar's range
        return f"{ts:g} s"


WINDOW = inline_serializer("TimelineWindow", {
    "id": serializers.CharField(help_text="<epoch>:<the keyframe's seq>"),
    "start": serializers.FloatField(help_text="the keyframe's time, Unix seconds"),
    "bytes": serializers.IntegerField(help_text="what the window takes in Redis")})


class EngineTimelineView(APIView):
    """What the engine's timeline holds: its windows (each a keyframe and the deltas after
    it, oldest first) and the newest moment stored."""
    permission_classes = [permissions.IsAuthenticated]

    @extend_schema(responses={200: inline_serializer("EngineTimeline", {
        "engine": serializers.CharField(),
        "seconds": serializers.FloatField(help_text="how far back it reaches (KVOPS_TIMELINE_SECONDS)"),
        "keyframe_s": serializers.FloatField(help_text="between two keyframes"),
        "oldest": serializers.FloatField(allow_null=True, help_text="Unix seconds; null: empty"),
        "newest": serializers.FloatField(allow_null=True),
        "windows": serializers.ListField(child=WINDOW)}), 404: ERROR, 503: ERROR})
    def get(self, request, name: str):
        engine = engine_or_404(name)
        try:
            windows, newest = timeline.windows(engine.name)
        except redis.RedisError as e:
            raise ServiceUnavailable(f"Redis, which keeps the timeline, did not answer: {e}") from None
        return Response({"engine": engine.name, "seconds": settings.KVOPS_TIMELINE_SECONDS,
                         "keyframe_s": settings.KVOPS_TIMELINE_KEYFRAME_S,
                         "oldest": windows[0]["start"] if windows else None, "newest": newest,
                         "windows": windows})


class EngineTimelineStateView(APIView):
    """The engine's KV state at a moment of its timeline: the keyframe of the window
    holding `at` and the deltas after it, up to `at` (through=at) or to the next keyframe
    (through=window, to scrub through the window without asking again). Apply the deltas
    to the keyframe in order (docs/live-protocol.md): the result is the state the live
    page showed at that moment."""
    permission_classes = [permissions.IsAuthenticated]

    @extend_schema(
        parameters=[
            OpenApiParameter("at", str, required=True, description="Unix seconds or an ISO 8601 time"),
            OpenApiParameter("through", str, enum=list(THROUGH), description="the deltas up "
                             "to `at` (default), or the whole window's")],
        responses={200: inline_serializer("EngineTimelineState", {
            "engine": serializers.CharField(), "at": serializers.FloatField(),
            "window": inline_serializer("TimelineSpan", {
                "id": serializers.CharField(), "start": serializers.FloatField(),
                "end": serializers.FloatField(allow_null=True,
                                              help_text="the next keyframe's time; null: the newest window")}),
            "keyframe": serializers.DictField(help_text="a snapshot, as GET /api/engines/<name>/ has it"),
            "deltas": serializers.ListField(child=serializers.DictField(),
                                            help_text="deltas as the websocket sends them, less their events"),
            "newest": serializers.FloatField(allow_null=True)}),
            400: ERROR, 404: ERROR, 503: ERROR})
    def get(self, request, name: str):
        query = TimelineStateQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        engine = engine_or_404(name)
        at, through = query.validated_data["at"], query.validated_data["through"]
        try:
            answer = timeline.window_at(engine.name, at, through_window=through == "window")
            held = None if answer is not None else timeline.windows(engine.name)
        except redis.RedisError as e:
            raise ServiceUnavailable(f"Redis, which keeps the timeline, did not answer: {e}") from None
        if answer is None:
            windows, newest = held
            if not windows:
                raise NotFound(f"engine {engine.name!r} has no timeline stored (it has published "
                               f"nothing in the last {settings.KVOPS_TIMELINE_SECONDS:g} s)")
            raise NotFound(f"engine {engine.name!r} has no stored state at {_iso(at)}: its "
                           f"timeline holds {_iso(windows[0]['start'])} to {_iso(newest)}")
        if not visibility.sees_everything(request.user):
            mine = visibility.viewer_tenant(request.user)
            answer = {**answer, "keyframe": visibility.seal_document(answer["keyframe"], mine),
                      "deltas": [visibility.seal_document(d, mine) for d in answer["deltas"]]}
        return Response({"engine": engine.name, "at": at, **answer})
