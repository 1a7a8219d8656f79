"""Websocket URLs (consumers in kvops/consumers.py)."""
from django.urls import path, re_path

from kvops.consumers import EngineConsumer, JobConsumer

websocket_urlpatterns: list = [
    re_path(r"^ws/engines/(?P<name>[A-Za-z0-9_.-]+)/$", EngineConsumer.as_asgi()),
    path("ws/jobs/<int:job_id>/", JobConsumer.as_asgi()),
]
