"""The Celery broker transport: kombu's Redis transport, hardened for a Redis restart.

When its connection drops, kombu's Redis channel (a) tries to push the worker's
unacknowledged messages back to the queue through that very connection, and (b) later
acknowledges messages of tasks that finish meanwhile on the dead channel; both fail inside
kombu and the worker exits with "Unrecoverable error". kvops needs neither: a job whose
worker stopped is re-dispatched by kvops/jobs/reaper.py under a new task id, and a job that
finished is finished in the database, so a late redelivery of its message is ignored
(job_store.claim_jobs). Here the restore is off and acks on a closed channel are dropped,
so the worker rides out the restart and reconnects.
"""
import logging
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

SCHEME = "kvops-redis"


log = logging.getLogger(__name__)


class Channel(kombu_redis.Channel):
    do_restore = False

    def basic_ack(self, delivery_tag, multiple=False):
        if self.connection is None:
            log.warning("broker connection lost: message %s not acknowledged", delivery_tag)
            return
        super().basic_ack(delivery_tag, multiple)

    def basic_reject(self, delivery_tag, requeue=False):
        if self.connection is None:
            log.warning("broker connection lost: message %s not rejected", delivery_tag)
            return
        super().basic_reject(delivery_tag, requeue)


class Transport(kombu_redis.Transport):
    Channel = Channel


TRANSPORT_ALIASES.setdefault(SCHEME, "kvops.infra.broker:Transport")


def broker_url(redis_url: str) -> str:
    """redis://host:port/db -> kvops-redis://host:port/db (other schemes unchanged)."""
    if redis_url.startswith("redis://"):
        return SCHEME + redis_url[len("redis"):]
    return redis_url
