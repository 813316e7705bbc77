"""DeepSeek V4.1's Engram tables in a `checkpoint` table (issue 46; pled/daemon/sources/engram.py): per Engram layer
two arrays in checkpoint order (``layers.L.engram.embed.weight`` F8_E4M3, then ``.scale`` F8_E8M0), each the tensor's
bytes verbatim on a 2 MiB boundary, found through the index, with the preflight counting the exact bytes and
`pled inspect` saying what vLLM's private copies would take; a checkpoint pled cannot serve refused in one line
naming the tensor (exit 78).

The bytes are checked against a reader of the safetensors format independent of pled's (test_checkpoint_tables)."""
import json
import os
from pathlib import Path

import pytest

import harness
from pled.daemon.regions import staging
from pled.daemon.sources.checkpoint import open_checkpoint
from pled.daemon.sources.engram import pow2
from pled.generator import engram_head_sizes, make_engram_checkpoint
from pled.shared import region
from pled.shared.errors import SidecarError
from test_checkpoint_tables import checkpoint_tensors, raw_tensors

MiB2 = 2 * 1024 * 1024
SMALL = {"engram_layer_ids": [1, 3], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 256,
         "engram_vocab_size": 300}


def test_each_engram_layer_is_two_arrays_in_checkpoint_order_verbatim(tmp_path):
    _, c = make_engram_checkpoint(str(tmp_path), SMALL, files=3)
    rows = dict(zip(c["engram_layer_ids"], c["engram_num_embeddings"], strict=True))
    assert len(set(rows.values())) == 2  # the two layers' tables differ in rows (never-reused primes)
    assert [sum(h) for h in engram_head_sizes(c)] == list(rows.values())
    tensors = checkpoint_tensors(tmp_path)
    with staging.stage("t", open_checkpoint(str(tmp_path))) as r:
        m = r.manifest
        data = os.pread(r.fd, m.region_bytes, 0)
    assert [(a.prefix, a.param, a.dtype, a.shape) for a in m.arrays] == [
        (f"layers.{layer}.engram.embed", p, d, (n, w)) for layer, n in rows.items()
        for p, d, w in (("weight", "F8_E4M3", 256), ("scale", "F8_E8M0", 8))]
    end = m.data_offset
    for a in m.arrays:
        assert a.offset % MiB2 == 0 and a.offset >= end and a.parts == 0
        assert data[a.offset:a.offset + a.nbytes] == tensors[f"{a.prefix}.{a.param}"]
        end = a.offset + a.nbytes
    held = {f"{a.prefix}.{a.param}" for a in m.arrays}
    assert {t.name for t in m.tensors} == held  # the other tensors (norms, projections, embed) stay with vLLM
    assert "embed.weight" in tensors and "layers.1.engram.value_proj.weight" in tensors


