"""Websocket URLs (consumers in kvops/dashboard/consumers.py). A path none of them matches is
closed as an unknown engine or job is (4404), not a handshake error."""
from django.urls import path, re_path

from kvops.dashboard.consumers import EngineConsumer, JobConsumer, NotFoundConsumer

websocket_urlpatterns: list = [
    re_path(r"^ws/engines/(?P<name>[A-Za-z0-9_.-]+)/$", EngineConsumer.as_asgi()),
    path("ws/jobs/<int:job_id>/", JobConsumer.as_asgi()),
    re_path(r"", NotFoundConsumer.as_asgi()),  # last: anything else
]
