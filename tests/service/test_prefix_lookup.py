"""Which engine holds this prefix: POST /api/prefix-lookup/ against a real stack (two
simulated engine workers, one with a CPU tier, Redis, SQLite). A prefix named by text,
token ids, chat messages or a job is found on the engine that ran it, in both the
router's prefix index and the engine's own answer, under its owner's cache salt only;
every bad body is a 400 (or 403) naming its field. The engine's side alone:
tests/engine/test_prefix_lookup.py."""
import uuid
from pathlib import Path

import pytest

from tests.support.stack import Stack

LOOKUP = "/api/prefix-lookup/"
BLOCK = 16  # the byte tokenizer: one token per UTF-8 byte
TIERED, PLAIN = "lka", "lkb"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("prefix-lookup")))
    try:
        s.start_web()
        s.manage("shell", "-c", "from django.contrib.auth.models import User; "
                 "User.objects.create_user('bob', password='bob-pass-1234')")
        s.tokens["bob"] = s.manage("drf_create_token", "bob").split()[2]
        # a GPU pool of 24 blocks over a CPU tier: three other prompts of 10 blocks push
        # one off the GPU onto the tier
        s.start_engine(TIERED, simulate=1, block_size=BLOCK, num_gpu_blocks=24,
                       num_cpu_blocks=64, cpu_prefix_cache=1, max_num_seqs=4)
        s.start_engine(PLAIN, simulate=1, block_size=BLOCK, num_gpu_blocks=256,
                       num_cpu_blocks=0, max_num_seqs=4)
        yield s
    finally:
        s.stop()


def unique_text(blocks: int = 10) -> str:
    """Text of its own (nobody else caches it), `blocks` full blocks and a few tokens."""
    tag = f"[{uuid.uuid4().hex}] "
    return (tag + "the operators keep this console open all night. " * 20)[:blocks * BLOCK + 5]


def run(stack, body: dict, user: str = "alice") -> dict:
    r = stack.api("POST", "/api/jobs/", user=user, json={"max_tokens": 2, "engine": TIERED,
                                                         **body})
    assert r.status_code == 201, r.text
    job = stack.wait_job(r.json()["id"], user=user)
    assert job["status"] == "finished", job
    return job


