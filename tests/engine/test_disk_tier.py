"""The disk tier's store (engine/kv/tiers/disk.py): blocks as files that survive a restart,
sealed for the engine's identity (a bad or foreign file is a miss, deleted and counted),
LRU within a byte budget, writes behind that close() finishes. What it promises against
other users and forged files: tests/engine/test_disk_security.py."""
from __future__ import annotations

import functools
import os

import pytest

from engine.kv.tiers.disk_seal import file_bytes
from engine.kv.tiers.disk import DiskStore

IDENTITY = {"model": "m", "kv_format": "float32", "block_size": 4, "block_bytes": 64}


def h(i: int) -> bytes:
    return bytes([i]) * 32


def payload(i: int) -> bytes:
    return bytes([i % 251]) * 64


@pytest.fixture
def store(tmp_path):
    made = []

    def make(capacity: int = 1 << 20, identity: dict = IDENTITY) -> DiskStore:
        made.append(DiskStore(tmp_path, capacity, identity))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_blocks_come_back_and_outlive_a_restart(store, tmp_path):
    first = store()
    for i in range(5):
        assert first.put(h(i), payload(i))
    assert not first.put(h(0), payload(0))  # (there already)
    assert first.get(h(3)) == payload(3)  # (readable while queued, or written)
    first.close()  # finishes the writes
    assert first.stats.stored_blocks == 5
    again = store()
    assert again.num_blocks == 5 and again.contains(h(4))
    assert [again.get(h(i)) for i in range(5)] == [payload(i) for i in range(5)]
    assert again.get(h(9)) is None
    assert again.stats.hit_blocks == 5


def test_a_corrupt_block_is_a_miss_deleted_and_counted(store):
    s = store()
    s.put(h(1), payload(1))
    s.flush()
    path = s._path(h(1))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the payload
    path.write_bytes(bytes(data))
    assert s.get(h(1)) is None
    assert s.stats.checksum_failures == 1 and not path.exists() and not s.contains(h(1))


def test_a_block_of_another_model_is_never_read(store, tmp_path):
    ours = store()
    ours.put(h(1), payload(1))
    ours.flush()
    theirs = store(identity={**IDENTITY, "model": "other"})
    assert theirs.root != ours.root and not theirs.contains(h(1))
    # a file of ours placed where theirs would be: its header names our identity
    target = theirs._path(h(1))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(ours._path(h(1)).read_bytes())
    rescanned = store(identity={**IDENTITY, "model": "other"})
    assert rescanned.contains(h(1)) and rescanned.get(h(1)) is None
    assert rescanned.stats.checksum_failures == 1 and not target.exists()


def test_the_least_recently_used_blocks_go_for_room(store):
    size = file_bytes(64)
    s = store(capacity=3 * size)
    for i in range(3):
        s.put(h(i), payload(i))
    s.flush()
    assert s.get(h(0)) == payload(0)  # used again: 1 is now the oldest
    s.put(h(3), payload(3))
    s.flush()
    assert s.contains(h(0)) and not s.contains(h(1)) and s.contains(h(3))
    assert s.num_bytes <= 3 * size and s.stats.evicted_blocks == 1
    assert not s._path(h(1)).exists()


def test_each_tenants_blocks_are_counted_until_they_leave(store):
    size = file_bytes(64)
    s = store(capacity=3 * size)
    s.put(h(0), payload(0), "A")
    s.put(h(1), payload(1), "A")
    s.put(h(2), payload(2), "B")
    assert s.cached_by_tenant() == {"A": 2, "B": 1}  # (queued counts: it is held)
    s.flush()
    assert s.tenant(h(0)) == "A" and s.tenant(h(2)) == "B"
    s.put(h(3), payload(3))  # nobody's (a staff request's): not counted
    s.flush()  # room for it: h(0), the oldest, goes
    assert not s.contains(h(0)) and s.tenant(h(0)) is None
    assert s.cached_by_tenant() == {"A": 1, "B": 1}
    s.reset()
    assert s.cached_by_tenant() == {} and s.tenant(h(1)) is None


