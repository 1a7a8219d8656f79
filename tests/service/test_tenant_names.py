"""Staff's pages name tenant labels by user (kvops/routing/tenancy.py usernames): a label
it has not seen reads only the users added since its last read, so a deleted user's
label, which is never found, does not read every user again on each page."""
import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext

from kvops.routing import tenancy

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh_names(monkeypatch):
    monkeypatch.setattr(tenancy, "_names", {})
    monkeypatch.setattr(tenancy, "_names_state", {"max_pk": 0, "loaded_at": float("-inf")})


def test_labels_are_named_and_new_users_read_alone():
    User = get_user_model()
    ann = User.objects.create_user("ann")
    User.objects.create_user("root", is_staff=True)
    assert tenancy.usernames([tenancy.tenant(ann), None]) == {tenancy.tenant(ann): "ann"}
    ben = User.objects.create_user("ben")
    with CaptureQueriesContext(connection) as queries:
        names = tenancy.usernames([tenancy.tenant(ann), tenancy.tenant(ben)])
    assert names == {tenancy.tenant(ann): "ann", tenancy.tenant(ben): "ben"}
    assert len(queries) == 1 and f"> {ann.pk}" in queries[0]["sql"]


def test_an_unknown_label_reads_only_the_users_added_since():
    User = get_user_model()
    gone = User.objects.create_user("gone")
    label = tenancy.tenant(gone)
    gone.delete()
    kept = User.objects.create_user("kept")
    assert tenancy.usernames([label, tenancy.tenant(kept)]) == {tenancy.tenant(kept): "kept"}
    for _ in range(2):
        with CaptureQueriesContext(connection) as queries:
            assert tenancy.usernames([label]) == {}
        assert len(queries) == 1 and f"> {kept.pk}" in queries[0]["sql"]


def test_the_whole_list_is_read_again_after_a_while(monkeypatch):
    User = get_user_model()
    was_staff = User.objects.create_user("was", is_staff=True)
    later = User.objects.create_user("later")
    tenancy.usernames([tenancy.tenant(later)])
    User.objects.filter(pk=was_staff.pk).update(is_staff=False)
    was_staff.refresh_from_db()
    assert tenancy.usernames([tenancy.tenant(was_staff)]) == {}  # (an older pk)
    monkeypatch.setitem(tenancy._names_state, "loaded_at", float("-inf"))
    assert tenancy.usernames([tenancy.tenant(was_staff)]) == {tenancy.tenant(was_staff): "was"}
