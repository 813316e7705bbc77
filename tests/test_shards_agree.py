"""Issue 48, class 4: the shard tensors of one table are one table only if every shard agrees on dtype and width
(byte order is the format's own: every safetensors dtype is little-endian, and a dtype the format does not name is
refused as unknown). A shard that disagrees is refused naming that shard's tensor and file, wherever it stands:
the table's first shard of another dtype used to be reported as the second ("…shard_1 is U8; the table's shards
are I8"), the majority named as the fault. Sidecar and checkpoint forms, each position of the odd shard.
"""
from __future__ import annotations

import json
import os

import pytest

from pled.daemon.sources.checkpoint import open_checkpoint
from pled.daemon.sources.naming import odd_one_out
from pled.daemon.sources.safetensors_file import write
from pled.daemon.sources.sidecar import open_table
from pled.shared.errors import SidecarError

PREFIX = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding"
SHARDS = 3


def _refusal(call) -> str:
    with pytest.raises(SidecarError) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


def _checkpoint(tmp_path, odd: int, *, dtype: str = "U8", width: int = 32) -> list[str]:
    """A checkpoint whose table has SHARDS shard tensors, each in a file of its own (and an index naming them),
    shard ``odd`` of ``dtype`` x ``width``, the others U8 x 32."""
    d = tmp_path / "ck"
    d.mkdir()
    files, weight_map = [], {}
    for i in range(SHARDS):
        name = f"{PREFIX}.shard_{i}.weight"
        dt, w = (dtype, width) if i == odd else ("U8", 32)
        path = d / f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        write(str(path), [(name, dt, (4, w), bytes(4 * w * (2 if dt == "BF16" else 1)))])
        files.append(str(path))
        weight_map[name] = path.name
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return files


@pytest.mark.parametrize("odd", range(SHARDS))
@pytest.mark.parametrize("what", ["dtype", "width", "dtype of another size"])
def test_a_checkpoint_shard_that_disagrees_is_refused_naming_it(tmp_path, odd, what):
    kind = {"dtype": {"dtype": "I8"}, "width": {"width": 16}, "dtype of another size": {"dtype": "BF16"}}[what]
    files = _checkpoint(tmp_path, odd, **kind)
    msg = _refusal(lambda: open_checkpoint(str(tmp_path / "ck")))
    assert msg.startswith(files[odd] + ": ") and f"shard_{odd}.weight" in msg, msg
    shown = f"{kind.get('dtype', 'U8')}[4, {kind.get('width', 32)}]"
    assert shown in msg and "other shards are U8[rows, 32]" in msg, msg


def test_a_checkpoint_shard_of_an_unknown_dtype_is_refused_naming_its_file(tmp_path):
    """A byte order other than the format's cannot be written: a dtype safetensors does not name (a big-endian
    spelling) is refused in the header of its own file."""
    files = _checkpoint(tmp_path, 1)
    with open(files[1], "r+b") as f:  # "U8" -> "BE": a header of the same length, the same offsets
        data = f.read()
        f.seek(0)
        f.write(data.replace(b'"dtype":"U8"', b'"dtype":"BE"'))
    msg = _refusal(lambda: open_checkpoint(str(tmp_path / "ck")))
    assert msg.startswith(files[1] + ": ") and "unknown dtype 'BE'" in msg, msg


def _generic_sidecar(tmp_path, odd: int, *, dtype: str = "U8", width: int = 32):
    d = tmp_path / "t"
    d.mkdir()
    for i in range(SHARDS):
        dt, w = (dtype, width) if i == odd else ("U8", 32)
        write(str(d / f"shard_{i}.safetensors"), [("emb", dt, (4, w), bytes(4 * w)), ("bias", "U8", (w,), bytes(w))])
    return [str(d / f"shard_{i}.safetensors") for i in range(SHARDS)]


@pytest.mark.parametrize("odd", range(SHARDS))
@pytest.mark.parametrize("what", ["dtype", "width"])
def test_a_generic_sidecar_shard_that_disagrees_is_refused_naming_it(tmp_path, odd, what):
    kind = {"dtype": {"dtype": "I8"}, "width": {"width": 16}}[what]
    files = _generic_sidecar(tmp_path, odd, **kind)
    msg = _refusal(lambda: open_table(str(tmp_path / "t")))
    assert msg.startswith(os.path.realpath(files[odd]) + ": ") or msg.startswith(files[odd] + ": "), msg
    other = os.path.basename(files[1 if odd == 0 else 0])
    assert "in the table's other shards" in msg and other in msg, msg


@pytest.mark.parametrize("odd", range(SHARDS))
def test_a_ple_sidecar_shard_of_another_width_is_refused_naming_it(sidecar, odd):
    d = sidecar(shards=SHARDS, rows=16)
    other = sidecar(shards=1, rows=16, width=192)
    os.replace(other / "shard_0.safetensors", d / f"shard_{odd}.safetensors")
    msg = _refusal(lambda: open_table(str(d)))
    assert msg.startswith(str(d / f"shard_{odd}.safetensors") + ": "), msg
    assert "row width 192 differs from 160 in the table's other shards" in msg, msg


@pytest.mark.parametrize("odd", range(SHARDS))
def test_a_ple_sidecar_shard_of_another_dtype_is_refused_naming_it(sidecar, odd):
    """A shard of fp8 among int4 shards: another layout (its tensors' dtypes), named where it stands."""
    d = sidecar("ples_int4", shards=SHARDS, rows=16)
    fp8 = sidecar("ples_fp8", shards=1, rows=16)
    os.replace(fp8 / "shard_0.safetensors", d / f"shard_{odd}.safetensors")
    msg = _refusal(lambda: open_table(str(d)))
    assert msg.startswith(str(d / f"shard_{odd}.safetensors") + ": "), msg
    assert "holds ples_fp8 but" in msg and "holds ples_int4, as the table's other shards do" in msg, msg


@pytest.mark.parametrize("values, expected", [
    ([], None), ([1], None), ([1, 1, 1], None), ([2, 1, 1], (0, 1)), ([1, 2, 1], (1, 0)), ([1, 1, 2], (2, 0)),
    ([1, 2], (1, 0)), ([3, 2, 2, 1], (0, 1)), ([1, 2, 3, 3], (0, 2)),
])
def test_odd_one_out_names_the_one_that_disagrees_with_most(values, expected):
    assert odd_one_out(values) == expected