def test_a_write_cut_short_leaves_no_block(store, tmp_path):
    s = store()
    s.put(h(1), payload(1))
    s.close()
    torn = s._path(h(2)).with_suffix(".tmp")
    torn.parent.mkdir(parents=True, exist_ok=True)
    torn.write_bytes(b"half a block")
    again = store()
    assert not again.contains(h(2)) and not torn.exists() and again.contains(h(1))
    assert oct(os.stat(again.root).st_mode & 0o777) == "0o700"


def test_a_full_disk_stops_the_writes_says_so_once_and_they_resume(store, monkeypatch,
                                                                    caplog):
    """Writes failing with ENOSPC (a full disk): the blocks are not kept, counted, and
    the tier says so once with what to do (write_error, while it lasts); what it holds
    still serves, and writing goes on once there is room. (Fails if a failed write is
    counted as stored, stays queued, or is logged per block.)"""
    import errno
    from engine.kv.tiers import disk

    s = store()
    s.put(h(1), payload(1))
    s.flush()
    real = disk.write_new

    def no_space(folder, name, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk, "write_new", no_space)
    caplog.set_level("WARNING", logger="engine.kv.tiers.disk")
    for i in range(2, 6):
        assert s.put(h(i), payload(i))
    s.flush()
    assert s.stats.write_failures == 4 and s.stats.stored_blocks == 1
    assert s.write_error == os.strerror(errno.ENOSPC)
    assert [s.contains(h(i)) for i in range(1, 6)] == [True] + [False] * 4
    assert s.get(h(1)) == payload(1)  # what it holds still serves
    said = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(said) == 1 and "KVOPS_ENGINE_DISK_CACHE_BYTES" in said[0], said
    monkeypatch.setattr(disk, "write_new", real)  # room again
    assert s.put(h(2), payload(2))
    s.flush()
    assert s.write_error is None and s.contains(h(2)) and s.stats.stored_blocks == 2
    assert any("writing blocks again" in r.getMessage() for r in caplog.records)


# --- the disk tier in an engine (the simulated model: tokens depend on every K/V slot
# read, so a block read back wrong changes the output) ---------------------------------

from engine.block_hash import hash_blocks, root_hash  # noqa: E402
from engine.config import ConfigError  # noqa: E402

from tests.engine.sim import expected, greedy, run_all, sim_engine  # noqa: E402
from tests.support.wait import wait_until  # noqa: E402

BLOCK = 4


def prompt_of(seed: int, n: int = 32) -> list[int]:
    return [(seed * 131 + i * 7) % 997 + 1 for i in range(n)]


def disk_engine(folder, **kw):
    cfg = dict(block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=12, cpu_prefix_cache=True,
               max_num_batched_tokens=64, disk_cache_dir=str(folder))
    cfg.update(kw)
    return sim_engine(**cfg)


def ask(engine, rid, prompt, max_tokens=6):
    engine.add_request(rid, prompt, greedy(max_tokens))
    return run_all(engine)[rid]


def flood(engine, seeds=range(1, 9)) -> None:
    """Other prompts, until the first one's blocks are off the GPU and the CPU tier."""
    for seed in seeds:
        ask(engine, f"other{seed}", prompt_of(seed))


def disk_of(engine):
    """The engine's disk tier: the last of its KV core's chain."""
    disk = engine.kv.tiers[-1]
    assert disk.medium == "DISK"
    return disk


def on_gpu_or_cpu(engine, prompt) -> bool:
    hashes = hash_blocks(root_hash(engine.runner.model_id, None), prompt, BLOCK)
    return bool(engine.kv.cached_chain(hashes)) or bool(engine.kv.tiers[0].lookup(hashes))


