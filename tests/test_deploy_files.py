"""docker-compose.yml and the Dockerfile cannot run here (no Docker engine): check that
they are well-formed and that every command they run exists in the project."""
import re
import shlex
from pathlib import Path

import yaml

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
        module = argv[2]
        if module == "daphne":
            target = argv[-1]
            mod, attr = target.split(":")
            assert (REPO / (mod.replace(".", "/") + ".py")).exists(), target
        else:
            __import__(module)
    elif argv[0] in ("redis-server", "postgres"):
        pass  # official images
    else:
        raise AssertionError(f"unexpected command {argv}")


def test_every_service_command_exists():
    services = compose()["services"]
    assert {"redis", "postgres", "web", "migrate", "engine-0"} <= set(services)
    for name, svc in services.items():
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
    for name, svc in engines.items():
        env = svc["environment"]
        assert env["KVOPS_ENGINE_DEVICE"] == "cuda"
        devices = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert devices["driver"] == "nvidia" and devices["capabilities"] == ["gpu"]
        assert devices["device_ids"] == [env["CUDA_VISIBLE_DEVICES"]]
        gpus.append(env["CUDA_VISIBLE_DEVICES"])
        assert env["REDIS_URL"].startswith("redis://redis:")
        assert env["DATABASE_URL"].startswith("postgres://") and "@postgres:" in env["DATABASE_URL"]
        assert "healthcheck" in svc and "models:/data" in svc["volumes"]
    assert len(set(gpus)) == len(gpus)
    names = [s["environment"]["KVOPS_ENGINE_NAME"] for s in engines.values()]
    assert len(set(names)) == len(names)


def test_dockerfile_installs_like_make_setup():
    lines = (REPO / "Dockerfile").read_text().splitlines()
    runs = [l for l in lines if l.startswith("RUN make")]
    assert runs, "the image must install through the Makefile"
    for line in runs:
        for target in shlex.split(line)[2:]:
            if "=" not in target:
                assert target in makefile_targets(), f"make {target} does not exist"
    cmd = next(l for l in lines if l.startswith("CMD"))
    assert "kvops.asgi:application" in cmd
