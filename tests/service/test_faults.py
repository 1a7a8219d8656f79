"""Nothing is lost when a worker dies, Redis restarts, or an engine step raises."""
import os
import signal
import time

import pytest

from engine.observe.snapshot import decode_array
from tests.support.stack import Stack

ENGINE = dict(simulate=1, num_gpu_blocks=256, block_size=16, max_num_seqs=8,
              simulate_step_ms=20)


@pytest.fixture()
def faulty(tmp_path):
    """Two engines on a Redis of their own (so it can be restarted), short heartbeats."""
    from tests.session_redis import free_port, start_redis
    port = free_port()
    redis_proc = start_redis(port, str(tmp_path))
    s = Stack(tmp_path, env={"REDIS_URL": f"redis://127.0.0.1:{port}/0",
                             "KVOPS_ENGINE_DEAD_AFTER_S": "3", "KVOPS_ROUTING": "round-robin"},
              faults=True)
    s.redis_port, s.redis_proc = port, redis_proc
    try:
        s.start_web()
        for name in ("one", "two"):
            s.start_engine(name, **ENGINE)
        yield s
    finally:
        s.stop()
        s.redis_proc.kill()


def submit(stack, n, max_tokens):
    ids = []
    for i in range(n):
        r = stack.api("POST", "/api/jobs/", json={"prompt": f"fault job {i}",
                                                  "max_tokens": max_tokens})
        assert r.status_code == 201
        ids.append(r.json()["id"])
    return ids


def test_sigkill_a_worker_mid_job(faulty):
    ids = submit(faulty, 8, max_tokens=150)  # ~3 s each at 20 ms/step
    faulty.wait(lambda: any(faulty.api("GET", f"/api/jobs/{i}/").json()["engine"] == "one"
                            and faulty.api("GET", f"/api/jobs/{i}/").json()["status"] == "running"
                            for i in ids), "a job running on engine one", 30)
    faulty.kill("engine-one", signal.SIGKILL)
    jobs = [faulty.wait_job(i, timeout_s=90) for i in ids]
    assert all(j["status"] == "finished" for j in jobs), [(j["id"], j["status"], j["error"])
                                                           for j in jobs]
    moved = [j for j in jobs if j["attempts"] > 1]
    assert moved and all(j["engine"] == "two" for j in moved)
    assert all(j["num_output_tokens"] == 150 for j in jobs)
    engines = {e["name"]: e for e in faulty.api("GET", "/api/engines/").json()}
    assert engines["one"]["status"] == "dead" and not engines["one"]["alive"]


def test_redis_restart_loses_nothing(faulty):
    ids = submit(faulty, 12, max_tokens=100)
    faulty.wait_running(ids[0], timeout_s=60)  # Redis goes away under running jobs
    faulty.redis_proc.kill()
    faulty.redis_proc.wait()
    time.sleep(1.0)  # the outage itself: Redis stays down this long
    from tests.session_redis import start_redis
    faulty.redis_proc = start_redis(faulty.redis_port, str(faulty.workdir))
    jobs = [faulty.wait_job(i, timeout_s=120) for i in ids]
    assert all(j["status"] == "finished" for j in jobs), [(j["id"], j["status"], j["error"])
                                                           for j in jobs]
    # Workers reconnected: new jobs still run.
    (later,) = submit(faulty, 1, max_tokens=5)
    assert faulty.wait_job(later, timeout_s=60)["status"] == "finished"


