"""Content digests of shards: what pled records while staging, and what sidecars may ship."""
from __future__ import annotations

import hashlib

import blake3
import xxhash


OWN = "xxh3_128"  # what pled records while staging (about 20 GB/s here); the others only where a sidecar ships them


def hash_bytes(algo: str, data) -> str:
    """Hex digest of ``data`` in one go."""
    hasher = new_hasher(algo)
    hasher.update(data)
    return hasher.hexdigest()


def new_hasher(algo: str):
    """An incremental hasher (update/hexdigest). All three release the GIL on large inputs, so staging
    hashes on the other core while the next shard is copied."""
    if algo == "blake3":
        return blake3.blake3(max_threads=1)
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "xxh3_128":
        return xxhash.xxh3_128()
    raise ValueError(f"unknown digest algorithm {algo!r}")
