import json
import os
import struct

import numpy as np
import pytest

from harness import LAYOUTS
from pled.daemon.sources import safetensors_file
from pled.daemon.sources.sidecar import open_table
from pled.shared import region
from pled.shared.errors import EX_CONFIG, SidecarError

MiB2 = 2 * 1024 * 1024


def shard(d, i):
    return d / f"shard_{i}.safetensors"


def refused(path, *words):
    with pytest.raises(SidecarError) as err:
        open_table(str(path))
    for w in words:
        assert w in str(err.value), str(err.value)
    assert err.value.exit_status == EX_CONFIG
    return err.value


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_detected_and_bytes_exact(sidecar, layout):
    d = sidecar(layout, shards=3, rows=1000)
    s = open_table(str(d))
    assert s.layout == layout
    assert (len(s.shards), s.rows, s.row_width) == (3, 3000, 160)
    files = sorted(d.glob("*.safetensors"))
    assert s.nbytes == sum(os.path.getsize(f) for f in files)
    # The region holds each file at a 2 MiB boundary after a 2 MiB header block: nothing estimated.
    m = region.plan(layout, s)
    assert m.region_bytes == MiB2 + sum(-(-os.path.getsize(f) // MiB2) * MiB2 for f in files)
    # Payload per row, from the layout table in docs/operations.md: fp8 160+4, int4 80+20, nvfp4 80+10 (+4 per shard).
    per_row = {"ples_fp8": 164, "ples_int4": 100, "ples_nvfp4": 90}[layout]
    payload = sum(t.nbytes for sh in s.shards for t in sh.header.tensors)
    assert payload == 3000 * per_row + (12 if layout == "ples_nvfp4" else 0)


def test_shards_are_ordered_numerically(sidecar):
    d = sidecar(shards=12, rows=8)
    assert [sh.name for sh in open_table(str(d)).shards][:4] == [f"shard_{i}.safetensors" for i in range(4)]
    assert open_table(str(d)).shards[10].name == "shard_10.safetensors"


def test_meta_json_is_read_and_checked(sidecar):
    d = sidecar(shards=2, rows=8)
    assert open_table(str(d)).meta["shards"] == 2
    meta = json.loads((d / "META.json").read_text())
    (d / "META.json").write_text(json.dumps({**meta, "rows": 999}))
    refused(d, "META.json", "rows = 999", "16")
    (d / "META.json").write_text("{not json")
    refused(d, "META.json", "cannot be read as JSON")


def test_missing_directory_and_empty_directory(tmp_path):
    refused(tmp_path / "nowhere", "nowhere", "no such file or directory")
    refused(tmp_path, str(tmp_path), "holds no .safetensors files")
    refused(tmp_path / "*.safetensors", "matches no files")


def test_gap_in_numbering(sidecar):
    d = sidecar(shards=5, rows=8)
    shard(d, 3).unlink()
    refused(d, str(d), "gap", "3 missing")


def test_duplicate_number(sidecar):
    d = sidecar(shards=3, rows=8)
    os.link(shard(d, 1), d / "shard_01.safetensors")
    refused(d, "appears twice")


def test_truncated_shard(sidecar):
    d = sidecar(shards=3, rows=64)
    size = os.path.getsize(shard(d, 2))
    os.truncate(shard(d, 2), size - 100)
    refused(d, "shard_2.safetensors", "truncated")
    os.truncate(shard(d, 2), 5)
    refused(d, "shard_2.safetensors", "too short")


def test_trailing_bytes_mean_the_header_lies(sidecar):
    d = sidecar(shards=2, rows=64)
    with open(shard(d, 1), "ab") as f:
        f.write(b"\0" * 4096)
    refused(d, "shard_1.safetensors", "trailing bytes")


def test_header_offsets_that_lie(sidecar):
    d = sidecar(shards=2, rows=64)
    raw = shard(d, 0).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["weight_scale"]["data_offsets"][1] += 2  # claims more bytes than its shape
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    shard(d, 0).write_bytes(raw[:8] + new + raw[8 + n :])
    refused(d, "shard_0.safetensors", "weight_scale", "data_offsets span")


def test_foreign_files(sidecar):
    d = sidecar(shards=2, rows=8)
    shard(d, 1).write_bytes(b"PK\x03\x04 this is a zip, not safetensors" * 10)
    refused(d, "shard_1.safetensors", "not a safetensors file")
    shard(d, 1).write_bytes(struct.pack("<Q", 6) + b"[1,2,]")
    refused(d, "shard_1.safetensors", "not JSON")


def test_inconsistent_dtype_across_shards(sidecar):
    d = sidecar(shards=3, rows=16)
    rows = 16
    safetensors_file.write(str(shard(d, 2)), [
        ("weight_i4", "U8", (rows, 80), np.zeros((rows, 80), np.uint8).tobytes()),
        ("weight_scale", "F32", (rows, 10), np.ones((rows, 10), np.float32).tobytes()),
    ])
    refused(d, "shard_2.safetensors", "weight_scale is F32", "F16")


def test_inconsistent_shape_across_shards(sidecar):
    d = sidecar(shards=3, rows=16)
    other = sidecar(shards=1, rows=16, width=192)
    os.replace(other / "shard_0.safetensors", shard(d, 1))
    refused(d, "shard_1.safetensors", "row width 192 differs from 160")


def test_damaged_layout_is_named(sidecar):
    d = sidecar("ples_nvfp4", shards=2, rows=16)
    safetensors_file.write(str(shard(d, 0)), [("weight_e2m1", "U8", (16, 80), bytes(16 * 80))])
    refused(d, "shard_0.safetensors", "looks like ples_nvfp4", "lacks weight_scale, weight_scale_2")


def test_mixed_layouts_refused(sidecar, tmp_path):
    d = sidecar("ples_int4", shards=2, rows=16)
    fp8 = sidecar("ples_fp8", shards=2, rows=16)
    os.replace(fp8 / "shard_1.safetensors", shard(d, 1))
    refused(d, "shard_1.safetensors", "holds ples_fp8 but shard_0.safetensors holds ples_int4")


def test_a_glob_of_checkpoint_files_is_a_generic_table(tmp_path):
    for i in (1, 2, 3):
        safetensors_file.write(str(tmp_path / f"model-{i:05d}-of-00003.safetensors"),
                               [(f"layers.{i}.w", "F32", (4, 4), np.full((4, 4), i, np.float32).tobytes())])
    (tmp_path / "config.json").write_text("{}")
    s = open_table(str(tmp_path / "model-*.safetensors"))
    assert s.layout == "safetensors" and len(s.shards) == 3 and s.rows == 0
    assert s.nbytes == sum(os.path.getsize(p) for p in tmp_path.glob("*.safetensors"))
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    refused(tmp_path / "model-*.safetensors", "gap", "2 missing")


def test_unknown_layout_shards_must_agree(tmp_path):
    for i, dtype in enumerate(["F16", "F16", "BF16"]):
        safetensors_file.write(str(tmp_path / f"shard_{i}.safetensors"), [("emb", dtype, (8, 4), bytes(64))])
    refused(tmp_path, "shard_2.safetensors", "'emb' is BF16", "F16")


def test_a_name_that_claims_a_vast_shard_count_is_refused_at_once(tmp_path):
    """A second attack's finding: model-00001-of-99999999999999.safetensors made pled list every number it claims
    (40 bytes each: memory until the OOM killer, or a MemoryError with a traceback). Only the first few missing
    numbers are looked for now."""
    safetensors_file.write(str(tmp_path / "model-00001-of-99999999999999.safetensors"), [("a", "U8", (2,), b"xy")])
    with pytest.raises(SidecarError, match=r"number 2, 3, 4, 5, 6 … missing of 1\.\.99999999999999"):
        open_table(str(tmp_path))


def test_names_of_long_or_unusual_digits_are_read_without_a_traceback(tmp_path):
    """Names whose digits int() refuses (a run over its 4,300-digit limit, a superscript two) are names pled
    sorts and reads like any other: a table, not a traceback."""
    for name in ("x1\u00b22.safetensors", "y" + "7" * 5000 + ".safetensors"):
        path = tmp_path / name
        try:
            safetensors_file.write(str(path), [("a", "U8", (2,), b"xy")])
        except OSError:  # a name longer than this file system takes: nothing to read
            continue
    assert {s.name for s in open_table(str(tmp_path)).shards} == {p.name for p in tmp_path.iterdir()}
