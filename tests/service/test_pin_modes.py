"""Pinning what ran: POST /api/engines/<name>/prefix-cache/pin/ (and unpin/) names the
prefix by `job`, `messages`, `token_ids` or `text`, exactly one of them. A chat job's
blocks are its rendered chat's: its system prompt pasted as text finds none of them,
while a pin by the job (under its cache salt) or by its messages finds them all."""
import uuid

import pytest

from engine.observe.snapshot import decode_array

PIN = "/api/engines/sim/prefix-cache/pin/"
UNPIN = "/api/engines/sim/prefix-cache/unpin/"
BLOCK = 16  # the stack's block size; the byte tokenizer: one token per UTF-8 byte


def system_prompt() -> str:
    """A system prompt of its own (no other test caches its blocks), 12 blocks long."""
    return f"[{uuid.uuid4().hex}] You answer questions about paged KV caches. " * 3


def run_chat(stack, system: str, user: str = "admin") -> dict:
    r = stack.api("POST", "/api/jobs/", user=user, json={"max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "What is a block?"}]})
    assert r.status_code == 201, r.text
    job = stack.wait_job(r.json()["id"], user=user)
    assert job["status"] == "finished", job
    return job


def pinned_hashes(stack, block_ids: list[int]) -> list[str]:
    """The first 8 hex digits of each block's hash, as the snapshot has them, once every
    one of them shows as pinned there."""
    found = {}

    def all_pinned():
        snap = stack.api("GET", "/api/engines/sim/").json()["snapshot"]
        states, hash32 = decode_array(snap["gpu"]["state"]), decode_array(snap["gpu"]["hash32"])
        found["hashes"] = [f"{int(hash32[b]):08x}" for b in block_ids]
        return all(states[b] == snap["block_states"].index("pinned") for b in block_ids)

    stack.wait(all_pinned, "the pinned blocks in the snapshot", 10)
    return found["hashes"]


def test_a_salted_chat_job_is_pinned_by_job_exactly_the_blocks_it_cached(stack):
    system = system_prompt()
    job = run_chat(stack, system, user="alice")  # a plain user: her chain is salted
    # the case: the system prompt as raw text is not what the chat job cached
    r = stack.api("POST", PIN, json={"text": system})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "PrefixNotCachedError"
    # nor are the job's own ids without its salt
    ids = stack.api("GET", f"/api/jobs/{job['id']}/").json()["prompt_token_ids"]
    assert stack.api("POST", PIN, json={"token_ids": ids}).status_code == 409

    r = stack.api("POST", PIN, json={"job": job["id"]})
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    full_blocks = job["num_prompt_tokens"] // BLOCK
    assert len(result["block_ids"]) == full_blocks == len(ids) // BLOCK
    assert result["num_tokens"] == full_blocks * BLOCK and result["num_newly_pinned"] == full_blocks
    # the very blocks the job's KV story says its prompt was stored in
    story = stack.api("GET", f"/api/jobs/{job['id']}/kv/").json()
    story_hashes = [b["hash"][:8] for b in story["blocks"] if b["hash"]]
    assert pinned_hashes(stack, result["block_ids"]) == story_hashes

    # audited: the job, the ids it ran and its salt; the salt and ids hidden from alice
    logged = next(a for a in stack.api("GET", "/api/actions/").json()["results"]
                  if a["action"] == "pin" and a["params"].get("job") == job["id"])
    assert logged["ok"] and logged["params"]["token_ids"] == ids
    assert logged["params"]["cache_salt"]
    seen = next(a for a in stack.api("GET", "/api/actions/", user="alice").json()["results"]
                if a["id"] == logged["id"])
    assert seen["params"]["cache_salt"] == seen["params"]["token_ids"] == "(hidden: staff only)"

    r = stack.api("POST", UNPIN, json={"job": job["id"]})
    assert r.status_code == 200 and r.json()["result"]["num_unpinned"] == full_blocks, r.text


def test_a_chat_is_pinned_by_its_messages_without_the_generation_prompt(stack):
    system = system_prompt()
    job = run_chat(stack, system)
    messages = [{"role": "system", "content": system}]
    r = stack.api("POST", PIN, json={"messages": messages})
    assert r.status_code == 200, r.text
    # the simulator's transcript of the system message alone, no "assistant: " after it
    rendered = len(f"system: {system}\n".encode())
    assert r.json()["result"]["num_tokens"] == rendered // BLOCK * BLOCK
    assert rendered // BLOCK < job["num_prompt_tokens"] // BLOCK  # a prefix of the job's
    logged = next(a for a in stack.api("GET", "/api/actions/").json()["results"]
                  if a["action"] == "pin" and a["params"].get("messages") == messages)
    assert logged["ok"] and len(logged["params"]["token_ids"]) == rendered
    r = stack.api("POST", UNPIN, json={"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["result"]["num_unpinned"] == rendered // BLOCK


def test_token_ids_and_text_pin_and_unpin(stack):
    prompt = system_prompt()
    r = stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": 1})
    job = stack.wait_job(r.json()["id"])
    ids = stack.api("GET", f"/api/jobs/{job['id']}/").json()["prompt_token_ids"]
    r = stack.api("POST", PIN, json={"token_ids": ids[:3 * BLOCK]})
    assert r.status_code == 200 and r.json()["result"]["num_tokens"] == 3 * BLOCK, r.text
    r = stack.api("POST", PIN, json={"text": prompt})
    assert r.status_code == 200, r.text
    assert r.json()["result"]["num_newly_pinned"] == len(ids) // BLOCK - 3
    r = stack.api("POST", UNPIN, json={"text": prompt})
    assert r.status_code == 200 and r.json()["result"]["num_unpinned"] == len(ids) // BLOCK


ONE_OF = "give exactly one of `job`"


@pytest.mark.parametrize("body, field, says", [
    ({}, "non_field_errors", ONE_OF),
    ({"token_ids": []}, "non_field_errors", ONE_OF),
    ({"text": ""}, "text", "blank"),
    ({"job": 1, "text": "x"}, "text", ONE_OF),
    ({"messages": [{"role": "system", "content": "x"}], "token_ids": [1]}, "token_ids", ONE_OF),
    ({"text": "x", "prompt": "x"}, "prompt", ONE_OF),
    ({"job": 1, "cache_salt": "s"}, "cache_salt", "own cache salt"),
    ({"job": 0}, "job", "greater than or equal to 1"),
    ({"job": "one"}, "job", "integer"),
    ({"job": 10 ** 12}, "job", "there is no job 1000000000000"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "`role`"),
    ({"messages": "system: hello"}, "messages", "non-empty list"),
])
def test_a_pin_names_exactly_one_prefix(stack, body, field, says):
    for path in (PIN, UNPIN):
        r = stack.api("POST", path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request" and error["field"] == field, error
        assert says in error["message"], error
        if says == ONE_OF:  # the way to pin what chat jobs cached
            assert "pin by job or by messages" in error["message"], error


def test_only_operators_pin_by_job(stack):
    job = run_chat(stack, system_prompt(), user="alice")
    assert stack.api("POST", PIN, json={"job": job["id"]}, user="alice").status_code == 403
    assert stack.api("POST", PIN, json={"job": job["id"]}, user=None).status_code == 401
