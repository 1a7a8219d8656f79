"""The stack id: which deployment a process belongs to.

Two deployments must not act on each other through a Redis database they share (one
deployment per Redis database is the rule; docs/operations.md): engine workers claim
their names under it (kvops/engines/engine_claim.py) and operator commands carry it
(kvops/engines/control.py), so a worker ignores another deployment's.

KVOPS_STACK_ID sets it. Unset, it is the one stored in the deployment's database
(the `Deployment` row), made at random on first use: every process of one deployment
shares its database, so they agree, and two deployments, each with its own database,
differ. A deployment whose processes do not share a database sets the variable alike
in each.
"""
from __future__ import annotations

import secrets

from django.conf import settings

from kvops.models import Deployment

DEPLOYMENT_ROW = 1  # the one row


def stack_id() -> str:
    """KVOPS_STACK_ID, else the database's (made, once, on first use: two processes
    first at once get the same one, the row's primary key being fixed)."""
    if settings.KVOPS_STACK_ID:
        return settings.KVOPS_STACK_ID
    row, _ = Deployment.objects.get_or_create(
        pk=DEPLOYMENT_ROW, defaults={"stack_id": secrets.token_hex(8)})
    return row.stack_id
