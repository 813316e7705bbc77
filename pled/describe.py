"""``pled inspect``: what pled makes of a table's sources, for a person (or as JSON), read as the daemon reads them
and planned as it would plan them; nothing is staged."""
from __future__ import annotations

import json

from pled.shared.boundary import say


def inspect(path: str, as_json: bool = False, as_checkpoint: bool = False) -> int:
    """What ``pled inspect PATH`` prints: a sidecar's (or glob's) layout, shards, rows, bytes and META.json, or a
    model checkpoint's PLE tables (where PATH has an index, holds PLE tensors, or ``as_checkpoint``)."""
    from pled.daemon.sources import checkpoint
    from pled.daemon.sources.sidecar import open_table
    from pled.shared import region
    from pled.shared.sizes import gib

    if checkpoint.looks_like_checkpoint(path) or as_checkpoint:
        return _checkpoint(checkpoint.open_checkpoint(path), as_json)
    sidecar = open_table(path)
    if any(checkpoint.is_ple(t.name) for s in sidecar.shards for t in s.header.tensors):  # a checkpoint's files
        return _checkpoint(checkpoint.open_checkpoint(path), as_json)
    manifest = region.plan("inspect", sidecar)
    if as_json:
        print(json.dumps({**sidecar.describe(), "region_bytes": manifest.region_bytes}, indent=2))
        return 0
    shards = sidecar.shards
    say(sidecar.source)
    say(f"  layout     {sidecar.layout}")
    say(f"  shards     {len(shards)} ({shards[0].name} .. {shards[-1].name})")
    if sidecar.rows:
        per = sorted({s.rows for s in shards})
        say(f"  rows       {sidecar.rows} ({'/'.join(map(str, per))} per shard)")
        say(f"  row width  {sidecar.row_width}")
    say(f"  bytes      {sidecar.nbytes} ({gib(sidecar.nbytes)}); "
        f"region {manifest.region_bytes} ({gib(manifest.region_bytes)}) with alignment")
    if sidecar.meta:
        from pled.daemon.sources.sidecar_meta import COUNT_KEYS, other_keys

        said = [f"{k} = {json.dumps(sidecar.meta[k])}" for k in ("layout", *COUNT_KEYS) if k in sidecar.meta]
        say(f"  META.json  {', '.join(said) or 'no identity keys'} (checked against the shards)")
        for key, value in other_keys(sidecar.meta).items():
            say(f"    {key} = {json.dumps(value)}")
        if "digests" in sidecar.meta:
            say(f"    digests for {len(sidecar.meta['digests'])} shard(s)")
    return 0


def _checkpoint(ck, as_json: bool) -> int:
    """What ``pled inspect`` says of a model checkpoint: the PLE tables a ``checkpoint`` table would stage."""
    from pled.shared import region
    from pled.shared.sizes import gib

    manifest = region.plan("inspect", ck)
    if as_json:
        print(json.dumps({**ck.describe(), "region_bytes": manifest.region_bytes}, indent=2))
        return 0
    say(ck.source)
    say(f"  form       PLE and Engram tables as arrays, for vLLM 0.33's own paths ({len(ck.shards)} file(s) hold them)")
    for a in ck.arrays:
        split = f"{a.parts} shards" if a.parts else "unsharded"
        say(f"  {a.prefix}.{a.param}: {a.dtype} {a.rows} x {a.width}, {split}, {gib(a.nbytes)}")
    for e in ck.describe()["engram"]:
        say(f"  Engram table {e['prefix']}: {e['rows']} rows, {e['bytes']} bytes ({gib(e['bytes'])}) once in pled; "
            "without pled vLLM gives each rank a private pinned copy of its heads (torch rounds values and scales "
            "each up to a power of two):")
        for c in e["private_copies"]:
            say(f"    {c['shards']} head shard(s): about {c['rows']} rows a rank, {gib(c['bytes'])} -> "
                f"{gib(c['pinned_bytes'])} pinned per rank")
    say(f"  bytes      {ck.nbytes} ({gib(ck.nbytes)}); region {manifest.region_bytes} ({gib(manifest.region_bytes)}) "
        "with alignment")
    return 0
