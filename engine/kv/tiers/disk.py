"""The prefix cache's third level: blocks on a local disk, kept across restarts.

Below the CPU tier (engine/kv/tiers/cpu.py), as vLLM's file offloading, SGLang HiCache's
storage layer and LMCache's local disk backend sit below host memory; or, on an engine
without a CPU tier, straight below the GPU pool ("the pool above" in what follows):

* A cached block that the pool above is about to reuse is written behind, by a thread
  of its own (the step loop only copies the block's bytes out), if more than one prompt
  has asked for its hash (`min_hits` more than the first, hit or not): admission by
  reuse, as vLLM's offloading reuse manager counts lookups, so that one-off prompts do
  not churn the disk, while a conversation whose history came back once is kept.
* A prompt whose prefix goes on past what the pools hold finds the rest here: read back
  into blocks of the pool above (`promote`), cached there, it reaches the request
  through that pool (copied from the CPU tier into its GPU blocks, or a GPU hit) and
  counts as the disk's hit, not that pool's.
* LRU within a byte budget; a block read back counts as used.

DiskStore keeps the files; DiskTier is the store as a tier of the prefix cache
(PrefixTier: engine/kv/tiers/base.py).

A file holds one block, sealed with AES-GCM under a key from the deployment's secret
(engine/kv/tiers/disk_seal.py: the K/V encrypted, the file authenticated along with the engine's
identity, the block's hash and the epoch), in a folder only the engine's user may write
(engine/kv/tiers/disk_files.py). A file that fails to open, or is not a regular file of its
expected size, is a miss: deleted and counted, never wrong K/V. Files live under
`<directory>/<identity digest>-<key id>/epoch-<n>/<hash[:2]>/<hash>.blk`, written under a
temporary name and renamed, so that a crash leaves no half block under a hash's name. A
prefix-cache reset starts the next epoch: the blocks written before it are never read
again, and their folder is deleted behind. An engine started with the same model, key
and directory indexes what the newest epoch holds (oldest first), so the first requests
after a restart hit; `close()` finishes the writes under way.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import stat
import threading
from collections.abc import Callable, Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

from engine.block_hash import BlockHash, short
from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.tiers.base import PrefixTier, emit_stored
from engine.kv.tiers.disk_files import NotARegularFile, key_file_secret, make_private, \
    make_private_subfolder, own_regular_file, read_regular, write_new
from engine.kv.tiers.disk_seal import BlockSeal, disk_key, file_bytes, key_id
from engine.kv.events import EventLog

log = logging.getLogger(__name__)

# Bytes of blocks waiting to be written; past it, the blocks the CPU tier lets go are not
# kept (the step loop never waits for the disk)
PENDING_MAX_BYTES = 256 * 2**20
READY_MAX_BYTES = 64 * 2**20  # bytes read ahead and not taken yet
ASKED_KEPT = 200_000  # hashes whose counts admission remembers (about 100 bytes each)
_EPOCH = re.compile(r"epoch-(\d{1,18})")
_BLOCK = re.compile(r"([0-9a-f]{2})[0-9a-f]*\.blk")


def identity_digest(identity: dict) -> bytes:
    """16 bytes naming what a block's bytes mean: model, K/V format, block size, bytes."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()[:16]


@dataclass(slots=True)
class DiskStats:
    stored_blocks: int = 0  # files written
    stored_bytes: int = 0
    hit_blocks: int = 0  # blocks read back (into the pool above)
    read_bytes: int = 0
    # files that failed their checks: not a regular file of their size, another model's,
    # or not opened by the key (forged, altered, renamed); deleted
    checksum_failures: int = 0
    not_admitted: int = 0  # evicted blocks not written: asked for by one prompt (min_hits)
    dropped: int = 0  # evicted blocks not written: PENDING_MAX_BYTES were waiting already
    evicted_blocks: int = 0  # files deleted for room (LRU)
    # blocks whose write failed (a full disk, an I/O error): not kept; the files written
    # before stay and serve
    write_failures: int = 0
    read_ahead_blocks: int = 0  # of the blocks read back, those read ahead of their need


