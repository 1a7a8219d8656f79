"""Moves between engines when an engine dies in the middle of one (docs/operations.md, What
happens when things fail): the source or the destination SIGKILLed (its worker and its
core) while a request's blocks are being copied, and a drain by migration one of whose
destinations dies. Every job ends once, finished, with its whole text; a /v1 stream gets
a complete answer; and every engine that survived settles with its block invariants
holding and nothing held for a move (tests/support/kv_invariants.py).

The copies are slowed down so that a kill lands in one: the engine cores stage one block
between two steps instead of STAGE_BLOCKS (KVOPS_TEST_STAGE_BLOCKS, tests/support/faults),
and the prompts fill one to two hundred blocks, so a copy takes seconds; the kill comes once
the destination holds the move's blocks while it runs nothing.

Each test fails on a broken build (checked by hand): with a destination never giving back
a copy its source stopped sending (link.py's HOLD_TIMEOUT_S check disabled), the source
tests fail at engine two's settle (blocks held by nothing); with a source never giving
up on a silent destination (LINK_TIMEOUT_S ignored), the destination test gets a 504 at
the move's deadline instead of the 409 that says why, and the drain test finds the
drain's moves to engine two missing from the operator log once engine one has drained."""
from __future__ import annotations

import signal
import threading
from pathlib import Path

import openai
import pytest

from tests.service.test_jobs_api import expected_text
from tests.support import kv_invariants
from tests.support.stack import Stack

MODEL = "simulated-v1"
ENGINE = dict(simulate=1, vocab_size=32000, block_size=16, num_gpu_blocks=1024,
              num_cpu_blocks=0, max_num_seqs=16, simulate_step_ms=20)
HOLD_S = 30.0  # engine/transfer/link.py HOLD_TIMEOUT_S: a destination gives back a
#                copy its source forgot after this
SETTLE_S = HOLD_S + 20.0  # ... and its next stored snapshot shows it


@pytest.fixture()
def start_stack(tmp_path):
    """start_stack(*engine names): web and those engines, whose deaths the reaper sees
    within 3 s, whose moves may take 20 s, and whose copies go a block a step."""
    stacks: list[Stack] = []

    def start(*names: str) -> Stack:
        s = Stack(Path(tmp_path), faults=True,
                  env={"KVOPS_ENGINE_DEAD_AFTER_S": "3", "KVOPS_CONTROL_TIMEOUT_S": "20",
                       "KVOPS_TEST_STAGE_BLOCKS": "1"})
        stacks.append(s)
        s.start_web()
        for name in names:
            s.start_engine(name, **ENGINE)
        return s

    yield start
    for s in stacks:
        s.stop()


def engine_row(stack: Stack, name: str) -> dict:
    return next(e for e in stack.api("GET", "/api/engines/").json() if e["name"] == name)


def snapshot_of(stack: Stack, name: str) -> dict:
    return stack.api("GET", f"/api/engines/{name}/").json()["snapshot"]


def wait_settled(stack: Stack, names: list[str], timeout_s: float) -> None:
    """Each engine's stored snapshot: no request left, no block held, invariants whole."""
    for name in names:
        stack.wait(lambda name=name: kv_invariants.settled(snapshot_of(stack, name)),
                   f"engine {name} settled, its invariants whole", timeout_s)
        assert kv_invariants.problems(snapshot_of(stack, name)) == []


def submit(stack: Stack, prompt: str, n: int) -> int:
    r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": n,
                                              "ignore_eos": True})
    assert r.status_code == 201, r.text
    return r.json()["id"]


class Stream:
    """A /v1 completion streamed with the openai client on a thread of its own."""

    def __init__(self, stack: Stack, prompt: str, n: int) -> None:
        self.prompt, self.n = prompt, n
        self.chunks: list[str] = []
        self.finishes: list[str] = []
        self.errors: list[BaseException] = []
        self.done = threading.Event()
        self.client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.tokens["alice"],
                                    max_retries=0, timeout=120)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for chunk in self.client.completions.create(
                    model=MODEL, prompt=self.prompt, max_tokens=self.n, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}):
                self.chunks.append(chunk.choices[0].text)
                if chunk.choices[0].finish_reason:
                    self.finishes.append(chunk.choices[0].finish_reason)
        except BaseException as e:  # noqa: BLE001  (the test reads it)
            self.errors.append(e)
        finally:
            self.done.set()

    def job(self, stack: Stack) -> int:
        jobs = stack.api("GET", "/api/jobs/", user="alice").json()["results"]
        return next(j["id"] for j in jobs if j["prompt"] == self.prompt)

    def assert_whole(self) -> None:
        """One complete answer: the whole text, one finish, no error."""
        assert self.done.wait(60) and not self.errors, self.errors
        assert "".join(self.chunks) == expected_text(self.prompt, self.n)
        assert self.finishes == ["length"]


