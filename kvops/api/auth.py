"""Who calls /api: a session's user (the pages), or a DRF token's, sent as `Token <key>`
or `Bearer <key>` (kvops/infra/api_key.py), as /v1 takes it too."""
from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from kvops.infra import api_key


class TokenAuthentication(authentication.TokenAuthentication):
    """DRF's token authentication, taking either scheme. A call without a key is
    challenged with `WWW-Authenticate: Token` (DRF's) and answered 401."""

    def authenticate(self, request):
        key = api_key.key_of(request.META.get("HTTP_AUTHORIZATION", ""))
        if key is None:
            return None
        if not key:
            raise exceptions.AuthenticationFailed(
                "invalid Authorization header: send `Token <key>` or `Bearer <key>`")
        return self.authenticate_credentials(key)


class TokenScheme(OpenApiAuthenticationExtension):
    """In the schema as HTTP bearer auth: what Swagger's Authorize sends then works on
    /api and /v1 alike."""
    target_class = TokenAuthentication
    name = "tokenAuth"

    def get_security_definition(self, auto_schema) -> dict:
        return {"type": "http", "scheme": "bearer",
                "description": "a DRF token (an API key), sent as `Authorization: Bearer "
                               "<key>` or `Authorization: Token <key>`"}