def test_a_prefix_let_go_by_the_cpu_tier_comes_back_from_disk_and_after_a_restart(tmp_path):
    engine = disk_engine(tmp_path)
    first = prompt_of(0)
    ask(engine, "cold", first)
    again = ask(engine, "hit", first)  # asked for again: its blocks may go to disk
    assert again.num_cached_tokens == 31  # (all of it on the GPU: the last token recomputed)
    flood(engine)
    assert not on_gpu_or_cpu(engine, first)
    disk_of(engine).store.flush()
    m = engine.metrics()
    assert m["disk_cache_stored_blocks"] >= 7 and m["disk_cache_not_admitted"] > 0
    back = ask(engine, "back", first)
    assert back.num_cached_tokens == 28 and back.output_token_ids == expected(first, 6)
    m = engine.metrics()
    assert m["disk_prefix_cache_hits"] == 28 and m["disk_cache_read_blocks"] >= 7
    story = engine.kv_story("back")  # its KV story says where the blocks came from
    assert story["cached_tokens"] == {"gpu": 0, "cpu": 0, "disk": 28}
    assert story["sources"] == {"gpu": 0, "cpu": 0, "disk": 7}
    engine.kv.check_invariants()
    engine.close()  # writes under way finish
    # a new engine on the same folder: the first request hits
    restarted = disk_engine(tmp_path)
    assert restarted.metrics()["num_disk_cached_blocks"] >= 7
    restarted.add_request("warm", first, greedy(6))
    # its blocks are read ahead of its admission, on the reader thread
    wait_until(lambda: disk_of(restarted).store.num_read_ahead, "7 blocks read ahead", 30,
               until=lambda n: n >= 7, poll_s=0.001)
    warm = run_all(restarted)["warm"]
    assert warm.num_cached_tokens == 28 and warm.output_token_ids == expected(first, 6)
    m = restarted.metrics()
    assert m["disk_prefix_cache_hits"] == 28 and m["disk_cache_read_ahead_blocks"] >= 7
    restarted.kv.check_invariants()
    restarted.close()


def test_blocks_back_from_disk_through_the_cpu_tier_are_the_disks_hits_not_the_cpu_tiers(
        tmp_path):
    """Each tier counts its own hits: a prefix read back from disk reaches the GPU through
    the CPU tier, and counts in the disk's hits only, so that every reader (/metrics,
    the page, the alert rules, the what-if) takes the CPU tier's counter as it is."""
    engine = disk_engine(tmp_path)
    first = prompt_of(0)
    ask(engine, "cold", first)
    ask(engine, "hit", first)
    flood(engine)
    assert not on_gpu_or_cpu(engine, first)
    disk_of(engine).store.flush()
    before = engine.metrics()
    back = ask(engine, "back", first)
    assert back.num_cached_tokens == 28
    m = engine.metrics()
    grew = {k: m[k] - before[k] for k in ("prefix_cache_hits", "cpu_prefix_cache_hits",
                                          "disk_prefix_cache_hits")}
    assert grew == {"prefix_cache_hits": 28, "cpu_prefix_cache_hits": 0,
                    "disk_prefix_cache_hits": 28}
    # the blocks read back stay in the CPU tier: hit there again, they are its own hits
    # (and the rest of the prompt, let go by the CPU tier since, the disk's again)
    flood(engine, range(9, 11))
    hashes = hash_blocks(root_hash(engine.runner.model_id, None), first, BLOCK)
    held = len(engine.kv.tiers[0].lookup(hashes))
    assert not engine.kv.cached_chain(hashes) and held
    ask(engine, "again", first)
    m2 = engine.metrics()
    grew = {k: m2[k] - m[k] for k in grew}
    assert grew["cpu_prefix_cache_hits"] == held * BLOCK
    assert grew["prefix_cache_hits"] == grew["cpu_prefix_cache_hits"] + \
        grew["disk_prefix_cache_hits"]
    engine.kv.check_invariants()
    engine.close()


