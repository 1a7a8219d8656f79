"""The test run uses its own Redis, in this process too (never a developer's)."""
import os

from django.conf import settings


def test_in_process_django_uses_the_private_redis():
    url = os.environ["REDIS_URL"]
    assert ":6379/" not in url
    assert settings.REDIS_URL == url
    assert settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"] == [url]
