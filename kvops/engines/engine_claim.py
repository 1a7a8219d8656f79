"""Who holds an engine name on this Redis database.

The engine's row (kvops/engines/registry.py) is in its deployment's own database, but the
broker, the control commands and the live state are in Redis, keyed by the engine's
name: two deployments on one Redis database whose workers share a name would take each
other's commands and mix their histories. So a worker claims its name in Redis before
its engine starts, and keeps the claim alive while it runs (`kvops:engine:<name>:claim`,
a hash: the holder's stack id, host, Celery name and a token for this run, expiring
KVOPS_ENGINE_DEAD_AFTER_S after its last renewal, the silence after which an engine
counts as dead). The claim is taken by one atomic check-and-set (a Lua script): two
workers starting at once cannot both get it. It is granted when

* nobody holds the name (never claimed, released at a clean stop, or expired: its holder
  died), or
* this run holds it already (a renewal), or
* the holder is of the same stack on the same host: the same engine restarting (its
  worker killed and started again before the claim expired).

Otherwise the worker is refused (EngineNameTaken, naming both) and exits.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import uuid

import redis

log = logging.getLogger(__name__)

CLAIM_KEY = "kvops:engine:{name}:claim"

# KEYS[1]: the claim; ARGV: stack, host, token, worker, ttl (ms). Returns {} when this
# run holds the claim now, else the holder's fields (HGETALL's flat list).
_CLAIM = """
local held = redis.call('HMGET', KEYS[1], 'stack', 'host', 'token')
if held[3] and held[3] ~= ARGV[3] and not (held[1] == ARGV[1] and held[2] == ARGV[2]) then
  return redis.call('HGETALL', KEYS[1])
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'stack', ARGV[1], 'host', ARGV[2], 'token', ARGV[3],
           'worker', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {}
"""
# KEYS[1]: the claim; ARGV[1]: the token. Deletes the claim if this run holds it.
_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclasses.dataclass(frozen=True, slots=True)
class Holder:
    """One worker's claim on an engine name, as the claim's hash holds it."""
    stack: str  # its stack id (kvops/engines/stack_id.py)
    host: str
    worker: str  # its Celery name, e.g. engine-a@host
    token: str  # this run of the worker: only it renews or releases the claim

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not getattr(self, field.name):
                raise ValueError(f"an engine claim's {field.name} must not be empty")

    def describe(self) -> str:
        return f"stack {self.stack} on host {self.host} ({self.worker})"

    @classmethod
    def from_fields(cls, raw: list[bytes]) -> Holder:
        """From HGETALL's flat list; a field missing or not text is '?'."""
        pairs = dict(zip(raw[0::2], raw[1::2], strict=True))

        def text(key: str) -> str:
            try:
                return pairs[key.encode()].decode() or "?"
            except (KeyError, UnicodeDecodeError):
                return "?"
        return cls(text("stack"), text("host"), text("worker"), text("token"))


class EngineNameTaken(Exception):
    """A live worker of another deployment (or of this one, on another host) holds the
    engine's name on this Redis database."""

    def __init__(self, name: str, holder: Holder, claimant: Holder, ttl_s: float) -> None:
        self.name, self.holder, self.claimant = name, holder, claimant
        super().__init__(
            f"engine name {name!r} is taken on this Redis database by a live worker of "
            f"{holder.describe()}; this worker is of {claimant.describe()}. Two deployments "
            f"must not share a Redis database (their commands and histories would mix): "
            f"give this deployment its own (REDIS_URL ending /<n>), or this engine another "
            f"name (--name, KVOPS_ENGINE_NAME), or stop the other worker (its claim lapses "
            f"{ttl_s:g} s after it stops beating)")


class EngineClaim:
    """This worker's hold on its engine's name: `take` at start (EngineNameTaken if
    another holds it), then renewed every `renew_s` on a thread of its own until
    `release`."""

    def __init__(self, client: redis.Redis, name: str, stack: str, host: str, worker: str,
                 ttl_s: float, renew_s: float) -> None:
        if not 0 < renew_s < ttl_s:
            raise ValueError(f"a claim renewed every {renew_s:g} s must outlive that: "
                             f"its lifetime ({ttl_s:g} s) is shorter")
        self.client = client
        self.name = name
        self.key = CLAIM_KEY.format(name=name)
        self.me = Holder(stack, host, worker, uuid.uuid4().hex)
        self.ttl_s, self.renew_s = ttl_s, renew_s
        self._claim = client.register_script(_CLAIM)
        self._release = client.register_script(_RELEASE)
        self._stop = threading.Event()  # set by release: the renewals end
        self._renewals: threading.Thread | None = None

    def _try(self) -> None:
        held = self._claim(keys=[self.key], args=[
            self.me.stack, self.me.host, self.me.token, self.me.worker,
            max(1, round(1000 * self.ttl_s))])
        if held:
            raise EngineNameTaken(self.name, Holder.from_fields(held), self.me, self.ttl_s)

    def take(self) -> None:
        """Claim the name and keep it; EngineNameTaken (nothing held) if another holds it."""
        self._try()
        self._renewals = threading.Thread(target=self._renew, name="kvops-engine-claim",
                                          daemon=True)
        self._renewals.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                self._try()
            except EngineNameTaken as e:  # it lapsed (Redis away longer than its life)
                log.error("engine %s lost its name: %s", self.name, e)
            except redis.RedisError as e:  # the next renewal tries again
                log.warning("renewing the claim on engine name %s failed: %s", self.name, e)

    def release(self) -> None:
        """Give the name up (a clean stop): another worker may take it at once."""
        self._stop.set()
        if self._renewals is not None and self._renewals is not threading.current_thread():
            self._renewals.join(5.0)
        try:
            self._release(keys=[self.key], args=[self.me.token])
        except redis.RedisError as e:  # it lapses by itself
            log.warning("releasing engine name %s failed (it lapses in %g s): %s",
                        self.name, self.ttl_s, e)
