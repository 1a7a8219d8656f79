"""The engine core (engine/serve/core_proc.py) and its worker-side clients, one contract over
two transports (engine/serve/client.py): requests and operator commands through the
boundary and expired commands dropped, in a process and on a thread alike; and, for a
core process, a core killed mid-stream (its requests fail with the reason, a new core
takes over; through the service, the stream ends with an error instead of hanging)."""
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams, \
    UnknownRequestError
from engine.errors import CommandExpired
from engine import wire
from engine.serve.client import InprocClient, MPClient
from tests.support.stack import Stack
from benchmarks.sse_client import stream_completion
from tests.service.test_jobs_api import expected_text
from tests.support.wait import wait_until, wait_until_async

CONFIG = dict(simulate=True, simulate_tokenizer="bytes",
              vocab_size=1000, num_gpu_blocks=256, simulate_step_ms=5)


class ListSink:
    """Collects what the client hands to its output processor."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.failed: dict[str, str] = {}

    def push(self, outputs) -> None:
        with self.cond:
            for o in outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    self.finished[o.request_id] = o.finish_reason
            self.cond.notify_all()

    def fail(self, request_ids, message) -> None:
        with self.cond:
            for request_id in request_ids:
                self.failed[request_id] = message
            self.cond.notify_all()

    def wait(self, predicate, what: str, timeout_s: float = 60) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, timeout_s):
                raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def core():
    """A core process and its client."""
    sink = ListSink()
    client = MPClient(EngineConfig(name="core-test", **CONFIG), sink)
    client.start()
    yield client, sink
    client.stop()


@pytest.fixture(params=[MPClient, InprocClient], ids=["process", "thread"])
def any_core(request):
    """A core and its client, over each transport: the same contract."""
    sink = ListSink()
    client = request.param(EngineConfig(name=f"core-{request.param.address_scheme}",
                                        **CONFIG), sink)
    client.start()
    yield client, sink
    client.stop()


def test_the_core_runs_ahead_of_the_service_on_the_cpu(core):
    """The core process takes niceness -19 (engine.core_proc.CORE_NICE), so that its
    steps do not wait for a CPU behind the service's processes."""
    from engine.serve.core_proc import CORE_NICE
    client, _ = core
    if "KVOPS_ENGINE_CORE_NICE" in os.environ or os.geteuid() != 0:
        pytest.skip("the niceness is set by the environment, or cannot be lowered here")
    assert os.getpriority(os.PRIO_PROCESS, client.pid) == CORE_NICE == -19


def test_requests_and_commands_cross_the_boundary(any_core):
    client, sink = any_core
    client.submit("r1", "hello core", {"max_tokens": 12, "temperature": 0.0})
    sink.wait(lambda: "r1" in sink.finished, "r1 to finish")
    alone = LLMEngine(EngineConfig(**CONFIG)).generate(
        ["hello core"], SamplingParams(max_tokens=12))[0]
    assert sink.tokens["r1"] == alone.output_token_ids
    assert sink.finished["r1"] == "length"
    assert client.describe_config()["num_gpu_blocks"] == 256
    assert client.command("metrics", {})["num_generation_tokens"] == 12
    with pytest.raises(UnknownRequestError):
        client.command("abort", {"request_id": "nobody"})
    with pytest.raises(InvalidRequestError):
        client.submit("r1", "", {"max_tokens": 4})  # an empty prompt
    with pytest.raises(InvalidRequestError):
        client.command("teleport", {})


def test_the_cores_threads_spin_only_where_the_core_outranks_the_service(core):
    """OpenMP's wait (engine.serve.client.core_environment): a core that will run at
    SPIN_NICE or lower spins SPIN_COUNT turns at a barrier before it sleeps; one that runs
    at a higher niceness, or may not lower it, sleeps at once (OMP_WAIT_POLICY=PASSIVE); a
    value the operator set stays."""
    from engine.serve.core_proc import SPIN_COUNT
    from engine.serve.client import core_environment
    for nice in (0, -5):
        env = core_environment({}, nice)
        assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    assert core_environment({"OMP_WAIT_POLICY": "ACTIVE"}, 0)["OMP_WAIT_POLICY"] == "ACTIVE"
    assert core_environment({"GOMP_SPINCOUNT": "7"}) == {"GOMP_SPINCOUNT": "7"}
    if os.geteuid() != 0 or {"KVOPS_ENGINE_CORE_NICE", "OMP_WAIT_POLICY",
                             "GOMP_SPINCOUNT"} & set(os.environ):
        pytest.skip("niceness cannot be lowered here, or the environment sets the wait")
    assert core_environment({}) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}  # -19: root may
    client, _ = core
    with open(f"/proc/{client.pid}/environ", "rb") as f:
        environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    assert environ[b"GOMP_SPINCOUNT"] == str(SPIN_COUNT).encode()
    assert b"OMP_WAIT_POLICY" not in environ
    # A user without the right to lower niceness (the kernel refuses it): sleeping threads.
    unprivileged = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         "from engine.serve.core_proc import may_take_niceness as m; print(m(-19), m(5))"],
        capture_output=True, text=True, timeout=120, cwd=os.getcwd())
    assert unprivileged.stdout.split() == ["False", "True"], unprivileged.stderr


