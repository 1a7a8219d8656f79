"""What the disk tier promises against the machine's other users and against whoever can
write its files without the deployment's secret (docs/security.md, "The disk tier"): a
private folder or a refusal to start, no planted symlink or FIFO followed or waited on,
files that neither show the K/V nor can be forged, moved or brought back after a reset.

These run as root (the CI's containers do): permission checks would pass for root, so
they test the ownership and mode rules, not access."""
from __future__ import annotations

import os
import struct
import threading
import zlib

import pytest

from engine.block_hash import hash_blocks, root_hash
from engine.config import ConfigError, EngineConfig
from engine.serve.core_proc import core_command
from engine.kv.tiers.disk_seal import BlockSeal
from engine.kv.tiers.disk import DiskStore
from tests.engine.sim import expected
from tests.engine.test_disk_tier import BLOCK, ask, disk_engine, disk_of, flood, prompt_of

IDENTITY = {"model": "m", "kv_format": "float32", "block_size": 4, "block_bytes": 64}
SECRET = b"s" * 32
OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def h(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture
def store(tmp_path):
    made = []

    def make(folder=None, secret: bytes | None = SECRET) -> DiskStore:
        made.append(DiskStore(folder or tmp_path / "disk", 1 << 20, IDENTITY, secret))
        return made[-1]

    yield make
    for s in made:
        s.close()


# --- the folder ----------------------------------------------------------------------------
@needs_root
def test_a_folder_of_another_user_is_refused(store, tmp_path):
    folder = tmp_path / "disk"
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"belongs to uid {OTHER_UID}.*chown"):
        store(folder)


@needs_root
def test_a_parent_of_another_user_is_refused(store, tmp_path):
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"{parent}.*belongs to uid {OTHER_UID}"):
        store(parent / "disk")


@pytest.mark.parametrize("where", ["folder", "parent"])
def test_a_folder_or_parent_writable_by_others_is_refused(store, tmp_path, where):
    parent = tmp_path / "parent"
    parent.mkdir()
    folder = parent / "disk"
    folder.mkdir()
    os.chmod(parent, 0o777 if where == "parent" else 0o755)
    os.chmod(folder, 0o777 if where == "folder" else 0o700)
    fix = f"chmod 700 {folder}" if where == "folder" else f"chmod go-w {parent}"
    with pytest.raises(ConfigError, match=fix):
        store(folder)


def test_a_missing_folder_is_made_private_under_a_sticky_root_parent(store, tmp_path):
    """A root-owned sticky parent, as /tmp, is fine; the levels made are 0700, the files
    0600."""
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    if os.stat(sticky).st_uid != 0:
        pytest.skip("a sticky parent is accepted only when root owns it")
    s = store(sticky / "a" / "b", secret=None)
    s.put(h(1), b"x" * 64)
    s.flush()
    for level in (sticky / "a", sticky / "a" / "b", s.root, s._path(h(1)).parent):
        assert oct(os.stat(level).st_mode & 0o777) == "0o700", level
    for f in (s._path(h(1)), sticky / "a" / "b" / "disk.key"):
        assert oct(os.stat(f).st_mode & 0o777) == "0o600", f


# --- planted files -------------------------------------------------------------------------
def test_a_planted_symlink_is_not_written_through(store, tmp_path):
    """Links named as the engine's temporary file and as the block itself, pointing at a
    victim's file: the victim's bytes are unchanged, the block is written and read."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's own bytes")
    victim.chmod(0o600)
    s = store()
    path = s._path(h(1))
    path.parent.mkdir(mode=0o700)
    path.with_suffix(".tmp").symlink_to(victim)
    s.put(h(1), b"k" * 64)
    s.flush()
    assert victim.read_bytes() == b"the victim's own bytes"
    assert not path.is_symlink() and s.get(h(1)) == b"k" * 64
    s.close()
    path.unlink()
    path.symlink_to(victim)  # a block's name planted as a link: not indexed, not read
    again = store()
    assert not again.contains(h(1)) and victim.read_bytes() == b"the victim's own bytes"
    assert path.with_suffix(".tmp").is_symlink()  # (not the engine's to delete)


def _get_in_thread(s: DiskStore, block_hash: bytes) -> list:
    """s.get(block_hash) on a thread, joined with a long timeout only as a safety net
    against a hang: the read must return, whatever it finds."""
    result: list = []
    reader = threading.Thread(target=lambda: result.append(s.get(block_hash)), daemon=True)
    reader.start()
    reader.join(timeout=60)
    assert not reader.is_alive(), "the read hung on a FIFO"
    return result


def test_a_fifo_is_never_indexed_nor_waited_on(store):
    s = store()
    s.put(h(1), b"a" * 64)
    s.flush()
    s.close()
    beside = bytes([1]) + bytes([9]) * 31  # (in the same shard folder as h(1))
    os.mkfifo(s._path(beside))  # planted before a start: not a block
    again = store()
    assert again.contains(h(1)) and not again.contains(beside)
    real = again._path(h(1))  # planted after the index was made: a failed check
    real.unlink()
    os.mkfifo(real)
    assert _get_in_thread(again, h(1)) == [None]
    assert again.stats.checksum_failures == 1 and not again.contains(h(1))


# --- the files' bytes --------------------------------------------------------------------
def test_the_files_do_not_hold_the_kv_in_clear(store):
    secret_kv = b"PIN 4711 of a tenant " * 4  # (what a prompt's K/V would give away)
    s = store()
    s.put(h(1), secret_kv)
    s.flush()
    data = s._path(h(1)).read_bytes()
    assert not any(secret_kv[i:i + 8] in data for i in range(len(secret_kv) - 8))
    assert s.get(h(1)) == secret_kv  # (and it comes back)


def test_a_file_moved_to_another_hash_is_refused(store):
    """A valid file copied over another block's, its hash in the header rewritten: the
    engine must not serve the first block's K/V for the second."""
    s = store()
    s.put(h(1), b"A" * 64)
    s.put(h(2), b"B" * 64)
    s.flush()
    moved = s._path(h(1)).read_bytes().replace(h(1), h(2), 1)
    s._path(h(2)).write_bytes(moved)
    assert s.get(h(2)) is None and s.stats.checksum_failures == 1
    assert s.get(h(1)) == b"A" * 64


