"""An engine's answer to "how much of this prompt do you hold?" (LLMEngine.lookup_prefix,
the `prefix-lookup` command): the leading cached tokens per level of its prefix cache,
the same split a request's admission then finds (its KV story), under the prompt's cache
salt only, and nothing changed by asking."""
from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.serve.commands import run_command

from tests.engine.sim import greedy, run_all, sim_engine

BLOCK = 4


def prompt_of(seed: int, n: int = 30) -> list[int]:
    """n tokens: 30 leaves a partial block, so an admission takes every full one."""
    return [(seed * 131 + i * 7) % 997 + 1 for i in range(n)]


def ask(engine, rid: str, prompt: list[int], salt: str | None = None):
    engine.add_request(rid, prompt, greedy(2), cache_salt=salt)
    return run_all(engine)[rid]


def counters(engine) -> dict:
    """The engine's metrics but its token rates (which move with the clock)."""
    return {k: v for k, v in engine.metrics().items() if not k.endswith("_per_s")}


def test_a_prompt_on_the_gpu_only_under_its_own_salt():
    engine = sim_engine(block_size=BLOCK, num_gpu_blocks=32, num_cpu_blocks=0)
    prompt = prompt_of(1)
    ask(engine, "a", prompt, salt="alice")
    answer = engine.lookup_prefix(prompt, "alice")
    assert answer == {"num_prompt_tokens": 30, "block_size": BLOCK, "cached_tokens": 28,
                      "tiers": {"gpu": 28, "cpu": None, "disk": None}}
    # a part of it, and the same tokens under another salt or none: not held
    assert engine.lookup_prefix(prompt[:10], "alice")["tiers"]["gpu"] == 8
    for salt in ("bob", None):
        assert engine.lookup_prefix(prompt, salt)["cached_tokens"] == 0
    # asked for again, it is found as the lookup said
    assert ask(engine, "b", prompt, salt="alice").num_cached_tokens == 28


def test_a_salted_prompt_finds_a_pinned_unsalted_prefix_as_its_admission_does():
    engine = sim_engine(block_size=BLOCK, num_gpu_blocks=32, num_cpu_blocks=0)
    prompt = prompt_of(2)
    ask(engine, "shared", prompt)
    assert engine.lookup_prefix(prompt, "carol")["cached_tokens"] == 0  # not pinned yet
    engine.pin_prefix(prompt[:16])
    assert engine.lookup_prefix(prompt, "carol")["tiers"]["gpu"] == 16
    assert ask(engine, "c", prompt, salt="carol").num_cached_tokens == 16


def test_the_split_over_gpu_cpu_and_disk_is_what_the_next_admission_finds(tmp_path):
    engine = sim_engine(block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=12,
                        cpu_prefix_cache=True, max_num_batched_tokens=64,
                        disk_cache_dir=str(tmp_path))
    first = prompt_of(0)
    ask(engine, "cold", first)
    ask(engine, "hit", first)  # asked for again: its blocks may go to disk
    for seed in (1, 2):  # others push it down the tiers: some of it to each
        ask(engine, f"other{seed}", prompt_of(seed, 24))
    engine.kv.tiers[-1].store.flush()
    before = counters(engine)
    answer = engine.lookup_prefix(first)
    tiers = answer["tiers"]
    assert answer["cached_tokens"] == sum(tiers.values()) == 28
    assert all(tiers.values()), tiers
    assert counters(engine) == before  # nothing read back, touched or counted
    back = ask(engine, "back", first)
    assert back.num_cached_tokens == 28
    assert engine.kv_story("back")["cached_tokens"] == tiers
    engine.close()


def test_the_command_takes_text_or_token_ids_and_refuses_a_bad_prompt():
    engine = sim_engine(block_size=BLOCK, num_gpu_blocks=32, num_cpu_blocks=0)
    engine.add_request("t", "sixteen bytes!!! and more", greedy(1))
    run_all(engine)
    by_text = run_command(engine, "prefix-lookup", {"prompt": "sixteen bytes!!! and more"})
    assert by_text["cached_tokens"] == 24 and by_text["num_prompt_tokens"] == 25
    ids = list("sixteen bytes!!!".encode())
    by_ids = run_command(engine, "prefix-lookup", {"token_ids": ids, "cache_salt": None})
    assert by_ids["tiers"]["gpu"] == 16
    for bad in ({}, {"token_ids": []}, {"prompt": ""}, {"token_ids": [10 ** 9]}):
        with pytest.raises(InvalidRequestError):
            run_command(engine, "prefix-lookup", bad)