def look_up(stack, body: dict, user: str = "alice") -> dict:
    r = stack.api("POST", LOOKUP, user=user, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def row(answer: dict, engine: str) -> dict:
    return next(e for e in answer["engines"] if e["engine"] == engine)


def held(stack, body: dict, tokens: int, user: str = "alice", engine: str = TIERED,
         on: str = "gpu") -> dict:
    """The lookup once the router's index shows `tokens` cached on `engine` (it follows
    the engine's KV feed), checked to agree with the engine's own answer."""
    found = {}

    def agree() -> bool:
        found.update(row(look_up(stack, body, user), engine))
        return found["router"]["total"] == tokens and found["router"][on] == tokens

    stack.wait(agree, f"{tokens} tokens on {engine}'s {on} in the router's index", 15)
    assert found["engine_cache"]["total"] == tokens and found["engine_cache"][on] == tokens, found
    assert found["errors"] == [], found
    return found


def test_text_and_token_ids_find_the_prompt_on_the_engine_that_ran_it(stack):
    text = unique_text()
    job = run(stack, {"prompt": text})
    full = len(text) // BLOCK * BLOCK
    found = held(stack, {"text": text}, full)
    assert found["num_prompt_tokens"] == len(text) and found["block_size"] == BLOCK
    assert found["engine_cache"] == {"gpu": full, "cpu": 0, "disk": None, "total": full}
    assert found["router"]["disk"] is None  # (the index keeps no disk tier)
    answer = look_up(stack, {"text": text})
    assert answer["user"] == "alice" and answer["salted"]
    other = row(answer, PLAIN)  # the other engine never ran it
    assert other["router"]["total"] == other["engine_cache"]["total"] == 0
    assert other["engine_cache"]["cpu"] is None  # (it has no CPU tier)
    ids = stack.api("GET", f"/api/jobs/{job['id']}/", user="alice").json()["prompt_token_ids"]
    held(stack, {"token_ids": ids[:3 * BLOCK + 7]}, 3 * BLOCK)
    held(stack, {"text": text, "model": row(answer, TIERED)["model"]}, full)


def test_a_chat_is_found_by_its_messages_and_by_its_job(stack):
    system = unique_text(6)
    job = run(stack, {"messages": [{"role": "system", "content": system},
                                   {"role": "user", "content": "Which engine?"}]})
    # the simulator's transcript of the system message alone, without "assistant: "
    rendered = len(f"system: {system}\n".encode())
    held(stack, {"messages": [{"role": "system", "content": system}]}, rendered // BLOCK * BLOCK)
    held(stack, {"job": job["id"]}, job["num_prompt_tokens"] // BLOCK * BLOCK)
    # its system prompt as raw text is not what the chat cached
    assert row(look_up(stack, {"text": system}), TIERED)["engine_cache"]["total"] == 0


def test_a_prefix_pushed_to_the_cpu_tier_shows_there_in_both_views(stack):
    text = unique_text()
    run(stack, {"prompt": text})
    for _ in range(3):
        run(stack, {"prompt": unique_text()})
    held(stack, {"text": text}, len(text) // BLOCK * BLOCK, on="cpu")


def test_another_user_sees_no_hit_under_their_salt_and_staff_may_name_the_owner(stack):
    text = unique_text()
    job = run(stack, {"prompt": text})
    full = len(text) // BLOCK * BLOCK
    held(stack, {"text": text}, full)
    for user, body in (("bob", {"text": text}), ("bob", {"text": text, "user": "bob"}),
                       ("admin", {"text": text})):  # (staff: the shared, unsalted cache)
        answer = look_up(stack, body, user)
        assert answer["user"] == user and answer["salted"] == (user == "bob")
        for engine in answer["engines"]:
            assert engine["router"]["total"] == engine["engine_cache"]["total"] == 0, engine
    assert held(stack, {"text": text, "user": "alice"}, full, user="admin")
    assert held(stack, {"job": job["id"]}, full, user="admin")  # under its owner's salt
    refused = stack.api("POST", LOOKUP, user="bob", json={"job": job["id"]})
    assert refused.status_code == 400 and refused.json()["error"]["field"] == "job", refused.text
    refused = stack.api("POST", LOOKUP, user="bob", json={"text": text, "user": "alice"})
    assert refused.status_code == 403 and refused.json()["error"]["field"] == "user", refused.text
    assert stack.api("POST", LOOKUP, user=None, json={"text": text}).status_code == 401


ONE_OF = "give exactly one of `job`"


@pytest.mark.parametrize("body, field, says", [
    ({}, "non_field_errors", ONE_OF),
    ({"model": "x"}, "non_field_errors", ONE_OF),
    ({"text": "a", "token_ids": [1]}, "text", ONE_OF),
    ({"job": 1, "messages": [{"role": "user", "content": "x"}]}, "messages", ONE_OF),
    ({"token_ids": []}, "non_field_errors", ONE_OF),
    ({"text": ""}, "text", "blank"),
    ({"text": 7}, "text", "must be a string"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "`role`"),
    ({"token_ids": [1] * 5000}, "token_ids", "too long"),
    ({"token_ids": [1, 40000]}, "token_ids", "vocabulary"),
    ({"token_ids": [-1]}, "token_ids", "greater than or equal to 0"),
    ({"job": 10 ** 12}, "job", "no job 1000000000000"),
    ({"job": 0}, "job", "greater than or equal to 1"),
    ({"job": 1, "user": "alice"}, "user", "owner's cache salt"),
    ({"text": "x", "model": "no-such-model"}, "model", "no live engine serves 'no-such-model'"),
    ({"text": "x", "user": "nobody-here"}, "user", "no user 'nobody-here'"),
    ({"text": "x", "salt": "s"}, "salt", "unknown field"),
])
def test_a_bad_lookup_is_a_400_naming_its_field(stack, body, field, says):
    r = stack.api("POST", LOOKUP, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request" and error["field"] == field, error
    assert says in error["message"], error
