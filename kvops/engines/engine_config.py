"""The worker's engine configuration: EngineConfig from KVOPS_ENGINE_<FIELD> variables
(e.g. KVOPS_ENGINE_BLOCK_SIZE=32), one variable per field, and its secret from the
service's secret key."""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import Any

from engine import EngineConfig, InvalidRequestError


def config_from_env(environ: dict[str, str],
                    defaults: dict[str, Any] | None = None) -> EngineConfig:
    """EngineConfig from KVOPS_ENGINE_<FIELD> variables (e.g. KVOPS_ENGINE_BLOCK_SIZE=32);
    a field no variable sets takes its value from `defaults`, else EngineConfig's."""
    kwargs: dict[str, Any] = dict(defaults or {})
    for f in dataclasses.fields(EngineConfig):
        if f.name == "secret":  # (engine_secret's alone: one secret per deployment)
            continue
        raw = environ.get(f"KVOPS_ENGINE_{f.name.upper()}")
        if raw is None or raw == "":
            continue
        kwargs[f.name] = _parse_field(f.name, str(f.type), raw)
    return EngineConfig(**kwargs)


def engine_secret(secret_key: str) -> str:
    """EngineConfig.secret of this deployment's engines: HMAC-SHA256 of the service's
    secret key (Django's SECRET_KEY), so that the engine never holds the key itself, and
    every engine of the deployment derives the same disk key (engine/kv/tiers/disk_seal.py)."""
    return hmac.new(secret_key.encode(), b"kvops engine secret", hashlib.sha256).hexdigest()


def _parse_field(name: str, type_name: str, raw: str) -> Any:
    try:
        if type_name.startswith("bool"):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
        return raw
    except ValueError:
        raise InvalidRequestError(
            f"KVOPS_ENGINE_{name.upper()}={raw!r} is not a valid {type_name}") from None

