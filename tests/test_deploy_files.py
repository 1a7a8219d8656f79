"""docker-compose.yml and the Dockerfile cannot run here (no Docker engine): check that
they are well-formed and that every command they run exists in the project."""
import json
import os
import re
import secrets
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import yaml

from kvops.infra.private_file import ensure_secret_key

REPO = Path(__file__).resolve().parents[1]


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


def management_commands() -> set[str]:
    from django.core.management import get_commands
    return set(get_commands())


def check_command(argv: list[str]) -> None:
    if argv[:1] == [".venv/bin/python"] and argv[1] == "manage.py":
        assert argv[2] in management_commands(), f"no manage.py command {argv[2]}"
    elif argv[:2] == [".venv/bin/python", "-m"]:
        __import__(argv[2])
    elif argv[0] in ("redis-server", "postgres"):
        pass  # official images
    else:
        raise AssertionError(f"unexpected command {argv}")


def test_every_service_command_exists():
    services = compose()["services"]
    assert {"redis", "postgres", "web", "migrate", "engine-0"} <= set(services)
    for svc in services.values():
        if "command" in svc:
            check_command(svc["command"])
        health = svc.get("healthcheck", {}).get("test")
        if health and health[0] not in ("CMD", "CMD-SHELL"):
            check_command(health)


def test_engines_get_one_gpu_each_and_shared_services():
    services = compose()["services"]
    engines = {n: s for n, s in services.items() if n.startswith("engine-")}
    assert len(engines) >= 2
    gpus = []
    for svc in engines.values():
        env = svc["environment"]
        assert env["KVOPS_ENGINE_DEVICE"] == "cuda"
        devices = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert devices["driver"] == "nvidia" and devices["capabilities"] == ["gpu"]
        assert devices["device_ids"] == [env["CUDA_VISIBLE_DEVICES"]]
        gpus.append(env["CUDA_VISIBLE_DEVICES"])
        assert env["REDIS_URL"].startswith("redis://:${REDIS_PASSWORD") \
            and env["REDIS_URL"].endswith("@redis:6379/0")  # Redis wants a password
        assert env["DATABASE_URL"].startswith("postgres://") and "@postgres:" in env["DATABASE_URL"]
        assert "healthcheck" in svc and "models:/data" in svc["volumes"]
    assert len(set(gpus)) == len(gpus)
    names = [s["environment"]["KVOPS_ENGINE_NAME"] for s in engines.values()]
    assert len(set(names)) == len(names)


def test_engines_in_containers_reach_each_others_migration_port_and_publish_it_nowhere():
    """Each engine is a container of its own: its migration port binds the compose
    network (a socket file in its own /tmp would reach no other engine), over CurveZMQ,
    and no engine publishes a port to the host."""
    engines = {n: s for n, s in compose()["services"].items() if n.startswith("engine-")}
    for name, svc in engines.items():
        env = svc["environment"]
        assert env["KVOPS_ENGINE_MIGRATION_HOST"] == "0.0.0.0", name
        assert int(env["KVOPS_ENGINE_MIGRATION_PORT"]) > 0, name
        assert "ports" not in svc, name


def test_dockerfile_installs_like_make_setup():
    lines = (REPO / "Dockerfile").read_text().splitlines()
    runs = [l for l in lines if l.startswith("RUN make")]
    assert runs, "the image must install through the Makefile"
    for line in runs:
        for target in shlex.split(line)[2:]:
            if "=" not in target:
                assert target in makefile_targets(), f"make {target} does not exist"
    cmd = next(l for l in lines if l.startswith("CMD"))
    check_command(json.loads(cmd[len("CMD"):]))  # the web server, as make run starts it


def test_compose_has_no_open_defaults():
    """No `*` host, no default secret key, a password on Redis that every REDIS_URL
    carries, HTTPS settings passed through."""
    services = compose()["services"]
    redis_cmd = services["redis"]["command"]
    assert "--requirepass" in redis_cmd
    assert redis_cmd[redis_cmd.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    for name, svc in services.items():
        env = svc.get("environment", {})
        if "DJANGO_SECRET_KEY" not in env:
            continue
        assert env["DJANGO_SECRET_KEY"].startswith("${DJANGO_SECRET_KEY:?"), name  # no default
        assert "*" not in env["KVOPS_ALLOWED_HOSTS"], name
        assert "${REDIS_PASSWORD" in env["REDIS_URL"], name
        assert env["KVOPS_HTTPS"].startswith("${KVOPS_HTTPS"), name


def manage(*args: str, env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("DJANGO_SECRET_KEY", "KVOPS_DEBUG", "KVOPS_HTTPS")}
    return subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=120)


def test_the_production_env_passes_check_deploy(tmp_path):
    """The env that docs/operations.md's "Running in production" section gives: no warnings."""
    out = manage("check", "--deploy", "--fail-level", "WARNING", env={
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50), "KVOPS_HTTPS": "1",
        "KVOPS_ALLOWED_HOSTS": "kvops.example.org", "KVOPS_DATA_DIR": str(tmp_path)})
    assert out.returncode == 0 and "no issues" in out.stdout, out.stdout + out.stderr


def test_no_secret_key_refuses_to_start_unless_debug(tmp_path):
    out = manage("check", env={"KVOPS_DATA_DIR": str(tmp_path)})
    assert out.returncode != 0 and "DJANGO_SECRET_KEY" in out.stderr, out.stderr
    assert manage("check", env={"KVOPS_DATA_DIR": str(tmp_path),
                                "KVOPS_DEBUG": "1"}).returncode == 0
    # The data dir's key file, as `make run` writes it on first run, is used.
    key = ensure_secret_key(tmp_path)
    assert manage("check", env={"KVOPS_DATA_DIR": str(tmp_path)}).returncode == 0
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    first = key.read_text()
    ensure_secret_key(tmp_path)  # never written over
    assert key.read_text() == first and len(first.strip()) >= 50
