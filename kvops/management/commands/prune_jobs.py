"""Delete old jobs (and, with --actions, old operator-log entries): retention.

    manage.py prune_jobs --older-than 30d            # jobs that ended more than 30 days ago
    manage.py prune_jobs --older-than 12h --actions  # and operator actions of that age
    manage.py prune_jobs --older-than 30d --dry-run  # count only

Only jobs that ended (finished, failed, cancelled) are deleted, by the time they ended;
queued and running jobs are never touched. Run it from cron or a systemd timer.
"""
from __future__ import annotations

import re
from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from kvops.models import Job, OperatorAction

UNITS = {"d": "days", "h": "hours", "m": "minutes", "s": "seconds"}
BATCH = 1000  # rows per DELETE: a long delete must not hold the database for long


def parse_age(text: str) -> timedelta:
    match = re.fullmatch(r"(\d+)([dhms])", text.strip())
    if not match:
        raise CommandError(f"--older-than {text!r}: use a number and a unit, like 30d, 12h, "
                           "90m or 3600s")
    return timedelta(**{UNITS[match[2]]: int(match[1])})


def _delete_in_batches(queryset) -> int:
    total = 0
    while True:
        ids = list(queryset.values_list("pk", flat=True)[:BATCH])
        if not ids:
            return total
        total += queryset.model.objects.filter(pk__in=ids).delete()[1].get(
            queryset.model._meta.label, 0)


class Command(BaseCommand):
    help = "Delete jobs that ended longer ago than --older-than (and operator actions)."

    def add_arguments(self, parser):
        parser.add_argument("--older-than", required=True, type=parse_age,
                            help="age, like 30d, 12h, 90m or 3600s")
        parser.add_argument("--actions", action="store_true",
                            help="also delete operator actions older than that")
        parser.add_argument("--dry-run", action="store_true", help="count, delete nothing")

    def handle(self, *args, older_than: timedelta, actions: bool, dry_run: bool, **opts):
        cutoff = timezone.now() - older_than
        jobs = Job.objects.filter(status__in=Job.TERMINAL, finished_at__lt=cutoff)
        old_actions = OperatorAction.objects.filter(created_at__lt=cutoff)
        if dry_run:
            self.stdout.write(f"would delete {jobs.count()} jobs"
                              + (f" and {old_actions.count()} operator actions" if actions
                                 else "") + f" older than {cutoff:%Y-%m-%d %H:%M} UTC")
            return
        n_jobs = _delete_in_batches(jobs)
        n_actions = _delete_in_batches(old_actions) if actions else 0
        self.stdout.write(f"deleted {n_jobs} jobs" + (f" and {n_actions} operator actions"
                                                       if actions else "")
                          + f" older than {cutoff:%Y-%m-%d %H:%M} UTC")
