"""Chained block hashes for the prefix cache.

hash(block i) = sha256(hash(block i-1) || token ids of block i), and block 0's parent is
a root hash of the extra keys (model identity, optional cache salt). A block's hash
therefore names the whole prefix up to its end, under one model and salt. sha256 is
stable across processes and machines (unlike Python's hash()), so engines can publish
hashes and a router can compare them.
"""
from __future__ import annotations

import hashlib
import struct

BlockHash = bytes  # 32-byte sha256 digest


def root_hash(model_id: str, cache_salt: str | None = None) -> BlockHash:
    """The parent of a request's first block: the extra keys, hashed."""
    h = hashlib.sha256(b"kvops-prefix-v1\0")
    h.update(model_id.encode())
    h.update(b"\0")
    if cache_salt is not None:
        h.update(b"salt\0" + cache_salt.encode())
    return h.digest()


def hash_block(parent: BlockHash, token_ids: list[int] | tuple[int, ...]) -> BlockHash:
    """Hash one full block given its parent's hash."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def hash_blocks(root: BlockHash, token_ids: list[int], block_size: int,
                start: int = 0, parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of token_ids from block index `start` on.

    `parent` is the hash of block start-1 (or `root` when start is 0).
    """
    prev = root if start == 0 else parent
    if prev is None:
        raise ValueError("hash_blocks: parent hash is required when start > 0")
    out = []
    for b in range(start, len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[b * block_size:(b + 1) * block_size])
        out.append(prev)
    return out


def short(h: BlockHash | None) -> str | None:
    """First 16 hex digits: enough to tell hashes apart in events and on the page."""
    return None if h is None else h[:8].hex()