def test_the_index_decides_which_files_are_read(tmp_path):
    make_engram_checkpoint(str(tmp_path), SMALL, files=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    wanted = {index[f"layers.{layer}.engram.embed.{p}"] for layer in (1, 3) for p in ("weight", "scale")}
    unused = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors") and f not in wanted]
    ck = open_checkpoint(str(tmp_path))
    assert {os.path.basename(s.path) for s in ck.shards} == wanted
    for f in unused:  # a file the index names for no Engram tensor is never opened
        (tmp_path / f).write_bytes(b"not a safetensors file")
    assert open_checkpoint(str(tmp_path)).nbytes == ck.nbytes


def rewrite(path: Path, name: str, dtype: str | None = None, shape: list | None = None) -> None:
    """Rewrite one tensor's header entry in place (its data unchanged, the header kept the same length)."""
    from pled.daemon.sources.safetensors_file import write

    tensors = raw_tensors(path)
    header = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    out = []
    for n, data in tensors.items():
        t = header[n]
        d, s = t["dtype"], t["shape"]
        if n == name:
            d, s = dtype or d, shape or s
            if shape:
                data = data[:int(s[0]) * int(s[1])]
        out.append((n, d, tuple(s), data))
    write(str(path), out)


@pytest.mark.parametrize("case", ["scale dtype", "scale rows", "scale width", "no scale"])
def test_an_engram_checkpoint_pled_cannot_serve_is_refused_naming_the_tensor(tmp_path, case):
    _, c = make_engram_checkpoint(str(tmp_path), SMALL, files=1, index=False)
    (path,) = tmp_path.glob("*.safetensors")
    n = c["engram_num_embeddings"][1]
    name = "layers.3.engram.embed.scale"
    if case == "scale dtype":
        rewrite(path, name, dtype="U8")
        words = f"tensor '{name}' is U8[{n}, 8]; an Engram table's scale is F8_E8M0"
    elif case == "scale rows":
        rewrite(path, name, shape=[n - 1, 8])
        words = f"Engram table layers.3.engram.embed: weight [{n}, 256] and scale [{n - 1}, 8] disagree"
    elif case == "scale width":
        rewrite(path, name, shape=[n // 2, 16])
        words = f"weight [{n}, 256] and scale [{n // 2}, 16] disagree"
    else:
        from pled.daemon.sources.safetensors_file import write

        write(str(path), [(k, "U8", (len(v),), v) if k == name else (k, *_meta(path, k), v)
                          for k, v in raw_tensors(path).items() if k != name])
        words = "Engram table layers.3.engram.embed has no scale tensor (layers.3.engram.embed.scale)"
    with pytest.raises(SidecarError) as err:
        open_checkpoint(str(tmp_path))
    assert words in str(err.value) and str(path) in str(err.value), str(err.value)
    out = harness.run_pled("inspect", "--checkpoint", tmp_path)
    assert out.returncode == 78 and words in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def _meta(path: Path, name: str) -> tuple:
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return header[name]["dtype"], tuple(header[name]["shape"])


def test_pled_inspect_lists_engram_tables_and_vllms_private_copies(tmp_path):
    _, c = make_engram_checkpoint(str(tmp_path / "m"), SMALL)
    n1, n3 = c["engram_num_embeddings"]
    out = harness.run_pled("inspect", "--checkpoint", tmp_path / "m")
    assert out.returncode == 0, out.stderr
    assert f"layers.3.engram.embed.scale: F8_E8M0 {n3} x 8, unsharded" in out.stdout
    assert f"Engram table layers.1.engram.embed: {n1} rows, {n1 * 264} bytes" in out.stdout
    doc = json.loads(harness.run_pled("inspect", "--json", "--checkpoint", tmp_path / "m").stdout)
    (e1, e3) = doc["engram"]
    tp1 = e3["private_copies"][0]
    assert tp1["shards"] == 1 and tp1["bytes"] == n3 * 264
    assert tp1["pinned_bytes"] == pow2(n3 * 256) + pow2(n3 * 8) > tp1["bytes"]  # power-of-two rounding shown
    assert pow2(91 * 2**30 + 1) == 128 * 2**30 and pow2(2**20) == 2**20


@pytest.mark.daemon
@pytest.mark.slow
def test_preflight_counts_the_engram_arrays_exact_bytes_and_pled_serves_them(tmp_path, daemon):
    make_engram_checkpoint(str(tmp_path / "m"), SMALL)
    config = harness.write_config(tmp_path / "pled.toml", {"ds": {"checkpoint": tmp_path / "m"}})
    doc = json.loads(harness.run_pled("preflight", "--json", "-c", config).stdout)
    planned = region.plan("ds", open_checkpoint(str(tmp_path / "m")))
    assert doc["needed_bytes"] == planned.region_bytes, doc
    pled = daemon({"ds": {"checkpoint": tmp_path / "m"}})
    st = json.loads(harness.run_pled("status", "--json", "--socket", pled.socket).stdout)
    (t,) = st["tables"]
    assert t["state"] == "ready" and t["sealed"] and [a["param"] for a in t["arrays"]] == ["weight", "scale"] * 2
    text = harness.run_pled("status", "--socket", pled.socket).stdout  # an Engram table is named for what it is
    assert "ds: 4 arrays for vLLM 0.33's Engram path, from" in text, text
    ok = harness.run_pled("verify", "--socket", pled.socket)
    assert ok.returncode == 0, ok.stdout
