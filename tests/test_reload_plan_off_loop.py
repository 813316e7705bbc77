"""What keeps a reload's large plan off pled's loop (issue 44, finding 3; the liveness test measures the whole): the
plan comes back from the planning child without a garbage collection over it, and frozen afterwards; a checkpoint
file's header carries only the PLE tensors pled stages; a config's allow_uids are checked against the user
namespace's map a range at a time. Each is a property checked here without a clock."""
import gc
import random

import numpy as np

from pled.daemon.regions import parsing
from pled.daemon.serving.access import unmapped_ids
from pled.daemon.sources.checkpoint import is_ple, open_checkpoint
from pled.daemon.sources.safetensors_file import read_header, write
from pled.daemon.sources.sidecar import open_table
from pled.generator import make_checkpoint
from pled.shared import region


def test_a_large_plan_is_unpickled_without_a_collection_and_then_frozen(tmp_path):
    """20,000 tensors: unpickled with the collector on, their objects would cross its thresholds dozens of times,
    each collection run by whichever of pled's threads allocates next (often the loop)."""
    d = tmp_path / "generic"
    d.mkdir()
    write(str(d / "data.safetensors"), [(f"e{i}", "U8", (1,), b"\0") for i in range(20_000)])
    source = open_table(str(d))
    data = parsing._dumps(("ok", (source, region.plan("u", source)), []))
    started: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        assert gc.isenabled()
        kind, (back, manifest), records = parsing._unpickle_plan(data)
        during = list(started)
        assert gc.isenabled()  # as it was
        frozen = gc.get_freeze_count()
    finally:
        gc.callbacks.remove(seen)
        gc.unfreeze()
    assert during == [], f"collections of generations {during} ran while the plan was unpickled"
    assert kind == "ok" and len(manifest.tensors) == 20_000 and len(back.shards[0].header.tensors) == 20_000
    assert frozen >= 2 * 20_000  # each tensor's records, never traversed by a collection again


def test_the_collector_stays_off_only_while_unpickling_and_is_left_as_found(tmp_path):
    data = parsing._dumps(("ok", {"a": [1, 2, 3]}, []))
    gc.disable()
    try:
        assert parsing._unpickle_plan(data) == ("ok", {"a": [1, 2, 3]}, [])
        assert not gc.isenabled()  # a collector that was off stays off
    finally:
        gc.enable()
        gc.unfreeze()
    try:
        parsing._unpickle_plan(b"not a pickle")
    except Exception:  # noqa: BLE001  whatever the unpickler says: the collector is back on
        pass
    finally:
        gc.unfreeze()
    assert gc.isenabled()


def test_unmapped_ids_by_the_maps_ranges_at_their_edges(tmp_path):
    (tmp_path / "uid_map").write_text("0 0 1\n998 998 2\n100000 1000 50\n")
    ids = [0, 1, 997, 998, 999, 1000, 99_999, 100_000, 100_049, 100_050, 1, 998]
    assert unmapped_ids("uid", ids, proc=str(tmp_path)) == {1, 997, 1000, 99_999, 100_050}
    rng = random.Random(5)
    ranges = [(0, 0, 1), (998, 998, 2), (100_000, 1000, 50)]
    many = [rng.randrange(0, 200_000) for _ in range(50_000)] + [0, 998, 999, 100_000, 100_049]
    naive = {i for i in many if not any(lo <= i < lo + n for lo, _, n in ranges)}
    assert unmapped_ids("uid", many, proc=str(tmp_path)) == naive


def test_a_checkpoint_file_keeps_only_its_ple_tensors_and_its_identity(tmp_path):
    extra = [(f"model.layers.{i}.mlp.weight", "F32", (4,), np.zeros(4, np.float32)) for i in range(300)]
    (path,) = make_checkpoint(str(tmp_path), "bf16", {0: 100}, width=64, parts=4, files=1, extra=extra)
    full = read_header(path)
    (shard,) = open_checkpoint(str(tmp_path)).shards
    kept = [t.name for t in shard.header.tensors]
    assert kept == [t.name for t in full.tensors if is_ple(t.name)] and len(kept) == 4 and len(full.tensors) > 300
    assert (shard.header.fingerprint, shard.header.size, shard.header.data_offset) == \
        (full.fingerprint, full.size, full.data_offset)  # what staging, Status and verify compare