def test_a_file_sealed_under_another_key_is_refused(store):
    """Someone who knows the format but not the secret seals a block of their own for a
    hash: the file fails to open."""
    s = store()
    s.put(h(1), b"A" * 64)
    s.flush()
    forged = b"".join(BlockSeal(b"k" * 32, s.digest).seal(s.epoch, h(1), b"F" * 64))
    assert len(forged) == os.path.getsize(s._path(h(1)))
    s._path(h(1)).write_bytes(forged)
    assert s.get(h(1)) is None and s.stats.checksum_failures == 1


def test_blocks_of_another_secret_are_not_read_and_the_key_file_is_private(store, tmp_path):
    first = store()
    first.put(h(1), b"A" * 64)
    first.close()
    assert not store(secret=b"t" * 32).contains(h(1))
    assert store().get(h(1)) == b"A" * 64
    # no secret: a random key kept in the folder, 0600, used again at the next start
    keyed = store(tmp_path / "keyed", secret=None)
    keyed.put(h(2), b"C" * 64)
    keyed.close()
    assert store(tmp_path / "keyed", secret=None).get(h(2)) == b"C" * 64
    key = tmp_path / "keyed" / "disk.key"
    assert key.stat().st_size == 32 and oct(key.stat().st_mode & 0o777) == "0o600"


# --- in an engine (the simulated model: a block read back wrong changes the output) ---------
def _first_on_disk(folder):
    """An engine that asked for prompt 0 twice and then for others, until its blocks are
    on disk only; closed. The prompt and its block hashes."""
    engine = disk_engine(folder)
    first = prompt_of(0)
    ask(engine, "cold", first)
    ask(engine, "hit", first)
    flood(engine)
    hashes = hash_blocks(root_hash(engine.runner.model_id, None), first, BLOCK)
    paths = [disk_of(engine).store._path(x) for x in hashes]
    engine.close()
    return first, hashes, paths


def test_a_block_rewritten_with_a_correct_crc32_is_recomputed(tmp_path):
    """The audit's forgery: the file of the last block a prompt finds on disk (block 6,
    whose last slot the simulated model reads) replaced by other K/V under the header of
    the CRC-32 format, checksum right. The engine recomputes it: the answer is right."""
    first, hashes, paths = _first_on_disk(tmp_path)
    assert all(p.exists() for p in paths[:7])
    forged_kv = bytes(range(1, 1 + BLOCK * 8))  # (the simulator's block: 8 bytes a slot)
    digest = paths[6].read_bytes()[10:26]  # (the identity digest, at the same place)
    header = struct.pack("<8sH16sHQI", b"KVOPSBLK", 1, digest, 32, len(forged_kv),
                         zlib.crc32(forged_kv))
    paths[6].write_bytes(header + hashes[6] + forged_kv)
    restarted = disk_engine(tmp_path)
    back = ask(restarted, "back", first)
    assert back.output_token_ids == expected(first, 6)
    assert back.num_cached_tokens == 24  # blocks 0-5 from disk; 6 recomputed
    restarted.close()


def test_a_reset_then_a_restart_serves_no_block_from_before_it(tmp_path):
    engine = disk_engine(tmp_path)
    first = prompt_of(0)
    ask(engine, "cold", first)
    ask(engine, "hit", first)
    flood(engine)
    disk_of(engine).store.flush()
    assert engine.metrics()["num_disk_cached_blocks"] >= 7
    result = engine.reset_prefix_cache()
    assert result["num_disk_blocks_forgotten"] >= 7
    assert ask(engine, "after", first).num_cached_tokens == 0  # (not from disk either)
    engine.close()
    restarted = disk_engine(tmp_path)
    assert restarted.metrics()["num_disk_cached_blocks"] == 0
    warm = ask(restarted, "warm", first)
    assert warm.num_cached_tokens == 0 and warm.output_token_ids == expected(first, 6)
    # (the epoch before the reset is deleted behind: none of its files is left)
    assert [p.name for p in disk_of(restarted).store.root.iterdir()] == ["epoch-1"]
    restarted.close()


# --- the secret ----------------------------------------------------------------------------
def test_the_secret_is_never_shown_nor_put_on_a_command_line(tmp_path):
    secret = "0123456789abcdef" * 4
    config = EngineConfig(simulate=True, secret=secret)
    assert secret not in repr(config)
    argv, stdin = core_command(config, "ipc://in", "ipc://out")
    assert secret not in " ".join(argv) and stdin == secret.encode() + b"\n"
    with pytest.raises(ConfigError, match="secret"):
        EngineConfig(secret="short")