def running_on_one(stack: Stack, start_jobs, idle: list[str]) -> list[int]:
    """Jobs started while the `idle` engines are paused (routing passes them by), so that
    they run on engine one and the others hold nothing; returns them once each has made
    a few tokens, the idle engines resumed."""
    for name in idle:
        assert stack.api("POST", f"/api/engines/{name}/pause/").status_code == 200
    ids = start_jobs()
    stack.wait(lambda: all(
        (j := stack.api("GET", f"/api/jobs/{i}/").json())["status"] == "running"
        and j["engine"] == "one" and j["num_output_tokens"] >= 5 for i in ids),
        "the jobs running on engine one", 60)
    for name in idle:
        assert stack.api("POST", f"/api/engines/{name}/resume/").status_code == 200
    return ids


class Move:
    """An operator's move of a job's request off engine one (POST .../migrate/) on a
    thread: the call answers once the request runs at the destination, or why not."""

    def __init__(self, stack: Stack, job_id: int, to: str) -> None:
        rid = stack.api("GET", f"/api/jobs/{job_id}/").json()["request_id"]
        self.result: tuple[int, dict] | None = None
        self.thread = threading.Thread(target=self._move, args=(stack, rid, to), daemon=True)
        self.thread.start()

    def _move(self, stack: Stack, rid: str, to: str) -> None:
        try:
            r = stack.api("POST", f"/api/engines/one/requests/{rid}/migrate/", json={"to": to})
            self.result = (r.status_code, r.json())
        except Exception as e:  # noqa: BLE001  (the test reads it)
            self.result = (0, {"exception": repr(e)})

    def answer(self) -> tuple[int, dict]:
        """(HTTP status, body)."""
        self.thread.join(60)
        assert self.result is not None, "the move call did not answer within 60 s"
        return self.result


def wait_holding(stack: Stack, name: str, blocks: int) -> None:
    """Until engine `name` holds at least `blocks` blocks while it runs nothing: the
    blocks it holds for copies under way (its heartbeat's metrics)."""
    def holding() -> bool:
        row = engine_row(stack, name)
        m = row["metrics"]
        held = round(m.get("kv_usage", 0) * row["config"]["num_gpu_blocks"])
        return held >= blocks and m.get("running") == 0 and m.get("waiting") == 0
    stack.wait(holding, f"engine {name} to hold {blocks} blocks for the copies", 30)