class DiskStore:
    """Blocks as files under a byte budget, written by a thread of its own. `secret`: the
    deployment's (EngineConfig.secret); None: the folder's key file (disk_files.py)."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, identity: dict,
                 secret: bytes | None = None,
                 pending_max_bytes: int = PENDING_MAX_BYTES) -> None:
        self.identity = dict(identity)
        self.digest = identity_digest(identity)
        folder = make_private(Path(directory))
        key = disk_key(secret if secret is not None else key_file_secret(folder))
        self._seal = BlockSeal(key, self.digest)
        # blocks of another key (another deployment's secret) are in another folder
        self.root = folder / f"{self.digest.hex()}-{key_id(key).hex()}"
        make_private_subfolder(self.root)
        self.capacity_bytes = capacity_bytes
        self.stats = DiskStats()
        self._lock = threading.Lock()
        # the newest epoch's folder holds the blocks (reset starts another); under _lock
        self.epoch = self._newest_epoch()
        self._index: collections.OrderedDict[BlockHash, int] = collections.OrderedDict()
        self._bytes = 0  # of the indexed files, under _lock
        self._pending: dict[BlockHash, bytes] = {}  # queued, not written yet; under _lock
        self._pending_bytes = 0  # under _lock
        # whose request computed each block written this run (a block found on disk at
        # start is nobody's: its tenant is not stored), and the count per tenant; under _lock
        self._tenant_of: dict[BlockHash, str] = {}
        self._per_tenant: collections.Counter = collections.Counter()
        self.pending_max_bytes = pending_max_bytes
        # (epoch, hash, payload) to write, a Path (an old epoch's folder) to delete, or None
        self._queue: queue.Queue = queue.Queue()
        # blocks that left the disk (LRU, or a failed check), not said yet: (hash, reason)
        self._gone: list[tuple[BlockHash, str]] = []
        # read ahead of a request's admission (read_ahead): payloads waiting to be taken
        self._ready: collections.OrderedDict[BlockHash, bytes] = collections.OrderedDict()
        self._ready_bytes = 0  # under _lock
        self._reads: queue.Queue = queue.Queue()
        # the last write's error while writes fail (None once one succeeds); the writer's
        self.write_error: str | None = None
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kvops-disk-tier",
                                        daemon=True)
        self._writer.start()
        self._reader = threading.Thread(target=self._read_loop, name="kvops-disk-reads",
                                        daemon=True)
        self._reader.start()

    # --- what the tier asks ------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._index) + len(self._pending)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    @property
    def num_read_ahead(self) -> int:
        """Blocks read ahead (read_ahead) and held in memory until get() takes them."""
        return len(self._ready)

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def can_take(self, block_hash: BlockHash) -> bool:
        """Whether put() would queue this block: asked before its bytes are copied out."""
        with self._lock:
            return not self._refuses(block_hash, 0)

    def put(self, block_hash: BlockHash, payload: bytes, tenant: str | None = None) -> bool:
        """Queue a block to be written (its payload copied out already; tenant: whose
        request computed it); False when it is there already or the queue is full."""
        with self._lock:
            if self._refuses(block_hash, len(payload)):
                return False
            self._pending[block_hash] = payload
            self._pending_bytes += len(payload)
            self._queue.put((self.epoch, block_hash, payload))
            if tenant is not None:
                self._tenant_of[block_hash] = tenant
                self._per_tenant[tenant] += 1
        return True

    def tenant(self, block_hash: BlockHash) -> str | None:
        """The tenant whose request computed this block, if it was written this run."""
        with self._lock:
            return self._tenant_of.get(block_hash)

    def cached_by_tenant(self) -> dict[str, int]:
        """Blocks held or queued per tenant (those written this run)."""
        with self._lock:
            return dict(self._per_tenant)

    def _disown(self, block_hash: BlockHash) -> None:
        """(Under _lock.) A block left the disk or its queue: no tenant's any more."""
        tenant = self._tenant_of.pop(block_hash, None)
        if tenant is not None:
            self._per_tenant[tenant] -= 1
            if not self._per_tenant[tenant]:
                del self._per_tenant[tenant]

    def _refuses(self, block_hash: BlockHash, size: int) -> bool:
        """(Under _lock.) The block is held or queued already, or `size` more bytes do
        not fit the queue (a drop, counted)."""
        if block_hash in self._index or block_hash in self._pending:
            return True
        if self._pending_bytes + size > self.pending_max_bytes:
            self.stats.dropped += 1
            return True
        return False

    def reset(self) -> int:
        """A prefix-cache reset: the next epoch, its folder made first (so that a restart
        finds it the newest); every block held or queued is dropped, never read again,
        and the previous epoch's folder is deleted by the writer. How many blocks."""
        with self._lock:
            n = len(self._index) + len(self._pending)
            old = self._epoch_dir(self.epoch)
            make_private_subfolder(self._epoch_dir(self.epoch + 1))
            self.epoch += 1
            self._index.clear()
            self._bytes = 0
            self._pending.clear()
            self._pending_bytes = 0
            self._tenant_of.clear()
            self._per_tenant.clear()
            self._ready.clear()
            self._ready_bytes = 0
            self._queue.put(old)
        return n

    def read_ahead(self, hashes: list[BlockHash]) -> int:
        """Read these blocks (those held here, in order) on the reader thread, so that
        get() finds them in memory; how many were asked for."""
        with self._lock:
            wanted = [h for h in hashes if h in self._index and h not in self._ready]
        if wanted:
            self._reads.put(wanted)
        return len(wanted)

    def take_gone(self) -> list[tuple[BlockHash, str]]:
        """The blocks that left the disk since the last call: (hash, reason)."""
        with self._lock:
            gone, self._gone = self._gone, []
        return gone

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The block's payload, or None (not here, or its file failed its checks: then
        it is deleted and counted). A block read counts as used (LRU)."""
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is not None:
                return pending
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
            ready = self._ready.pop(block_hash, None)
            if ready is not None:
                self._ready_bytes -= len(ready)
                self.stats.hit_blocks += 1
                self.stats.read_bytes += len(ready)
                self.stats.read_ahead_blocks += 1
                return ready
        payload = self._read(block_hash)
        if payload is not None:
            self.stats.hit_blocks += 1
            self.stats.read_bytes += len(payload)
        return payload

    def _read(self, block_hash: BlockHash) -> bytes | None:
        """A block's file read and opened (a bad one deleted and counted)."""
        with self._lock:
            size, epoch = self._index.get(block_hash), self.epoch
        if size is None:
            return None
        try:
            data = read_regular(self._path(block_hash, epoch), size)
        except NotARegularFile:
            data = None
        except OSError:  # (gone: deleted for room meanwhile, or by hand)
            self._forget(block_hash, epoch)
            return None
        payload = None if data is None else self._seal.open(epoch, block_hash, data)
        if payload is None:
            if self._forget(block_hash, epoch, delete=True):  # (once, if two threads read it)
                self.stats.checksum_failures += 1
                log.warning("disk tier: block %s failed its checks; deleted", short(block_hash))
                with self._lock:
                    self._gone.append((block_hash, "corrupt"))
            return None
        return payload

    def _read_loop(self) -> None:
        while True:
            hashes = self._reads.get()
            if hashes is None:
                return
            for block_hash in hashes:
                with self._lock:
                    if block_hash in self._ready or block_hash not in self._index or \
                            self._ready_bytes >= READY_MAX_BYTES:
                        continue
                try:
                    payload = self._read(block_hash)
                except Exception:  # noqa: BLE001  (read again when asked)
                    log.exception("disk tier: a read ahead failed")
                    payload = None
                if payload is None:
                    break  # (the run stops at the first block missing)
                with self._lock:
                    if block_hash in self._index and block_hash not in self._ready:
                        self._ready[block_hash] = payload
                        self._ready_bytes += len(payload)

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def close(self) -> None:
        """Finish the writes under way, then stop the writer and the reader."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        if self._reader.is_alive():
            self._reads.put(None)
            self._reader.join()

    # --- files ---------------------------------------------------------------------------
    def _epoch_dir(self, epoch: int) -> Path:
        return self.root / f"epoch-{epoch}"

    def _path(self, block_hash: BlockHash, epoch: int | None = None) -> Path:
        name = block_hash.hex()
        return self._epoch_dir(self.epoch if epoch is None else epoch) / name[:2] / f"{name}.blk"

    def _newest_epoch(self) -> int:
        """The newest epoch's number, its folder made if there is none; older epochs'
        folders (a reset's, whose deletion a stop cut short) are deleted."""
        epochs = sorted(int(m.group(1)) for entry in os.scandir(self.root)
                        if (m := _EPOCH.fullmatch(entry.name))
                        and entry.is_dir(follow_symlinks=False))
        newest = epochs[-1] if epochs else 0
        make_private_subfolder(self._epoch_dir(newest))
        for old in epochs[:-1]:
            _delete_folder(self._epoch_dir(old))
        return newest

    def _scan(self) -> None:
        """Index the block files a previous run left in the epoch's folder (oldest
        first): regular files named for a hash, nothing else (a symlink, a FIFO, another
        name is not the engine's); a temporary file of its own left by a crash goes."""
        found = []
        with os.scandir(self._epoch_dir(self.epoch)) as shards:
            for shard in shards:
                if len(shard.name) == 2 and shard.is_dir(follow_symlinks=False):
                    found += self._scan_shard(Path(shard.path))
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self._bytes += size
        self._evict_for(0)
        if found:
            log.info("disk tier: %d blocks (%d MiB) found in %s", len(self._index),
                     self._bytes >> 20, self.root)

    @staticmethod
    def _scan_shard(shard: Path) -> list[tuple[float, BlockHash, int]]:
        found = []
        with os.scandir(shard) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if entry.name.endswith(".tmp"):  # (a write a crash cut short)
                    if own_regular_file(st):
                        os.unlink(entry.path)
                    continue
                m = _BLOCK.fullmatch(entry.name)
                if m is None or m.group(1) != shard.name or not stat.S_ISREG(st.st_mode) \
                        or len(entry.name) % 2:
                    continue
                found.append((st.st_mtime, bytes.fromhex(entry.name[:-4]), st.st_size))
        return found

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if isinstance(item, Path):  # (an epoch before a reset)
                    _delete_folder(item)
                else:
                    self._write(*item)
                    self._wrote()
            except OSError as e:  # (a full disk, an I/O error: that block is not kept)
                self._write_failed(item, e)
            except Exception:  # noqa: BLE001  (the writer must go on)
                log.exception("disk tier: a write failed")
                self._write_failed(item, None)
            finally:
                self._queue.task_done()

    def _write_failed(self, item: object, error: OSError | None) -> None:
        """A block's write failed: counted, its place in the queue given back; the first
        failure of a run is logged with what to do (not every block's: a full disk fails
        them all)."""
        if isinstance(item, Path):
            return
        _, block_hash, payload = item
        with self._lock:
            if item[0] == self.epoch and self._pending.pop(block_hash, None) is not None:
                self._pending_bytes -= len(payload)
                self._disown(block_hash)
            self.stats.write_failures += 1
        reason = "an error" if error is None else (error.strerror or str(error))
        if self.write_error is None:
            log.warning("disk tier: cannot write blocks under %s (%s): it stores no new "
                        "blocks until a write succeeds, and serves those it holds; the "
                        "engine serves on, computing what it would have read back. Free "
                        "space there, or set KVOPS_ENGINE_DISK_CACHE_BYTES below the space "
                        "the disk has", self.root, reason)
        self.write_error = reason

    def _wrote(self) -> None:
        if self.write_error is not None:
            log.warning("disk tier: writing blocks again under %s (%d writes failed since "
                        "the engine started)", self.root, self.stats.write_failures)
            self.write_error = None

    def _write(self, epoch: int, block_hash: BlockHash, payload: bytes) -> None:
        size = file_bytes(len(payload), len(block_hash))
        with self._lock:
            if epoch != self.epoch:  # (queued before a reset: not the cache's any more)
                return
            self._evict_for(size)
        path = self._path(block_hash, epoch)
        make_private_subfolder(path.parent)
        write_new(path.parent, path.name, self._seal.seal(epoch, block_hash, payload))
        with self._lock:
            if epoch != self.epoch:  # (a reset meanwhile: its folder goes after this)
                return
            if self._pending.pop(block_hash, None) is not None:
                self._pending_bytes -= len(payload)
            self._index[block_hash] = size
            self._bytes += size
            self.stats.stored_blocks += 1
            self.stats.stored_bytes += len(payload)

    def _evict_for(self, size: int) -> None:
        """Delete the least recently used files until `size` more bytes fit (under
        _lock, or before the writer starts)."""
        while self._index and self._bytes + size > self.capacity_bytes:
            block_hash, old = self._index.popitem(last=False)
            self._bytes -= old
            self._disown(block_hash)
            self.stats.evicted_blocks += 1
            self._gone.append((block_hash, "evicted"))
            ready = self._ready.pop(block_hash, None)
            if ready is not None:
                self._ready_bytes -= len(ready)
            self._path(block_hash).unlink(missing_ok=True)

    def _forget(self, block_hash: BlockHash, epoch: int, delete: bool = False) -> bool:
        """Drop a block of this epoch from the index (and its file); whether it was
        there."""
        with self._lock:
            if epoch != self.epoch:  # (a reset dropped it already)
                return False
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._bytes -= size
                self._disown(block_hash)
            ready = self._ready.pop(block_hash, None)
            if ready is not None:
                self._ready_bytes -= len(ready)
        if delete and size is not None:
            self._path(block_hash, epoch).unlink(missing_ok=True)
        return size is not None


def _delete_folder(folder: Path) -> None:
    """Delete a folder of the tier's (symlinks inside are removed, never followed)."""
    shutil.rmtree(folder, onerror=lambda *a: log.warning("disk tier: could not delete %s", a[1]))


class DiskTier(PrefixTier):
    """The disk below the pool above it (the CPU tier's; the GPU pool of an engine
    without one): offered the cached blocks that pool reuses (`offer`, the pool's
    on_evict), it writes behind those that prompts asked for often enough (`count_prompt`
    counts them); it reads a prompt's next blocks back into that pool, cached there
    (`promote`), and starts reading a request's blocks when it arrives (`read_ahead`).
    `read_block` and `write_block` move a block's bytes in and out of the pool above (the
    runner's); `unwritten`: that pool's blocks whose data the coming step writes (the GPU
    pool's, below it: their bytes are not the block's yet, never written to disk)."""
    medium = "DISK"
    where = "on disk"

    def __init__(self, store: DiskStore, above: BlockPool, events: EventLog,
                 read_block: Callable[[int], bytes], write_block: Callable[[int, bytes], None],
                 min_hits: int = 1, unwritten: AbstractSet[int] = frozenset()) -> None:
        super().__init__(above)
        self.store = store
        self._events = events
        self._read_block, self._write_block = read_block, write_block
        self.min_hits = min_hits
        self._unwritten = unwritten  # (read, never changed here: its owner clears it)
        # per hash, how many prompts asked for it (the newest ASKED_KEPT hashes)
        self._asked: collections.OrderedDict[BlockHash, int] = collections.OrderedDict()
        # blocks above read back, not taken by a request yet: block id -> the hash read
        # into it (a block whose hash was dropped and replaced since is not the disk's)
        self._read_back: dict[int, BlockHash] = {}

    @property
    def num_cached(self) -> int:
        return self.store.num_blocks

    def holds(self, block_hash: BlockHash) -> bool:
        return self.store.contains(block_hash)

    def count_prompt(self, hashes: list[BlockHash]) -> None:
        """A prompt asked for these blocks (whether they hit or not): a block asked for
        by more than one prompt is one that comes back, and may go to disk when the pool
        above lets it go. (The blocks that left the disk since are said first.)"""
        self.report_removed()
        asked = self._asked
        for block_hash in hashes:
            asked[block_hash] = asked.get(block_hash, 0) + 1
            asked.move_to_end(block_hash)
        while len(asked) > ASKED_KEPT:
            asked.popitem(last=False)

    def admits(self, block_hash: BlockHash) -> bool:
        """Whether a block goes to disk: prompts asked for it min_hits times beyond the
        first one."""
        return self._asked.get(block_hash, 0) > self.min_hits

    def report_removed(self) -> None:
        """Say the blocks that left the disk since the last call (BlockEvicted on the
        disk pool, one event per reason)."""
        gone = self.store.take_gone()
        for reason in sorted({r for _, r in gone}):
            hashes = [h for h, r in gone if r == reason]
            self._events.emit("BlockEvicted", pool="disk", reason=reason,
                              detail="disk tier: " + ("least recently used, for room"
                                                      if reason == "evicted" else
                                                      "failed its checks (a file this "
                                                      "engine's key does not open, or not "
                                                      "a regular file); deleted"),
                              block_ids=[], block_hashes=[short(h) for h in hashes],
                              ref_cnts=[], hashes=hashes if self._events.full else None)

    def reset(self) -> int:
        """A prefix-cache reset: the disk's blocks are never served again (the store's
        next epoch), and what prompts asked for is forgotten; how many blocks."""
        self._asked.clear()
        return self.store.reset()

    def offer(self, evicted: list[tuple[int, BlockHash, str | None]]) -> None:
        """The pool above is reusing these cached blocks (their bytes still in place): the
        ones asked for often enough are copied out and written behind."""
        stored = []
        for block_id, block_hash, tenant in evicted:
            self._read_back.pop(block_id, None)
            if block_id in self._unwritten:
                continue
            if not self.admits(block_hash):
                self.store.stats.not_admitted += 1
                continue
            if self.store.can_take(block_hash) and \
                    self.store.put(block_hash, self._read_block(block_id), tenant):
                stored.append(block_hash)
        if stored:
            self._events.emit("BlockStored", pool="disk", block_ids=[],
                              block_hashes=[short(h) for h in stored], ref_cnts=[],
                              detail=f"disk tier: written behind from {self.above.pool.upper()} blocks "
                                     "about to be reused", hashes=stored if self._events.full else None)

    def read_ahead(self, hashes: list[BlockHash]) -> None:
        """Read those of these blocks the disk holds on the store's reader thread, so
        that their promotion finds them in memory."""
        self.store.read_ahead(hashes)

    def lookup(self, hashes: list[BlockHash]) -> list[KVBlock]:
        return []  # (its blocks are read back into the pool above: promote)

    def load(self, blocks: list[KVBlock], gpu_blocks: list[KVBlock]) -> list[tuple[int, int]]:
        if blocks:
            raise RuntimeError("invariant: the disk tier loads no block into GPU blocks "
                               "(its lookup finds none: its blocks are read back)")
        return []

    def promote(self, run: list[KVBlock], hashes: list[BlockHash]) -> int:
        if not hashes or not self.store.contains(hashes[0]):
            return 0  # (the usual case: nothing to read, nothing to hold)
        above = self.above
        above.touch(run, hit=False)
        try:
            return self._read_back_run(hashes)
        finally:
            above.free(reversed(run))  # (tail first, as a request's blocks are freed)

    def _read_back_run(self, hashes: list[BlockHash]) -> int:
        """Read the leading run of these hashes that the disk holds into blocks of the pool
        above (free and cached there, as if it had kept them); how many."""
        above, n = self.above, 0
        promoted: list[KVBlock] = []
        # the run's blocks already cached above are held while blocks are taken for the
        # others, so that taking them does not evict the run itself
        held: list[KVBlock] = []
        try:
            for block_hash in hashes:
                cached = above.get_cached(block_hash)
                if cached is not None:
                    above.touch([cached], hit=False)
                    held.append(cached)
                    n += 1
                    continue
                if not above.num_free or not self.store.contains(block_hash):
                    break
                payload = self.store.get(block_hash)
                if payload is None:
                    break
                block = above.take_new(1)[0]
                try:
                    self._write_block(block.block_id, payload)
                except Exception:
                    above.free([block])
                    raise
                above.cache(block, block_hash, self.store.tenant(block_hash))
                held.append(block)
                promoted.append(block)
                n += 1
        finally:
            # tail first, as a request's blocks are freed: its tail is evicted first
            above.free(reversed(held))
        if promoted:
            self._read_back.update((b.block_id, b.block_hash) for b in promoted)
            emit_stored(self._events, above.pool, promoted,
                        f"{above.pool.upper()}: read back from the disk tier")
        return n

    def record_hit(self, request_id: str, blocks: list[KVBlock], block_size: int,
                   from_below: int = 0) -> None:
        if blocks:
            raise RuntimeError("invariant: no request loads blocks from the disk tier "
                               "(its hits are counted by count_read_back)")

    def read_back_among(self, blocks: list[KVBlock]) -> int:
        read_back = self._read_back
        return sum(1 for b in blocks if read_back.get(b.block_id, b"") == b.block_hash)

    def count_read_back(self, blocks: list[KVBlock], block_size: int, num_tokens: int) -> int:
        n = self.read_back_among(blocks)
        if n:
            for b in blocks:
                self._read_back.pop(b.block_id, None)
            self.hit_tokens += min(n * block_size, num_tokens - (len(blocks) - n) * block_size)
        return n

    def metrics(self, block_bytes: int) -> dict:
        """Prompt tokens served from it (its own hits: never in cpu_prefix_cache_hits,
        though below the CPU tier they reach the GPU through it), the pool it sits below,
        blocks and bytes each way, failed checks."""
        st = self.store.stats
        return {"disk_prefix_cache_hits": self.hit_tokens,
                "disk_tier_below": self.above.pool,
                "num_disk_cached_blocks": self.store.num_blocks,
                "disk_cache_bytes_used": self.store.num_bytes,
                "disk_cache_stored_blocks": st.stored_blocks,
                "disk_cache_write_bytes": st.stored_bytes,
                "disk_cache_read_blocks": st.hit_blocks,
                "disk_cache_read_bytes": st.read_bytes,
                "disk_cache_read_ahead_blocks": st.read_ahead_blocks,
                "disk_cache_checksum_failures": st.checksum_failures,
                "disk_cache_not_admitted": st.not_admitted,
                "disk_cache_dropped": st.dropped,
                "disk_cache_evicted_blocks": st.evicted_blocks,
                "disk_cache_write_failures": st.write_failures,
                # why writes fail now (None while they succeed): the engine page warns
                "disk_cache_write_error": self.store.write_error}

    def cached_by_tenant(self) -> dict[str, int]:
        return self.store.cached_by_tenant()

    def write_cached(self) -> int:
        """Queue the pool above's cached blocks that admission would take (the engine is
        closing: what that pool holds is otherwise lost with it); how many."""
        n = 0
        for block_hash, block in list(self.above.cached.items()):
            if block.block_id not in self._unwritten and self.admits(block_hash) and \
                    self.store.can_take(block_hash) and \
                    self.store.put(block_hash, self._read_block(block.block_id),
                                   block.tenant):
                n += 1
        return n

    def close(self) -> None:
        """Write what the pool above holds, finish every write, stop the writer."""
        try:
            self.write_cached()
        finally:
            self.store.close()
