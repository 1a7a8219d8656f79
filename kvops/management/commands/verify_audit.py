"""manage.py verify_audit: walk the operator log's chain (kvops/operators/audit_chain.py) and say
OK with the number of rows, or name the first row that does not verify (exit 1)."""
from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from kvops.operators import audit_chain
from kvops.models import OperatorAction


class Command(BaseCommand):
    help = "Check the operator log's MAC chain; name the first row that does not verify."

    def handle(self, *args, **opts):
        rows = OperatorAction.objects.exclude(seq=None).order_by("seq").iterator()
        count, bad, why = audit_chain.verify(settings.SECRET_KEY, rows)
        if bad is not None:
            raise CommandError(f"operator action {bad.pk} does not verify: {why} "
                               f"({count} rows before it verified)")
        first = OperatorAction.objects.exclude(seq=None).order_by("seq").first()
        pending = OperatorAction.objects.filter(seq=None).count()
        self.stdout.write(
            f"OK: {count} operator actions verify"
            + (f" (the chain starts at action {first.pk}: the rows before it were pruned)"
               if first is not None and first.seq != 1 else "")
            + (f"; {pending} not answered yet, outside the chain" if pending else ""))
