"""The operator log is tamper-evident (kvops/operators/audit_chain.py): each final row is chained by
an HMAC of the secret key over the previous row's MAC and its own content; `manage.py
verify_audit` names the first row an edit or a deletion broke, and /admin/ lets no one,
superusers included, add, change or delete a row."""
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from rest_framework.test import APIClient

from kvops.engines import control
from kvops.operators.moves import _audit
from kvops.models import OperatorAction
from kvops.engines.registry import register_engine

pytestmark = pytest.mark.django_db(transaction=True)


def verify() -> str:
    out = StringIO()
    call_command("verify_audit", stdout=out)
    return out.getvalue()


@pytest.fixture()
def actions(monkeypatch) -> list[OperatorAction]:
    """Operator actions as the API records them (the engine's answer stubbed: no worker
    runs here), one with an Idempotency-Key, and a drain's move."""
    monkeypatch.setattr(control, "send_engine_command",
                        lambda worker, action, arguments: {"ok": True, "evicted": 3})
    register_engine("audited", "w@h", "h", "i1", {"block_size": 16}, "s1")
    staff = User.objects.create_user("auditor", password="mauve-tractor-41-lake",
                                     is_staff=True)
    client = APIClient()
    client.force_authenticate(staff)
    for i in range(3):
        answer = client.post("/api/engines/audited/prefix-cache/evict/", {"num_blocks": i},
                             format="json")
        assert answer.status_code == 200, answer.content
    answer = client.post("/api/engines/audited/prefix-cache/evict/", {"num_blocks": 9},
                         format="json", HTTP_IDEMPOTENCY_KEY="once-1")
    assert answer.status_code == 200, answer.content
    _audit("audited", "job-1-0", "other", {"ok": False, "error": "MigrationFailed"})
    rows = list(OperatorAction.objects.order_by("seq"))
    assert [r.seq for r in rows] == [1, 2, 3, 4, 5] and all(len(r.mac) == 64 for r in rows)
    return rows


def test_the_chain_verifies_after_real_actions(actions):
    assert verify().startswith("OK: 5 operator actions verify")


def test_an_edited_row_is_named(actions):
    third = actions[2]
    OperatorAction.objects.filter(pk=third.pk).update(result={"ok": True, "evicted": 0})
    with pytest.raises(CommandError, match=f"operator action {third.pk} does not verify"):
        verify()


def test_an_edited_mac_breaks_the_next_link(actions):
    second = actions[1]
    OperatorAction.objects.filter(pk=second.pk).update(mac="0" * 64)
    with pytest.raises(CommandError, match=f"operator action {second.pk} does not verify"):
        verify()


def test_a_deleted_row_is_caught(actions):
    OperatorAction.objects.filter(pk=actions[2].pk).delete()
    with pytest.raises(CommandError, match=f"operator action {actions[3].pk} does not verify"):
        verify()


def test_a_sealed_row_is_not_sealed_again(actions):
    from kvops.operators.audit_chain import AuditError, seal
    with pytest.raises(AuditError):
        seal(actions[0])


def test_the_admin_refuses_to_add_change_or_delete_a_row(actions, client):
    root = User.objects.create_superuser("root", "r@x.org", "mauve-tractor-41-lake")
    client.force_login(root)
    row = actions[0]
    base = "/admin/kvops/operatoraction/"
    assert client.get(base).status_code == 200  # reading is fine
    assert client.get(f"{base}{row.pk}/change/").status_code == 200  # (a read-only view)
    assert client.get(f"{base}add/").status_code == 403
    assert client.post(f"{base}add/", {"engine": "x", "action": "evict"}).status_code == 403
    assert client.post(f"{base}{row.pk}/change/", {"engine": "forged"}).status_code == 403
    assert client.post(f"{base}{row.pk}/delete/", {"post": "yes"}).status_code == 403
    assert client.post(base, {"action": "delete_selected", "_selected_action": [row.pk],
                              "post": "yes"}).status_code in (200, 302)
    assert OperatorAction.objects.count() == 5
    assert OperatorAction.objects.get(pk=row.pk).engine == "audited"
    assert verify().startswith("OK: 5")
