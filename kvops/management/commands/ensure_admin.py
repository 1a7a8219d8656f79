"""Create an admin account if there is no superuser, and say how to log in."""
import os
import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from kvops.infra.private_file import create_private


class Command(BaseCommand):
    help = "Create the first admin account (password printed and saved under the data dir)."

    def handle(self, *args, **opts):
        User = get_user_model()
        creds = Path(settings.DATA_DIR) / "admin-credentials.txt"
        if User.objects.filter(is_superuser=True).exists():
            hint = f" (see {creds})" if creds.exists() else ""
            self.stdout.write(f"[kvops] log in with your admin account{hint}")
            return
        username = os.environ.get("DJANGO_SUPERUSER_USERNAME", "admin")
        email = os.environ.get("DJANGO_SUPERUSER_EMAIL", "")
        if os.environ.get("DJANGO_SUPERUSER_PASSWORD"):  # the caller knows the password
            User.objects.create_superuser(username, email,
                                          os.environ["DJANGO_SUPERUSER_PASSWORD"])
            self.stdout.write(f"[kvops] created admin account {username!r} "
                              "(password from DJANGO_SUPERUSER_PASSWORD)")
            return
        password = secrets.token_urlsafe(12)
        creds.unlink(missing_ok=True)  # a stale file of an earlier database
        User.objects.create_superuser(username, email, password)
        create_private(creds, f"username: {username}\npassword: {password}\n")
        self.stdout.write(f"[kvops] created admin account: username {username!r}, "
                          f"password {password!r} (also in {creds})")
