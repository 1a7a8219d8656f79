"""Dashboard tests run Django in this process (consumers, publisher): point its Redis
settings at the private server tests/conftest.py started. Django read its settings
before that conftest set REDIS_URL, so they are corrected here, before any test runs."""
import os

from django.conf import settings


def _use_private_redis() -> None:
    url = os.environ["REDIS_URL"]
    settings.REDIS_URL = url
    layer = settings.CHANNEL_LAYERS["default"]
    settings.CHANNEL_LAYERS = {"default": {**layer, "CONFIG": {**layer["CONFIG"], "hosts": [url]}}}
    from channels.layers import channel_layers
    channel_layers.backends.clear()
    from kvops import live
    live._redis = None
    live._fanout = None


_use_private_redis()
