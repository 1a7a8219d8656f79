"""Two deployments on one Redis database, as two `make run`s on one host: the second's
engine worker of the same name is refused at start, naming both stacks, and an operator
command of the second reaches the first's worker (the same Celery name) and is ignored
there. Real web servers and Celery workers (tests/support/stack.py)."""
import sys
import time
from datetime import datetime

import redis

from kvops.engines.engine_claim import CLAIM_KEY
from tests.support.stack import Stack

ENGINE = dict(simulate=1, vocab_size=1000, num_gpu_blocks=64, block_size=16, max_num_seqs=4,
              simulate_step_ms=20)


def test_a_second_deployment_on_the_same_redis_database_is_kept_apart(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = Stack(tmp_path / "a")
    b = Stack(tmp_path / "b", env={"REDIS_URL": a.env["REDIS_URL"]})
    try:
        a.start_web()
        a.start_engine("twin", **ENGINE)
        b.start_web()
        shared = redis.Redis.from_url(a.env["REDIS_URL"])
        a_stack = shared.hget(CLAIM_KEY.format(name="twin"), "stack").decode()
        b_stack = b.manage("shell", "-c", "from kvops.engines.stack_id import stack_id; "
                                          "print(stack_id())").splitlines()[-1]
        assert a_stack and b_stack and a_stack != b_stack  # two databases, two stacks

        # b's worker of the same name: refused before its engine starts, and it exits
        b._spawn("engine-twin", [*_worker_argv("twin")], {
            f"KVOPS_ENGINE_{k.upper()}": str(v) for k, v in ENGINE.items()})
        b.procs["engine-twin"].wait(120)
        refusal = b.log("engine-twin")
        assert b.procs.pop("engine-twin").returncode != 0
        assert f"stack {a_stack} on host" in refusal and f"stack {b_stack} on host" in refusal
        assert shared.hget(CLAIM_KEY.format(name="twin"), "stack").decode() == a_stack

        # b's operator acts on "twin" (b's row from an earlier run names the same Celery
        # worker): a's worker ignores it, b hears no answer
        worker = a.api("GET", "/api/engines/twin/").json()["engine"]["worker"]
        b.manage("shell", "-c", "from django.utils import timezone; "
                 "from kvops.models import Engine; Engine.objects.create(name='twin', "
                 f"worker={worker!r}, status='ready', last_heartbeat=timezone.now())")
        foreign = b.api("POST", "/api/engines/twin/retention/", json={"eviction_policy": "lfu"})
        assert foreign.status_code == 504, foreign.text
        assert a_stack not in foreign.text
        a.wait(lambda: f"ignored control command 'retention' from stack '{b_stack}'"
               in a.log("engine-twin"), "the foreign command's warning", 10)
        answered_at = time.time()
        a.wait(lambda: _beat_after(a, answered_at), "a heartbeat after the command", 10)
        assert _metrics(a)["eviction_policy"] == "lru"  # not applied
        # a's own operator still acts on it
        own = a.api("POST", "/api/engines/twin/retention/", json={"eviction_policy": "lfu"})
        assert own.status_code == 200, own.text
        answered_at = time.time()
        a.wait(lambda: _beat_after(a, answered_at), "a heartbeat after the command", 10)
        assert _metrics(a)["eviction_policy"] == "lfu"
    finally:
        b.stop()
        a.stop()


def _worker_argv(name: str) -> list[str]:
    return [sys.executable, "manage.py", "engine_worker", "--name", name, "--threads", "8"]


def _metrics(stack: Stack) -> dict:
    return stack.api("GET", "/api/engines/twin/").json()["engine"]["metrics"]


def _beat_after(stack: Stack, t: float) -> bool:
    beat = stack.api("GET", "/api/engines/twin/").json()["engine"]["last_heartbeat"]
    return datetime.fromisoformat(beat.replace("Z", "+00:00")).timestamp() > t
