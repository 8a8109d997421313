"""Chained hashes of full KV blocks: a block's hash covers its tokens and every token before it.

Invariant: two blocks have the same hash only if the whole token prefix up to their end is equal
(up to SHA-256 collisions), so a hash hit means the cached KV is exactly what would be computed.
"""
from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = b"tokenmill-kv-root"


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.sha256(parent_hash or ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int) -> None:
    """Append the hashes of every full block of token_ids not yet hashed (in place)."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i > 0 else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))