def test_one_off_prompts_are_not_written(tmp_path):
    engine = disk_engine(tmp_path)
    flood(engine, range(1, 12))  # each asked for once
    disk_of(engine).store.flush()
    m = engine.metrics()
    assert m["disk_cache_stored_blocks"] == 0 and m["disk_cache_not_admitted"] > 0
    engine.close()


def test_a_corrupt_block_and_another_models_blocks_are_misses(tmp_path):
    engine = disk_engine(tmp_path)
    first = prompt_of(0)
    ask(engine, "cold", first)
    ask(engine, "hit", first)
    flood(engine)
    engine.close()
    hashes = hash_blocks(root_hash(engine.runner.model_id, None), first, BLOCK)
    corrupt = disk_of(engine).store._path(hashes[3])
    assert corrupt.exists()
    data = bytearray(corrupt.read_bytes())
    data[-5] ^= 0x10
    corrupt.write_bytes(bytes(data))
    restarted = disk_engine(tmp_path)
    back = ask(restarted, "back", first)
    # the first three blocks came back; the fourth failed its checks: recomputed
    assert back.num_cached_tokens == 12 and back.output_token_ids == expected(first, 6)
    # (the reader thread, reading ahead, may be the one that finds it bad: a moment later)
    wait_until(lambda: restarted.metrics()["disk_cache_checksum_failures"],
               "the corrupt block found", 30, poll_s=0.001)
    assert restarted.metrics()["disk_cache_checksum_failures"] == 1 and not corrupt.exists()
    disk_of(restarted).report_removed()  # (said at the next admission; here, now)
    said = [e for e in restarted.take_events() if e.type == "BlockEvicted" and e.pool == "disk"]
    assert [(e.reason, len(e.block_hashes)) for e in said] == [("corrupt", 1)]
    restarted.close()
    # another model (another vocabulary: another model id) on the same folder finds none
    other = disk_engine(tmp_path, vocab_size=999)
    assert other.metrics()["num_disk_cached_blocks"] == 0
    assert ask(other, "x", first).num_cached_tokens == 0
    other.close()


def test_without_a_cpu_tier_the_disk_sits_below_the_gpu_and_outlives_a_restart(tmp_path):
    """No CPU tier: the GPU pool's cached blocks it reuses go to disk (written behind
    from GPU blocks) and come back straight into GPU blocks, as GPU hits counted as the
    disk's; a restarted engine finds them."""
    engine = disk_engine(tmp_path, cpu_prefix_cache=False, num_cpu_blocks=0)
    assert disk_of(engine).above is engine.kv.gpu
    first = prompt_of(0)
    ask(engine, "cold", first)
    ask(engine, "hit", first)  # asked for again: its blocks may go to disk
    flood(engine, range(1, 5))
    assert not engine.kv.cached_chain(hash_blocks(root_hash(engine.runner.model_id, None),
                                                  first, BLOCK))
    disk_of(engine).store.flush()
    assert engine.metrics()["disk_cache_stored_blocks"] >= 7
    stored = [e for e in engine.take_events() if e.type == "BlockStored" and e.pool == "disk"]
    assert stored and "from GPU blocks" in stored[0].detail
    back = ask(engine, "back", first)
    # every block back as a GPU hit: the last token is recomputed in a copy of the last
    assert back.num_cached_tokens == 31 and back.output_token_ids == expected(first, 6)
    m = engine.metrics()
    assert m["disk_prefix_cache_hits"] == 31 and m["cpu_prefix_cache_hits"] == 0
    assert m["disk_tier_below"] == "gpu"
    story = engine.kv_story("back")
    assert story["cached_tokens"] == {"gpu": 0, "cpu": 0, "disk": 31}
    assert story["sources"] == {"gpu": 0, "cpu": 0, "disk": 8}
    read_back = [e for e in engine.take_events() if e.type == "BlockStored" and e.pool == "gpu"
                 and "disk" in (e.detail or "")]
    assert read_back and len(read_back[0].block_ids) == 8
    engine.kv.check_invariants()
    engine.close()
    restarted = disk_engine(tmp_path, cpu_prefix_cache=False, num_cpu_blocks=0)
    warm = ask(restarted, "warm", first)
    assert warm.num_cached_tokens == 31 and warm.output_token_ids == expected(first, 6)
    restarted.kv.check_invariants()
    restarted.close()


