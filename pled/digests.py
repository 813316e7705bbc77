"""Content digests of shards: what pled records while staging, and what sidecars may ship."""
from __future__ import annotations

import hashlib

import blake3
import xxhash


def hash_bytes(algo: str, view) -> str:
    """Hex digest of ``view``. All three release the GIL on large inputs, so hashing runs on the other core
    while the next shard is copied. xxh3_128 (about 20 GB/s here) is what pled records; blake3 and sha256
    only where a sidecar ships digests in them."""
    if algo == "xxh3_128":
        return xxhash.xxh3_128(view).hexdigest()
    if algo == "blake3":
        return blake3.blake3(view, max_threads=1).hexdigest()
    return hashlib.sha256(view).hexdigest()


def new_hasher(algo: str):
    """An incremental hasher (update/hexdigest) for a shipped digest's algorithm."""
    if algo == "blake3":
        return blake3.blake3(max_threads=1)
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    raise ValueError(f"unknown digest algorithm {algo!r}")
