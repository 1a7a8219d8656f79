"""ASGI entry point: HTTP through Django (/v1 without the page middleware, see
kvops/openai/handler.py), websockets through Channels (served by uvicorn)."""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvops.settings")
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from kvops.jobs import reaper  # noqa: E402
from kvops.openai.handler import BareASGIHandler, split_api  # noqa: E402
from kvops.openai.body_limit import limit_body  # noqa: E402
from kvops.dashboard.ws_origin import SameOriginValidator  # noqa: E402
from kvops.dashboard.ws_routing import websocket_urlpatterns  # noqa: E402

reaper.start()

application = ProtocolTypeRouter({
    "http": limit_body(split_api(BareASGIHandler(), django_asgi_app)),
    "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
})
