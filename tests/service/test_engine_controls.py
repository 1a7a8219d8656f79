"""Live batch limits through the API, against the shared stack's simulated engine:
applied between two steps, bounded by their values at start, audited, staff only."""


def test_batch_limits_change_live_within_their_bounds(stack):
    answer = stack.api("POST", "/api/engines/sim/limits/", json={"max_num_seqs": 4})
    assert answer.status_code == 200, answer.text
    result = answer.json()["result"]
    assert result["max_num_seqs"] == 4 and result["caps"]["max_num_seqs"] == 16
    too_many = stack.api("POST", "/api/engines/sim/limits/", json={"max_num_seqs": 17})
    assert too_many.status_code == 400 and "[1, 16]" in too_many.json()["error"]["message"]
    assert stack.api("POST", "/api/engines/sim/limits/", json={}).status_code == 400
    assert stack.api("POST", "/api/engines/sim/limits/",
                     json={"max_num_batched_tokens": 8}).status_code == 400
    assert stack.api("POST", "/api/engines/sim/limits/", json={"max_num_seqs": 2},
                     user="alice").status_code == 403
    # jobs still run under the lower limit; then the limit goes back up
    jobs = [stack.api("POST", "/api/jobs/", json={"prompt": f"limited {i}", "max_tokens": 3,
                                                   "engine": "sim"}).json()["id"]
            for i in range(6)]
    assert all(stack.wait_job(j)["status"] == "finished" for j in jobs)
    back = stack.api("POST", "/api/engines/sim/limits/", json={"max_num_seqs": 16})
    assert back.json()["result"]["max_num_seqs"] == 16
    actions = stack.api("GET", "/api/actions/?limit=20").json()["results"]
    assert any(a["action"] == "set-limits" and a["params"] == {"max_num_seqs": 4}
               for a in actions)


def test_a_state_command_is_seen_as_soon_as_it_is_answered(stack):
    """A pause's new state is in the engine's row, written by its worker from what its
    core reports (the row's one writer), before the web answers: the next read shows it,
    with no heartbeat to wait for."""
    try:
        assert stack.api("POST", "/api/engines/sim/pause/").json()["ok"]
        engine = stack.api("GET", "/api/engines/sim/").json()["engine"]
        assert engine["state"] == "paused" and engine["metrics"]["state"] == "paused"
    finally:
        assert stack.api("POST", "/api/engines/sim/resume/").json()["ok"]
    assert stack.api("GET", "/api/engines/sim/").json()["engine"]["state"] == "ready"
