"""The first admin's password is written for its owner only (0600, O_EXCL)."""
import stat

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_admin_credentials_file_is_private(tmp_path, settings, monkeypatch):
    settings.DATA_DIR = tmp_path
    monkeypatch.delenv("DJANGO_SUPERUSER_PASSWORD", raising=False)
    (tmp_path / "admin-credentials.txt").write_text("stale, of an earlier database\n")
    call_command("ensure_admin")
    creds = tmp_path / "admin-credentials.txt"
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    text = creds.read_text()
    assert "stale" not in text
    password = text.split("password: ")[1].strip()
    assert User.objects.get(username="admin").check_password(password)
