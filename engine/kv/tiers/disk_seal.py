"""A disk tier block's file format: its K/V sealed with AES-GCM (engine/kv/tiers/disk.py).

    header: magic, version, identity digest (16), epoch, nonce (12), hash length,
            sealed length (the payload's plus GCM's 16-byte tag)
    the block's hash
    the payload, encrypted, and GCM's tag

AES-256-GCM gives both what the tier needs of a file someone else may have written:
confidentiality (the bytes on disk do not decode to a tenant's prompt without the key)
and authenticity (a file that was not sealed with the key, for this identity, epoch and
hash, fails to open; a CRC-32 stops no writer, who recomputes it). A MAC beside it (an
HMAC-SHA256 of the file) would add nothing: GCM's tag is one.

The associated data is the header and the hash, so that a valid file renamed to another
hash, carried to another model's folder, or left from before a prefix-cache reset (an
older epoch) fails. Each file has a random 96-bit nonce under a key of its own, derived
from the disk key, the identity, the epoch and the hash: random nonces are safe for about
2^32 seals under one key (NIST SP 800-38D), a bound a long-lived deployment's disk could
reach, while one (epoch, hash) is sealed again only when the block is written anew.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from engine.block_hash import BlockHash
from engine.keys import derive

MAGIC = b"KVOPSBLK"
VERSION = 2  # (1: plain K/V and a CRC-32)
# magic, version, identity digest (16), epoch, nonce (12), hash length, sealed length
HEADER = struct.Struct("<8sH16sQ12sHQ")
NONCE_BYTES = 12
TAG_BYTES = 16


def disk_key(secret: bytes) -> bytes:
    """The disk tier's AES-256 key, from the engine's secret (EngineConfig.secret) or the
    folder's key file."""
    return derive(secret, "disk tier")


def key_id(key: bytes) -> bytes:
    """8 bytes naming a disk key (in the folder's name: blocks of another key are in
    another folder, never tried), which say nothing of the key."""
    return hmac.new(key, b"kvops disk tier: key id", hashlib.sha256).digest()[:8]


def file_bytes(payload_bytes: int, hash_bytes: int = 32) -> int:
    """What a block of payload_bytes takes on disk: header, hash, sealed payload."""
    return HEADER.size + hash_bytes + payload_bytes + TAG_BYTES


class BlockSeal:
    """Seals and opens the block files of one identity (`digest`) under one disk key."""

    def __init__(self, key: bytes, digest: bytes) -> None:
        self._key = key
        self.digest = digest

    def seal(self, epoch: int, block_hash: BlockHash, payload: bytes) -> list[bytes]:
        """The file's bytes, in two parts (header and hash; the sealed payload)."""
        nonce = os.urandom(NONCE_BYTES)
        head = HEADER.pack(MAGIC, VERSION, self.digest, epoch, nonce, len(block_hash),
                           len(payload) + TAG_BYTES) + block_hash
        return [head, self._cipher(epoch, block_hash).encrypt(nonce, payload, head)]

    def open(self, epoch: int, block_hash: BlockHash, data: bytes) -> bytes | None:
        """The payload of a file's bytes, or None: not this format, identity, epoch or
        hash, or not sealed with this key (a forged or altered file)."""
        if len(data) < HEADER.size:
            return None
        magic, version, digest, file_epoch, nonce, hash_len, sealed = HEADER.unpack_from(data)
        start = HEADER.size + hash_len
        if magic != MAGIC or version != VERSION or digest != self.digest or \
                file_epoch != epoch or data[HEADER.size:start] != block_hash or \
                len(data) != start + sealed or sealed < TAG_BYTES:
            return None
        try:
            return self._cipher(epoch, block_hash).decrypt(nonce, data[start:], data[:start])
        except InvalidTag:
            return None

    def _cipher(self, epoch: int, block_hash: BlockHash) -> AESGCM:
        context = self.digest + struct.pack("<Q", epoch) + block_hash
        return AESGCM(hmac.new(self._key, context, hashlib.sha256).digest())
