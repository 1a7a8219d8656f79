"""The deployment's secret and the keys derived from it.

A deployment's processes share one secret (the service derives it from Django's
SECRET_KEY: kvops/engine_config.engine_secret) and hand it to each engine core as
`EngineConfig.secret`, never on a command line. Each purpose gets a key of its own,
derived with HMAC-SHA256 (a key for one purpose tells nothing of another's):

* "migration curve server" / "migration curve client": the CurveZMQ key pairs of the
  migration port (engine/transfer/link.py). Every engine of the deployment has the same
  two pairs; a peer that lacks the secret cannot complete the handshake.
* "migration ticket": the HMAC key of the tickets the service signs for each move
  (engine/transfer/ticket.py).
* "disk tier": the disk tier's AES-GCM key (engine/kv/tiers/disk_seal.py).

An engine with no secret (the plain `LLMEngine` API, a test) makes a random one at start:
its migration port then takes nobody, which is the safe default.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

import zmq
from zmq.utils import z85

SECRET_BYTES = 32


def random_secret() -> str:
    """A fresh secret, as `EngineConfig.secret` takes it (hex)."""
    return secrets.token_hex(SECRET_BYTES)


def derive(secret: str | bytes, purpose: str) -> bytes:
    """The 32-byte key for `purpose` under the deployment's `secret` (or a key file's
    bytes, the disk tier's without one)."""
    if not secret:
        raise ValueError("no secret to derive a key from")
    raw = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(raw, b"kvops key: " + purpose.encode(), hashlib.sha256).digest()


def curve_pair(secret: str, role: str) -> tuple[bytes, bytes]:
    """The CurveZMQ key pair (public, secret; Z85) of the migration port's `role`
    ("server" or "client") under the deployment's `secret`. Curve25519 takes any 32 bytes
    as a secret key (it clamps them), so the pair follows from the derived bytes."""
    private = z85.encode(derive(secret, f"migration curve {role}"))
    return zmq.curve_public(private), private