def test_an_expired_command_is_dropped_not_applied_late(any_core):
    client, sink = any_core
    client.submit("long", "a long one", {"max_tokens": 3000, "ignore_eos": True})
    sink.wait(lambda: len(sink.tokens.get("long", [])) >= 2, "tokens of the long request")
    with pytest.raises(CommandExpired):
        client._call(wire.Command(0, "abort", {"request_id": "long"}, time.time() - 1), 10)
    assert "long" not in sink.finished
    assert client.command("abort", {"request_id": "long"})["status"] == "aborted"
    sink.wait(lambda: sink.finished.get("long") == "abort", "the abort to be reported")


def test_a_killed_core_fails_its_requests_and_a_new_one_takes_over(core):
    client, sink = core
    client.submit("victim", "doomed", {"max_tokens": 3000, "ignore_eos": True})
    sink.wait(lambda: len(sink.tokens.get("victim", [])) >= 2, "tokens of the victim")
    first = client.pid
    os.kill(first, signal.SIGKILL)
    sink.wait(lambda: "victim" in sink.failed, "the victim to fail")
    assert "SIGKILL" in sink.failed["victim"]
    wait_until(lambda: client.alive and client.pid != first, "a new core", 60, poll_s=0.05)
    client.submit("after", "still serving", {"max_tokens": 5})
    sink.wait(lambda: "after" in sink.finished, "a request on the new core")


@pytest.fixture(scope="module")
def process_stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("core-stack"))
    try:
        s.start_web()
        s.start_engine("proc", core="process", simulate=1, vocab_size=32000,
                       num_gpu_blocks=512, max_num_seqs=16, simulate_step_ms=20)
        yield s
    finally:
        s.stop()


def core_pid(stack: Stack) -> int:
    worker = stack.procs["engine-proc"].pid
    out = subprocess.run(["pgrep", "-P", str(worker), "-f", "engine.serve.core_proc"],
                         capture_output=True, text=True)
    return int(out.stdout.split()[0])


def test_the_service_streams_through_a_core_process(process_stack):
    async def main():
        return await stream_completion(process_stack.url, process_stack.tokens["alice"],
                                       {"model": "simulated-v1", "prompt": "via core",
                                        "max_tokens": 20, "temperature": 0})
    result = asyncio.run(main())
    assert result.error is None and result.text == expected_text("via core", 20)


def test_a_core_killed_mid_stream_ends_the_stream_with_an_error(process_stack):
    async def main():
        task = asyncio.create_task(stream_completion(
            process_stack.url, process_stack.tokens["alice"],
            {"model": "simulated-v1", "prompt": "cut short", "max_tokens": 3000,
             "ignore_eos": True}))
        def running() -> list[dict]:
            jobs = process_stack.api("GET", "/api/jobs/?status=running").json()
            return jobs["results"] if isinstance(jobs, dict) else jobs

        await wait_until_async(lambda: asyncio.to_thread(running),
                               "the job to run and say something", 60, poll_s=0.05,
                               until=lambda rows: any(r["num_output_tokens"] > 0 for r in rows))
        os.kill(core_pid(process_stack), signal.SIGKILL)
        return await asyncio.wait_for(task, 60)

    result = asyncio.run(main())
    assert result.error is not None and "engine core" in result.error, result.error
    jobs = process_stack.api("GET", "/api/jobs/").json()
    rows = jobs["results"] if isinstance(jobs, dict) else jobs
    job = next(r for r in rows if r["prompt"] == "cut short")
    assert job["status"] == "failed" and "SIGKILL" in job["error"], job

    async def after():
        return await stream_completion(process_stack.url, process_stack.tokens["alice"],
                                       {"model": "simulated-v1", "prompt": "next one",
                                        "max_tokens": 8, "temperature": 0})
    # the worker starts a new core; until then jobs are refused or wait
    result = wait_until(lambda: asyncio.run(after()), "a stream on a new core", 60, poll_s=0,
                        until=lambda result: result.error is None)
    assert result.text == expected_text("next one", 8)


@pytest.mark.stack
def test_a_core_stopped_with_its_worker_is_not_replaced(tmp_path):
    """SIGTERM to the worker's process group (`make run`'s Ctrl-C, `docker stop`) stops
    the core and the worker together: the worker starts no new core on its way out (one
    would load its model for nothing and outlive the worker while it loads)."""
    stack = Stack(tmp_path)
    try:
        stack.start_web()
        stack.start_engine("proc", core="process", simulate=1, vocab_size=32000,
                           num_gpu_blocks=128, simulate_step_ms=5)
        first = core_pid(stack)
        with open(f"/proc/{first}/cmdline") as f:
            inbox = next(a for a in f.read().split("\0") if a.startswith("ipc://"))
        stack.kill("engine-proc")  # SIGTERM to the group; returns once the worker exited
        log = stack.log("engine-proc")
        assert "stopped (signal SIGTERM)" in log and "not replaced" in log, log[-3000:]
        assert log.count("starting its process") == 1, log[-3000:]
        survivors = subprocess.run(["pgrep", "-f", inbox], capture_output=True, text=True)
        assert survivors.stdout.split() == [], "a core outlived its worker"
    finally:
        stack.stop()
