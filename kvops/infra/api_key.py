"""The API key of a request's Authorization header, the one reading of it for every API
(/api through kvops/api/auth.py, /v1 and /tokenize through kvops/openai/auth.py,
/healthz and /metrics through kvops/monitoring/health.py): a DRF token sent as
`Token <key>` (DRF's scheme) or `Bearer <key>` (OpenAI's), either on every surface."""
from __future__ import annotations

SCHEMES = ("token", "bearer")  # lowercase: a scheme's case does not matter (RFC 9110)


def key_of(header: str) -> str | None:
    """The key in an Authorization header's value; None: no key sent in either scheme
    (another scheme's credentials, or none); "": one of ours, but no single key after it."""
    scheme, _, key = header.strip().partition(" ")
    if scheme.lower() not in SCHEMES:
        return None
    key = key.strip()
    return key if key and " " not in key else ""
