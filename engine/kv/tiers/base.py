"""A tier of the prefix cache below the GPU pool, as the KV coordinator drives it.

The coordinator (engine/kv/coordinator.py) holds a chain: the GPU pool, then the CPU
tier (engine/kv/tiers/cpu.py), then the disk tier (engine/kv/tiers/disk.py), either tier
optional. Each tier sits below a pool (`above`: the GPU pool, or for the disk under a CPU
tier the CPU pool), keeps copies of the cached blocks that pool is about to reuse,
findable by hash, and gives them back when a prompt's prefix continues past what the
levels above hold: copied in instead of recomputed (vLLM's KV offloading, SGLang's
HiCache, LMCache's local disk). The coordinator asks every tier the same questions:

* the pool above offers it the cached blocks a schedule reuses, before their data is
  overwritten (`offer`, that pool's on_evict hook); the tier keeps those it takes;
* at the end of the schedule `flush` returns the copies keeping them needs (GPU -> the
  tier's pool, run before anything writes those GPU blocks), and `copy_ahead` copies of
  cached GPU blocks next in line for reuse (they run beside a forward pass); then
  `mark_computed` or `forget_uncomputed` says whether the step ran;
* at admission its blocks come back in one of two ways, the one the tier is made for
  (the other finds nothing: `lookup` no block, `promote` 0):
  - copied in: `lookup` finds its blocks for the hashes after the GPU's run, and `load`
    gives the copies into the request's new GPU blocks (the CPU tier: a pool the runner
    copies from);
  - read back: `promote` reads its blocks into free cached blocks of the pool above,
    where that level's lookup then finds them (the disk: files the runner cannot read);
* each tier counts its own hits in prompt tokens (`hit_tokens`): the blocks a request
  loaded from it (`record_hit`, less those the tier below read back into it) and the
  blocks of the pool above it read back there (`count_read_back`). A disk hit is never
  a CPU hit, though it reaches the GPU through the CPU tier.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from engine.block_hash import BlockHash, short
from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.events import EventLog

# The tiers a chain may hold, top down, by their pool's name (reset_prefix_cache says how
# many blocks each forgot, 0 for one the engine has not)
TIER_POOLS = ("cpu", "disk")


class PrefixTier(ABC):
    """A level of the prefix cache below the GPU, as the coordinator uses it."""
    medium: str  # "CPU", "DISK": as events and the vLLM-format publisher name it
    where: str  # how a reset's event says where its blocks were ("on disk")

    def __init__(self, above: BlockPool) -> None:
        # the pool it sits below: it takes that pool's reused cached blocks (offer) and
        # reads its blocks back into it (promote); set once, here
        self.above = above
        # prompt tokens found here, not recomputed: this tier's own (a block a tier below
        # read back into it is that tier's hit, counted there)
        self.hit_tokens = 0

    @property
    def pool(self) -> str:
        """Its name where a block's place is said ("cpu", "disk")."""
        return self.medium.lower()

    # --- what it holds ---------------------------------------------------------------
    @property
    @abstractmethod
    def num_cached(self) -> int:
        """Blocks it holds now, findable by hash."""

    @abstractmethod
    def holds(self, block_hash: BlockHash) -> bool:
        """Whether it holds this hash now."""

    # --- what the pool above gives it ------------------------------------------------
    @abstractmethod
    def offer(self, evicted: list[tuple[int, BlockHash, str | None]]) -> None:
        """The pool above is reusing these cached (block id, hash, tenant), their data
        still in place: keep a copy of those the tier takes (and whose they are)."""

    def cached_by_tenant(self) -> dict[str, int]:
        """Blocks it holds per tenant whose request computed them (their tenant known)."""
        return {}

    def count_prompt(self, hashes: list[BlockHash]) -> None:  # noqa: B027 (a no-op unless a tier needs it)
        """A prompt was looked up for these hashes, hit or not (a tier that admits
        blocks by how often they are asked for counts them; others do nothing)."""

    # --- the step's copies -----------------------------------------------------------
    def flush(self) -> list[tuple[int, int]]:
        """End of a schedule: the (gpu, tier) copies of what offer kept, which run before
        anything writes those GPU blocks; releases what this step's loads read. None for
        a tier that moves its blocks itself."""
        return []

    def copy_ahead(self, horizon: int, max_blocks: int) -> list[tuple[int, int]]:
        """Copies (gpu, tier) of cached GPU blocks among the next `horizon` the free
        queue hands out, ahead of their reuse (at most max_blocks); call after flush,
        for a step that runs. None for a tier that moves its blocks itself."""
        return []

    def mark_computed(self) -> None:  # noqa: B027 (a no-op unless a tier needs it)
        """The step ran: the copies it made hold their data."""

    def forget_uncomputed(self) -> int:
        """The step failed: what its copies were to fill is dropped. Returns how many."""
        return 0

    def held(self) -> list[KVBlock]:
        """The CPU pool's blocks it holds a reference on until flush (the coordinator's
        invariants count them as holders)."""
        return []

    # --- giving blocks back ----------------------------------------------------------
    def read_ahead(self, hashes: list[BlockHash]) -> None:  # noqa: B027 (a no-op unless a tier needs it)
        """A request arrived whose blocks of these hashes no level above holds: a tier
        slow to read starts reading them now (others do nothing)."""

    @abstractmethod
    def lookup(self, hashes: list[BlockHash]) -> list[KVBlock]:
        """Its blocks for the leading run of these hashes that it holds (the run stops
        at the first it lacks), for load; none from a tier whose blocks are read back."""

    @abstractmethod
    def load(self, blocks: list[KVBlock], gpu_blocks: list[KVBlock]) -> list[tuple[int, int]]:
        """lookup's blocks into these new GPU blocks: the (tier, gpu) copies, which the
        step runs before its forward pass. The tier blocks stay until flush."""

    @abstractmethod
    def promote(self, run: list[KVBlock], hashes: list[BlockHash]) -> int:
        """Read the leading run of these hashes that it holds into blocks of the pool
        above, free and cached there; `run` (that pool's blocks these hashes continue)
        is held meanwhile, so that taking blocks does not evict it. How many of the
        hashes the pool above now holds; 0 from a tier whose blocks are copied in."""

    # --- hits ------------------------------------------------------------------------
    @abstractmethod
    def record_hit(self, request_id: str, blocks: list[KVBlock], block_size: int,
                   from_below: int = 0) -> None:
        """A request's prompt continued on these blocks of lookup's (said in an event);
        counted in hit_tokens but for `from_below` of them, which a tier below read back
        into this one (they are that tier's hits)."""

    @abstractmethod
    def read_back_among(self, blocks: list[KVBlock]) -> int:
        """How many of these blocks of the pool above it read back there (and still hold
        what it read)."""

    @abstractmethod
    def count_read_back(self, blocks: list[KVBlock], block_size: int, num_tokens: int) -> int:
        """A request's prompt continued on these blocks of the pool above, which served
        num_tokens: those it read back there count as its hits, in tokens (the run's last
        ones: fewer when the last block's last token is recomputed). How many blocks."""

    # --- the operator, /metrics, the end ---------------------------------------------
    @abstractmethod
    def reset(self) -> int:
        """A prefix-cache reset: no block it holds is served again. How many it held."""

    @abstractmethod
    def metrics(self, block_bytes: int) -> dict:
        """Its counters, by the names /metrics publishes them (block_bytes: one block's
        K/V, every layer)."""

    def close(self) -> None:  # noqa: B027 (a no-op unless a tier needs it)
        """The engine is closing: finish what is under way."""


def emit_stored(events: EventLog, pool: str, blocks: list[KVBlock], detail: str) -> None:
    """BlockStored for a tier's blocks registered in a pool (copies, read-backs): one
    event per tenant among them (KVEvent.tenant: whose the blocks are), in their order."""
    runs: dict[str | None, list[KVBlock]] = {}
    for block in blocks:
        runs.setdefault(block.tenant, []).append(block)
    for tenant, run in runs.items():
        events.emit("BlockStored", pool=pool, tenant=tenant, block_ids=[b.block_id for b in run],
                    block_hashes=[short(b.block_hash) for b in run], ref_cnts=[0] * len(run),
                    detail=detail, hashes=[b.block_hash for b in run] if events.full else None)
