"""The KV story document the job page reads (kvops/dashboard/kv_story_view.py), built
from a job's row alone: no engine, no database (the viewer is staff: nothing is sealed)."""
from types import SimpleNamespace

from kvops.dashboard.kv_story_view import document
from kvops.models import Job

STAFF = SimpleNamespace(is_staff=True)  # (a staff viewer: nothing sealed, nothing looked up)


def story(**extra) -> dict:
    """A story as the engine tells it (engine/observe/story.py Story.document)."""
    return {"engine": "a", "request_id": "job-7-1", "job_id": "7", "block_size": 16,
            "prompt_tokens": 40, "cached_tokens": {"gpu": 32, "cpu": 0, "disk": 0},
            "hashes": ["h0", "h1"], "sources": {"gpu": 2, "cpu": 0, "disk": 0},
            "first_miss": None, "preemptions": [], "swaps": [], "moves": [],
            "copy_on_write": 0, "window_freed": 0, "final_blocks": None,
            "moments": {"admitted": 100.0, "first_token": None, "preemptions": [],
                        "ended": None}, "finish_reason": None, **extra}


def job(status: str, kv_story: dict | None) -> Job:
    return Job(pk=7, status=status, engine="a", request_id="job-7-1", kv_story=kv_story,
               num_prompt_tokens=40)


def test_a_running_job_without_its_story_yet_is_waiting_for_it():
    doc = document(job(Job.Status.RUNNING, None), STAFF)
    assert not doc["told"]
    assert "running" in doc["detail"] and "waiting for its story" in doc["detail"]
    assert "keeps no KV history" not in doc["detail"]
    assert "not admitted" in document(job(Job.Status.QUEUED, None), STAFF)["detail"]
    assert "keeps no KV history" in document(job(Job.Status.FINISHED, None), STAFF)["detail"]


def test_the_blocks_held_at_the_end_come_from_the_jobs_own_record():
    final = {"gpu": [5, 9, 2], "cpu": []}
    doc = document(job(Job.Status.FINISHED, story(final_blocks=final, finish_reason="length")),
                   STAFF)
    assert doc["final_blocks"] == final
    assert [b["source"] for b in doc["blocks"]] == ["gpu", "gpu", "computed"]


def test_preemptions_swaps_and_moves_are_counted_apart():
    at = 101.0
    doc = document(job(Job.Status.FINISHED, story(
        preemptions=[{"at": at, "reason": "operator", "by": "admin", "needed_blocks": None,
                      "free_blocks": None, "recomputed_tokens": 20}],
        swaps=[{"at": at, "direction": "out", "reason": "operator", "by": "admin",
                "needed_blocks": None, "free_blocks": None, "blocks": 3},
               {"at": at, "direction": "in", "reason": "operator", "by": "admin",
                "needed_blocks": None, "free_blocks": None, "blocks": 3}])), STAFF)
    assert [p["reason"] for p in doc["preemptions"]] == ["operator"]
    assert [s["direction"] for s in doc["swaps"]] == ["out", "in"]
    assert doc["moves"] == [] and doc["swaps"][0]["at"].startswith("1970-01-01T00:01:41")


def test_a_story_kept_before_swaps_were_told_apart_is_sorted_out():
    old = story(preemptions=[
        {"at": 101.0, "reason": "kv_full", "by": "job-8-1", "needed_blocks": 4,
         "free_blocks": 1, "recomputed_tokens": 30, "swapped_blocks": 0},
        {"at": 102.0, "reason": "operator", "by": "admin", "needed_blocks": None,
         "free_blocks": None, "recomputed_tokens": 0, "swapped_blocks": 3},
        {"at": 103.0, "reason": "migration", "by": "east", "needed_blocks": None,
         "free_blocks": None, "recomputed_tokens": 0, "swapped_blocks": 6}])
    for key in ("swaps", "moves", "final_blocks"):
        del old[key]
    doc = document(job(Job.Status.FINISHED, old), STAFF)
    assert [p["reason"] for p in doc["preemptions"]] == ["kv_full"]
    assert [(s["direction"], s["reason"], s["blocks"]) for s in doc["swaps"]] == \
        [("out", "operator", 3)]
    assert [(m["from"], m["blocks_sent"]) for m in doc["moves"]] == [("east", 6)]
    assert doc["final_blocks"] is None


def test_the_kv_block_seconds_the_engine_counted_are_in_the_document():
    held = {"gpu": 12.5, "cpu": 2.0}
    assert document(job(Job.Status.FINISHED, story(block_seconds=held)), STAFF)["block_seconds"] == held
    # a story told before the engine counted them says nothing, not zero
    assert document(job(Job.Status.FINISHED, story()), STAFF)["block_seconds"] is None
