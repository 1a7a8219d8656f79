"""Retention: `manage.py prune_jobs` deletes jobs that ended before the cutoff (and,
asked to, old operator actions), never queued or running ones."""
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.utils import timezone

from kvops.models import Job, OperatorAction

pytestmark = pytest.mark.django_db(transaction=True)


def prune(*args: str) -> str:
    out = StringIO()
    call_command("prune_jobs", *args, stdout=out)
    return out.getvalue()


def test_prune_deletes_only_old_ended_jobs_and_asked_for_actions():
    owner = User.objects.create_user("pruned")
    long_ago = timezone.now() - timedelta(days=40)
    old_done = Job.objects.create(owner=owner, params={}, status=Job.Status.FINISHED,
                                  finished_at=long_ago)
    old_failed = Job.objects.create(owner=owner, params={}, status=Job.Status.FAILED,
                                    finished_at=long_ago)
    recent = Job.objects.create(owner=owner, params={}, status=Job.Status.FINISHED,
                                finished_at=timezone.now() - timedelta(days=2))
    queued = Job.objects.create(owner=owner, params={})  # waiting for 40 days: kept
    Job.objects.filter(pk=queued.pk).update(queued_at=long_ago)
    action = OperatorAction.objects.create(user=owner, engine="e", action="evict")
    OperatorAction.objects.filter(pk=action.pk).update(created_at=long_ago)

    assert "would delete 2 jobs" in prune("--older-than", "30d", "--dry-run")
    assert Job.objects.count() == 4
    assert "deleted 2 jobs" in prune("--older-than", "30d")
    assert set(Job.objects.values_list("pk", flat=True)) == {recent.pk, queued.pk}
    assert not Job.objects.filter(pk__in=[old_done.pk, old_failed.pk]).exists()
    assert OperatorAction.objects.filter(pk=action.pk).exists()  # not asked for
    assert "and 1 operator actions" in prune("--older-than", "30d", "--actions")
    assert not OperatorAction.objects.exists()


def test_prune_refuses_a_bad_age():
    with pytest.raises(CommandError, match="like 30d"):
        prune("--older-than", "a month")
