"""Tables whose tensors do not start at a multiple of their dtype's size: the safetensors format does not align
them. Table.gather must give every row bit for bit whatever the offsets.

The generator writes a shard's tensors one after another with no padding, so an nvfp4 shard whose rows are not a
multiple of 4 puts its float32 ``weight_scale_2`` at a data offset of 2 mod 4 (3,001 rows: byte 270,090). int4's and
fp8's scales follow rows of 80 or 160 bytes and so stay aligned in the generator's files; a writer that does not
pad the header to 8 bytes (the format lets it) moves every tensor, so those tables are also staged with their
headers re-padded to leave the data at an odd offset.

The reference reads the files with numpy alone (header parsed here, pled.shared.dequant's formulas), and the
files are read through safetensors' own safe_open as well."""
import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open

from harness import LAYOUTS
from pled import client
from pled.daemon.sources.safetensors_file import read_header
from pled.generator import make_sidecar
from pled.shared import dequant
from pled.shared.layouts import LAYOUTS as SPECS

EVEN = [3001] * 6
UNEVEN = [3001, 2999, 1, 4097]
ITEMSIZE = {"U8": 1, "F8_E4M3": 1, "F16": 2, "F32": 4}


def read_shard(path) -> dict[str, np.ndarray]:
    """A shard's tensors by name, read with struct, json and numpy only."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, spec in header.items():
        begin, end = spec["data_offsets"]
        data = np.frombuffer(raw[8 + n + begin : 8 + n + end], dtype=dequant.NUMPY_DTYPES[spec["dtype"]])
        out[name] = data.reshape(spec["shape"])
    return out


def repad_header(directory, data_at: int = 3) -> None:
    """Rewrite every shard with its header padded so that its data starts at ``data_at`` mod 8 in the file (so
    in the region too: shards start at 2 MiB there); drop META.json's digests, which no longer match."""
    for path in sorted(directory.glob("shard_*.safetensors")):
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = raw[8 : 8 + n].rstrip(b" ")
        header += b" " * ((data_at - 8 - len(header)) % 8)
        path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])
    meta = json.loads((directory / "META.json").read_text())
    del meta["digests"]
    (directory / "META.json").write_text(json.dumps(meta))


def edge_and_random_ids(rows: list[int], count: int, seed: int) -> torch.Tensor:
    """The first and last row of every shard, then ``count`` random rows, shuffled together."""
    starts = np.cumsum([0] + rows[:-1])
    edges = np.concatenate([starts, starts + np.array(rows) - 1])
    rng = np.random.default_rng(seed)
    ids = np.concatenate([edges, rng.integers(0, sum(rows), count)])
    return torch.from_numpy(rng.permutation(ids))


def reference(directory, layout: str, rows: list[int], ids: np.ndarray) -> np.ndarray:
    shards = [read_shard(directory / f"shard_{i}.safetensors") for i in range(len(rows))]
    starts = np.cumsum([0] + rows[:-1])
    which = np.searchsorted(starts, ids, side="right") - 1
    out = np.empty((len(ids), 160), dtype=np.float32)
    for shard in np.unique(which):
        mask = which == shard
        out[mask] = dequant.dequant_rows(layout, shards[shard], ids[mask] - starts[shard])
    return out