def full_blocks(*prompts: str) -> int:
    return sum(len(p.encode()) // ENGINE["block_size"] for p in prompts)


def one_job(stack: Stack, client: str, prompt: str, n: int) -> tuple[int, Stream | None]:
    """A job of `client` ("rest": POST /api/jobs/, "stream": a /v1 stream) running on
    engine one, engine two idle; its id, and its stream."""
    streams: list[Stream] = []

    def start_job() -> list[int]:
        if client == "rest":
            return [submit(stack, prompt, n)]
        streams.append(Stream(stack, prompt, n))
        stack.wait(lambda: streams[0].job(stack), "the stream's job", 30)
        return [streams[0].job(stack)]

    [job_id] = running_on_one(stack, start_job, idle=["two"])
    return job_id, (streams[0] if streams else None)


@pytest.mark.parametrize("client", ["rest", "stream"])
def test_the_source_killed_mid_copy_its_job_runs_again_on_the_destination(start_stack, client):
    """Engine one dies (worker and core, SIGKILL) while a job's blocks are being copied to
    engine two: the reaper runs the job again on two, once; it finishes with all its
    tokens, a stream's client gets a whole answer, two gives back the blocks it held for
    the copy (after HOLD_TIMEOUT_S) and its invariants hold; the operator's move call
    times out (504) and one is reported dead."""
    stack = start_stack("one", "two")
    n = 400  # 8 s at 20 ms a step: the job outlasts the start of the copy
    prompt = f"A {client} job whose engine dies while it moves. " * 64  # about 190 blocks
    job_id, stream = one_job(stack, client, prompt, n)
    move = Move(stack, job_id, "two")
    wait_holding(stack, "two", full_blocks(prompt))
    stack.kill("engine-one", signal.SIGKILL)

    if stream is not None:
        stream.assert_whole()
    final = stack.wait_job(job_id, timeout_s=60)
    assert final["status"] == "finished", final
    assert final["output_text"] == expected_text(prompt, n)
    assert final["num_output_tokens"] == n
    assert (final["engine"], final["attempts"]) == ("two", 2)  # again, once
    status, body = move.answer()
    assert status == 504, body
    one = engine_row(stack, "one")
    assert one["status"] == "dead" and not one["alive"]
    wait_settled(stack, ["two"], SETTLE_S)
    # two made the job's tokens once: it never ran the moved request beside the new one
    assert snapshot_of(stack, "two")["metrics"]["num_generation_tokens"] == n


def test_the_destination_killed_mid_copy_its_request_finishes_at_the_source(start_stack):
    """Engine two dies while a /v1 stream's blocks are being copied to it: the source hears
    nothing for LINK_TIMEOUT_S and gives the move up; the request runs on at engine one
    and finishes there, once, with all its tokens; the stream's client gets a whole
    answer; the move call answers with why; engine one settles (its stored snapshot
    lists the request as running no longer, within a few of its stores) with its
    invariants whole."""
    stack = start_stack("one", "two")
    n = 900  # 18 s at 20 ms a step: the job outlasts the move's give-up
    prompt = "A streamed job whose destination dies. " * 78  # about 190 blocks
    job_id, stream = one_job(stack, "stream", prompt, n)
    move = Move(stack, job_id, "two")
    wait_holding(stack, "two", full_blocks(prompt))
    stack.kill("engine-two", signal.SIGKILL)

    status, body = move.answer()
    assert status == 409 and "did not answer" in body["error"]["message"], body
    assert stack.api("GET", f"/api/jobs/{job_id}/").json()["status"] == "running"
    stream.assert_whole()
    final = stack.wait_job(job_id, timeout_s=60)
    assert final["status"] == "finished", final
    assert final["output_text"] == expected_text(prompt, n)
    assert final["num_output_tokens"] == n
    assert (final["engine"], final["attempts"]) == ("one", 1)
    assert [e["engine"] for e in final["engines"]] == ["one"]
    wait_settled(stack, ["one"], 15)
    assert snapshot_of(stack, "one")["metrics"]["num_generation_tokens"] == n


def test_a_drain_by_migration_whose_destination_dies_loses_no_job(start_stack):
    """Engine one drains by migration to two and three; two dies while the copies to it
    are under way. The requests bound for two run on at one, those bound for three move
    there; every job finishes once with its whole text, one ends drained, and one and
    three settle with their invariants whole."""
    stack = start_stack("one", "two", "three")
    n = 900  # 18 s at 20 ms a step: the jobs outlast the moves and their give-up
    prompts = [f"drained while a destination dies ({i}). " * 40 for i in range(4)]  # 100 blocks

    ids = running_on_one(stack, lambda: [submit(stack, p, n) for p in prompts],
                         idle=["two", "three"])
    r = stack.api("POST", "/api/engines/one/drain/", json={"mode": "migrate"})
    assert r.status_code == 200, r.text
    assert sorted(r.json()["result"]["to"]) == ["three", "two"]
    wait_holding(stack, "two", full_blocks(*prompts[:2]))  # (its two moves' blocks)
    stack.kill("engine-two", signal.SIGKILL)

    finals = [stack.wait_job(i, timeout_s=60) for i in ids]
    for prompt, final in zip(prompts, finals):
        assert final["status"] == "finished", final
        assert final["output_text"] == expected_text(prompt, n)
        assert final["attempts"] == 1  # none ran again
    hops = sorted(tuple(e["engine"] for e in final["engines"]) for final in finals)
    assert hops == [("one",), ("one",), ("one", "three"), ("one", "three")], hops
    stack.wait(lambda: engine_row(stack, "one")["state"] == "drained", "one drained", 30)
    wait_settled(stack, ["one", "three"], 15)
    log = stack.api("GET", "/api/actions/").json()["results"]
    drained = [(a["params"]["to"], a["ok"]) for a in log
               if a["action"] == "migrate" and a["params"].get("by") == "drain"]
    assert sorted(drained) == [("three", True), ("three", True), ("two", False),
                               ("two", False)], drained