def test_reading_back_from_disk_does_not_evict_the_run_it_continues(tmp_path):
    """The GPU still holds a prompt's first blocks, the disk its last two: the blocks
    taken for the disk's must not be the run's own (the oldest free ones), or the hit
    would shrink to what is left of it."""
    engine = disk_engine(tmp_path, cpu_prefix_cache=False, num_cpu_blocks=0)
    first = prompt_of(0)
    ask(engine, "cold", first)
    ask(engine, "hit", first)
    ask(engine, "other", prompt_of(1))  # 10 blocks: the 8 empty ones and first's last 2
    hashes = hash_blocks(root_hash(engine.runner.model_id, None), first, BLOCK)
    assert len(engine.kv.cached_chain(hashes)) == 6
    disk_of(engine).store.flush()
    assert [disk_of(engine).store.contains(h) for h in hashes[6:]] == [True, True]
    back = ask(engine, "back", first)
    assert back.num_cached_tokens == 31 and back.output_token_ids == expected(first, 6)
    assert engine.metrics()["disk_prefix_cache_hits"] == 7  # (the last token recomputed)
    engine.kv.check_invariants()
    engine.close()


def test_a_block_read_back_and_then_reset_is_not_the_disks_any_more(tmp_path):
    """GPU blocks read back from disk for a lookup that no request took, their hashes
    dropped by a reset and the blocks reused for another prompt: that prompt's later
    hits are GPU hits, not the disk's."""
    engine = disk_engine(tmp_path, cpu_prefix_cache=False, num_cpu_blocks=0)
    first = prompt_of(0)
    ask(engine, "cold", first)
    ask(engine, "hit", first)
    flood(engine, range(1, 5))
    disk_of(engine).store.flush()
    hashes = hash_blocks(root_hash(engine.runner.model_id, None), first, BLOCK)
    assert disk_of(engine).promote([], hashes) == 8  # read back, not taken
    engine.reset_prefix_cache()
    for i in range(3):  # prompts that take every free block, the read-back ones too
        other = prompt_of(20 + i)
        ask(engine, f"x{i}", other)
        again = ask(engine, f"x{i}-again", other)
        assert again.num_cached_tokens == 31
        assert engine.kv_story(f"x{i}-again")["cached_tokens"]["disk"] == 0
    assert engine.metrics()["disk_prefix_cache_hits"] == 0
    engine.close()


def test_reading_back_keeps_the_runs_eviction_order(tmp_path):
    """The run a read-back continues is held meanwhile and let go tail first, as a
    request's blocks are: its tail is still evicted before its head. Without a block to
    read, nothing is held and the free queue does not move."""
    engine = disk_engine(tmp_path, cpu_prefix_cache=False, num_cpu_blocks=0)
    first = prompt_of(0)
    ask(engine, "cold", first)
    hashes = hash_blocks(root_hash(engine.runner.model_id, None), first, BLOCK)
    run = engine.kv.cached_chain(hashes)[:5]
    ids = [b.block_id for b in run]
    order = lambda: [i for i in engine.kv.gpu.eviction_order(16) if i in ids]  # noqa: E731
    assert order() == ids[::-1]
    before = engine.kv.gpu.eviction_order(16)
    assert disk_of(engine).promote(run, [b"not on disk"]) == 0
    assert engine.kv.gpu.eviction_order(16) == before
    disk_of(engine).store.put(hashes[5], engine.runner.read_pool_block("gpu", run[0].block_id))
    disk_of(engine).promote(run, hashes[5:])
    assert order() == ids[::-1]
    engine.close()