def misaligned(entries) -> list[tuple[int, str, int]]:
    """(shard, name, offset) of each tensor whose offset is not a multiple of its dtype's size."""
    return [(t.shard, t.name, t.offset) for t in entries if t.offset % ITEMSIZE[t.dtype]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_is_exact_whatever_the_tensor_offsets(tmp_path, daemon, layout):
    tables = {"even": EVEN, "uneven": UNEVEN, "repadded": UNEVEN}
    dirs = {}
    for name, rows in tables.items():
        dirs[name] = tmp_path / name
        make_sidecar(str(dirs[name]), layout, rows=rows, seed=5)
    repad_header(dirs["repadded"])
    # The offsets, from the files' headers: nvfp4's scale_2 is misaligned as generated, every scale once re-padded.
    for name, d in dirs.items():
        for i in range(len(tables[name])):
            header = read_header(str(d / f"shard_{i}.safetensors"))
            offsets, dtypes = {t.name: t.begin for t in header.tensors}, {t.name: t.dtype for t in header.tensors}
            if layout == "ples_nvfp4":
                assert offsets["weight_scale_2"] % 4 != 0, (name, i, offsets)
            if name == "repadded":
                assert header.data_offset % 8 == 3
                scale = "weight_scale_2" if layout == "ples_nvfp4" else "weight_scale"
                assert offsets[scale] % ITEMSIZE[dtypes[scale]] != 0, (i, offsets)

    pled = daemon(dirs)
    for name, d in dirs.items():
        rows = tables[name]
        with client.attach(name, socket=pled.socket) as t:
            # The same faults in the region: its shards start at 2 MiB, the tensors where the files put them.
            wrong = misaligned(t.manifest.tensors)
            if layout == "ples_nvfp4":
                assert {(s, n) for s, n, _ in wrong} >= {(s, "weight_scale_2") for s in range(len(rows))}, wrong
            if name == "repadded":
                assert {n for _, n, _ in wrong} == {s.name for s in SPECS[layout].tensors if ITEMSIZE[s.dtype] > 1}
            elif layout != "ples_nvfp4":
                assert wrong == []
            ids = edge_and_random_ids(rows, 300, seed=len(name))
            out = torch.empty((len(ids), 160), dtype=torch.float32)
            t.gather(ids, out=out)
            want = reference(d, layout, rows, ids.numpy())
            assert np.array_equal(out.numpy().view(np.uint32), want.view(np.uint32)), (layout, name)
            assert torch.equal(t.gather(ids), out.to(torch.bfloat16))  # through the float32 work buffer
            assert torch.equal(t.gather(ids.to(torch.int32)[:7], dtype=torch.float32), out[:7])

            # safetensors' own reader, the numpy reader and the table's views hold the same bytes.
            for i in range(len(rows)):
                mine = read_shard(d / f"shard_{i}.safetensors")
                views = t.shard_tensors(i)
                with safe_open(str(d / f"shard_{i}.safetensors"), framework="pt") as f:
                    assert set(f.keys()) == set(mine) == set(views)
                    for key in f.keys():
                        theirs = f.get_tensor(key)
                        assert tuple(theirs.shape) == mine[key].shape == tuple(views[key].shape)
                        raw = torch.from_numpy(mine[key].reshape(-1).view(np.uint8).copy())
                        assert torch.equal(theirs.reshape(-1).view(torch.uint8), raw), (name, i, key)
                        assert torch.equal(views[key].reshape(-1).view(torch.uint8), raw), (name, i, key)
                    if layout == "ples_nvfp4":
                        scale_2 = f.get_tensor("weight_scale_2")
                        assert scale_2.dtype == torch.float32 and scale_2.item() == float(mine["weight_scale_2"])


@pytest.mark.parametrize("shift", [1, 2, 3, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gatherer_reads_tensors_at_any_byte_offset(layout, shift):
    """In process, no daemon: two shards (3 and 5 rows), each tensor placed ``shift`` bytes past a multiple of 8."""
    from types import SimpleNamespace

    from pled.client.gather import Gatherer
    from pled.generator import shard_tensors

    rows, buf, entries, shards = [3, 5], bytearray(), [], []
    for i, count in enumerate(rows):
        tensors = {n: a for n, _, _, a in shard_tensors(layout, count, 32, np.random.default_rng([9, i]))}
        shards.append(tensors)
        for spec in SPECS[layout].tensors:
            buf += bytes((shift - len(buf)) % 8)
            entries.append(SimpleNamespace(shard=i, name=spec.name, offset=len(buf)))
            buf += np.ascontiguousarray(tensors[spec.name]).tobytes()
    manifest = SimpleNamespace(table="t", layout=layout, rows=sum(rows), row_width=32, tensors=entries,
                               shards=[SimpleNamespace(rows=r) for r in rows])
    assert all(e.offset % 8 == shift for e in entries)
    ids = torch.tensor([0, 2, 3, 7, 4, 1, 6, 5])
    got = Gatherer(manifest, torch.frombuffer(buf, dtype=torch.uint8)).gather(ids, dtype=torch.float32)
    want = np.concatenate([dequant.dequant_rows(layout, shards[0], np.array([r])) if r < 3 else
                           dequant.dequant_rows(layout, shards[1], np.array([r - 3])) for r in ids.tolist()])
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_make_sidecar_writes_uneven_shards(tmp_path):
    paths = make_sidecar(str(tmp_path / "u"), "ples_int4", rows=UNEVEN, seed=2)
    assert [read_header(p).tensors[0].shape[0] for p in paths] == UNEVEN
    meta = json.loads((tmp_path / "u" / "META.json").read_text())
    assert (meta["shards"], meta["rows"], meta["rows_per_shard"]) == (4, sum(UNEVEN), UNEVEN)
    # Shard i depends on the seed, i and its rows alone.
    make_sidecar(str(tmp_path / "e"), "ples_int4", shards=2, rows=3001, seed=2)
    assert (tmp_path / "e/shard_0.safetensors").read_bytes() == (tmp_path / "u/shard_0.safetensors").read_bytes()
    assert json.loads((tmp_path / "e" / "META.json").read_text())["rows_per_shard"] == 3001
    with pytest.raises(ValueError, match="rows lists 4 shards' rows but shards = 3"):
        make_sidecar(str(tmp_path / "x"), "ples_int4", shards=3, rows=UNEVEN)
    for bad in ([], [5, 0]):
        with pytest.raises(ValueError, match="need shards >= 1, rows >= 1"):
            make_sidecar(str(tmp_path / "x"), "ples_int4", rows=bad)
