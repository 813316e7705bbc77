"""Content digests of shards: the one pled records while staging, and the ones sidecars may ship.

The name and length of pled's own digest live here and nowhere else. Standard library at import
(the region format, shared with clients, imports this module); each hashing library is imported
when a digest of its kind is first asked for, so blake3 is loaded only where a sidecar ships such sums.
"""
from __future__ import annotations

import hashlib

# OWN: what pled records while staging (fast, and releases the GIL); the others only where a sidecar ships them
OWN = "xxh3_128"
HEX_LENGTH = {"xxh3_128": 32, "blake3": 64, "sha256": 64}  # every digest pled knows, and its length in hex digits
# Stands in for a shard's digest until staging has computed it: same length, so the manifest's size,
# and every offset that depends on it, is the same before and after.
PLACEHOLDER = f"{OWN}:" + "0" * HEX_LENGTH[OWN]


def hash_bytes(algo: str, data) -> str:
    """Hex digest of ``data`` in one go."""
    hasher = new_hasher(algo)
    hasher.update(data)
    return hasher.hexdigest()


def new_hasher(algo: str):
    """An incremental hasher (update/hexdigest). All three release the GIL on large inputs, so staging
    hashes on the other core while the next shard is copied."""
    if algo == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algo == "blake3":
        try:
            import blake3
        except ImportError as err:
            raise ImportError("this sidecar ships blake3 digests (B3SUMS or \"blake3:\" in META.json), which need the "
                              "blake3 package: pip install 'pled[daemon]'") from err
        return blake3.blake3(max_threads=1)
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algo!r}")