def test_below_the_gpu_a_model_with_layer_groups_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="layer groups"):
        disk_engine(tmp_path, cpu_prefix_cache=False, num_cpu_blocks=0,
                    simulate_sliding_window=8, simulate_hybrid=True)


def test_a_core_stopped_by_sigterm_finishes_its_disk_writes_and_dies_by_it(tmp_path):
    """The engine core as a process (as a worker runs it, its secret on stdin), stopped
    by a process group's SIGTERM: it closes its engine first (the disk's writes finish),
    then dies of the signal; an engine started on the folder with the same secret finds
    the blocks."""
    import signal

    import zmq

    from benchmarks.migration import CoreProcess
    from engine import EngineConfig
    config = EngineConfig(simulate=True, simulate_tokenizer="bytes", vocab_size=1000,
                          block_size=BLOCK, num_gpu_blocks=16, num_cpu_blocks=12,
                          cpu_prefix_cache=True, max_num_batched_tokens=64,
                          disk_cache_dir=str(tmp_path / "disk"), name="core",
                          secret="a deployment's secret, 32 characters or more")
    ctx = zmq.Context()
    core = CoreProcess(config, ctx, str(tmp_path))
    try:
        first = prompt_of(0)
        params = {"max_tokens": 6, "temperature": 0.0}

        def ended(rid: str) -> bool:
            core.read()
            return rid in core.ended

        for i, prompt in enumerate([first, first] + [prompt_of(s) for s in range(1, 9)]):
            core.send(["adds", i + 1, [[f"r{i}", prompt, params, 0, None, None, None]]])
            wait_until(functools.partial(ended, f"r{i}"), f"r{i} to end", 30, poll_s=0.001)
        core.proc.send_signal(signal.SIGTERM)
        assert core.proc.wait(30) == -signal.SIGTERM
    finally:
        core.to_core.close(linger=0)
        core.from_core.close(linger=0)
        ctx.term()
    restarted = disk_engine(tmp_path / "disk", secret=config.secret)
    warm = ask(restarted, "warm", first)
    assert warm.num_cached_tokens == 28 and warm.output_token_ids == expected(first, 6)
    restarted.close()


@pytest.mark.parametrize("cpu_tier", [True, False], ids=["below-cpu", "below-gpu"])
@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        "not __import__('torch').cuda.is_available()", reason="needs a CUDA device")])])
def test_a_real_models_blocks_come_back_from_disk_as_they_were(tiny_model, tmp_path, device,
                                                                cpu_tier):
    """A tiny Llama with the disk tier below the CPU tier, or straight below the GPU
    pool: a prefix pushed off the GPU (and the CPU tier) comes back from disk (the
    pool's block bytes out and in), and after a restart; each answer is transformers'
    greedy one."""
    from engine import SamplingParams
    from tests.engine.test_model_parity import make_engine
    from tests.models.tiny import SPECS, hf_greedy, random_prompts

    folder = tiny_model("gqa16")
    vocab = SPECS["gqa16"].vocab_size
    first = random_prompts(vocab, [21], seed=8)[0]  # 5 full blocks of 4
    others = random_prompts(vocab, [22] * 8, seed=9)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def engine():
        return make_engine(folder, device=device, num_gpu_blocks=16,
                           num_cpu_blocks=10 if cpu_tier else 0, cpu_prefix_cache=cpu_tier,
                           disk_cache_dir=str(tmp_path / "disk"))

    e = engine()
    answers = [e.generate([p], params)[0] for p in [first, first, *others]]
    back = e.generate([first], params)[0]
    assert back.num_cached_tokens == 20 and e.metrics()["disk_prefix_cache_hits"] == 20
    assert e.metrics()["disk_tier_below"] == ("cpu" if cpu_tier else "gpu")
    e.close()
    again = engine()
    warm = again.generate([first], params)[0]
    assert warm.num_cached_tokens == 20
    again.close()
    expected_first = hf_greedy(folder, [first], 6)[0]
    assert back.output_token_ids == warm.output_token_ids == answers[0].output_token_ids \
        == expected_first