def test_a_job_submitted_while_redis_is_away_is_answered_201_and_runs(faulty):
    """The broker is unreachable when the job commits: the client gets its 201 (the job
    exists), and the job runs once Redis is back (outbox; kvops/outbox.send_unsent)."""
    faulty.redis_proc.kill()
    faulty.redis_proc.wait()
    try:  # a job naming its engine: its routing needs no Redis, only its send does
        r = faulty.api("POST", "/api/jobs/", json={"prompt": "while Redis is away",
                                                  "max_tokens": 5, "engine": "one"})
        # One that names none cannot be routed (round-robin counts turns in Redis):
        # refused with a 503 that says so, and not stored.
        before = faulty.api("GET", "/api/jobs/").json()["count"]
        refused = faulty.api("POST", "/api/jobs/", json={"prompt": "routed", "max_tokens": 5})
        assert refused.status_code == 503 and "nothing was stored" in refused.text, refused.text
        assert faulty.api("GET", "/api/jobs/").json()["count"] == before
    finally:
        from tests.session_redis import start_redis
        faulty.redis_proc = start_redis(faulty.redis_port, str(faulty.workdir))
    assert r.status_code == 201, r.text
    assert faulty.wait_job(r.json()["id"], timeout_s=120)["status"] == "finished"


def test_a_frozen_worker_thought_dead_cannot_finish_the_job_again(faulty):
    """SIGSTOP a worker (and its engine core) past the dead-after time: the job runs again
    on the other engine and finishes there. SIGCONT: the old attempt finds the job is no
    longer its own, writes nothing, and stops its engine request."""
    job_id = None
    for _ in range(4):  # round-robin: one of the first two lands on engine one
        (candidate,) = submit(faulty, 1, max_tokens=300)  # ~6 s at 20 ms a step
        faulty.wait_running(candidate, timeout_s=60)
        if faulty.api("GET", f"/api/jobs/{candidate}/").json()["engine"] == "one":
            job_id = candidate
            break
    assert job_id is not None
    frozen = faulty.procs["engine-one"]
    os.killpg(frozen.pid, signal.SIGSTOP)  # the worker and its core, mid-job
    try:
        done = faulty.wait_job(job_id, timeout_s=120)
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
    assert done["status"] == "finished" and done["engine"] == "two" and done["attempts"] == 2
    assert done["num_output_tokens"] == 300

    def one_idle() -> bool:  # the old attempt's request is stopped, not run to its end
        one = next(e for e in faulty.api("GET", "/api/engines/").json() if e["name"] == "one")
        return one["alive"] and one["metrics"].get("running", 1) == 0
    faulty.wait(one_idle, "engine one idle again", 60)
    one = next(e for e in faulty.api("GET", "/api/engines/").json() if e["name"] == "one")
    assert one["metrics"]["num_generation_tokens"] < 300  # stopped, not run to its end
    after = faulty.api("GET", f"/api/jobs/{job_id}/").json()
    assert (after["status"], after["output_text"], after["finished_at"], after["attempts"]) == \
        (done["status"], done["output_text"], done["finished_at"], 2)  # ended once


def test_a_failing_step_fails_its_jobs_only(faulty):
    long_ids = submit(faulty, 2, max_tokens=400)
    faulty.wait(lambda: all(faulty.api("GET", f"/api/jobs/{i}/").json()["status"] == "running"
                            for i in long_ids), "jobs running", 30)
    victim = faulty.api("GET", f"/api/jobs/{long_ids[0]}/").json()["engine"]
    faulty.arm_fault(victim)  # (tests/support/faults: its next step raises)
    failed = faulty.wait_job(long_ids[0], timeout_s=60)
    assert failed["status"] == "failed" and "injected fault" in failed["error"]
    (after,) = submit(faulty, 1, max_tokens=5)
    assert faulty.wait_job(after, timeout_s=60)["status"] == "finished"
    for i in long_ids[1:]:
        faulty.api("POST", f"/api/jobs/{i}/cancel/")
        faulty.wait_job(i, timeout_s=60)

    def all_free():
        snap = faulty.api("GET", f"/api/engines/{victim}/").json()["snapshot"]
        states = decode_array(snap["gpu"]["state"])
        used = sum(states == snap["block_states"].index("used"))
        return used == 0 and not [r for r in snap["requests"]
                                  if r["status"] in ("running", "waiting", "swapped")]

    faulty.wait(all_free, "every block released", 20)
