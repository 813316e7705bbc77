"""A `checkpoint` table (pled/daemon/sources/checkpoint.py, pled/shared/arrays.py): a model checkpoint's PLE tables
staged as arrays, one per table and pinned parameter, rows in shard order, on 2 MiB boundaries, with every other
promise of a table kept (exact preflight bytes, seals, digests, verify, Status, reload, the fd
store).

The bytes are checked against a reader of the safetensors format written here, independent of pled's."""
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import harness
from hfcache import in_layout
from pled.daemon.regions import staging
from pled.daemon.sources.checkpoint import open_checkpoint
from pled.daemon.sources.safetensors_file import write
from pled.daemon.systemd import fdstore
from pled.daemon.systemd.fdstore import StoredFd
from pled.daemon.systemd.notify import Notifier
from pled.generator import make_checkpoint, make_sidecar, shard_rows
from pled.shared import region
from pled.shared.digests import hash_bytes
from pled.shared.errors import SidecarError

ROOT = Path(__file__).resolve().parent.parent
MiB2 = 2 * 1024 * 1024
PREFIX = "model.language_model.layers.{}.ple.ple_embedding.ngram_embedding"
# Each checkpoint test that reads a directory runs over it as it was written ("plain") and as a Hugging Face hub cache
# snapshot: symbolic links into ../../blobs/<hash> (tests/hfcache.py; issue 48 class 5).
LAYOUTS = ["plain", "hf-snapshot"]


@pytest.fixture(params=LAYOUTS)
def layout(request):
    return request.param


def raw_tensors(path: Path) -> dict[str, bytes]:
    """Every tensor's data bytes, by a reader of the format independent of pled's."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return {name: data[8 + n + t["data_offsets"][0]: 8 + n + t["data_offsets"][1]] for name, t in header.items()}


def checkpoint_tensors(d: Path) -> dict[str, bytes]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(raw_tensors(f))
    return out


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
def test_each_array_is_its_shards_bytes_in_row_order_on_a_2mib_boundary(tmp_path, dtype, layout):
    rows = {0: 961, 3: 1290}  # each layer its own rows; 32 shards: the last of layer 0 empty, uneven tails
    assert 0 in shard_rows(961, 32) and len(set(shard_rows(1290, 32))) > 1
    make_checkpoint(str(tmp_path / "m"), dtype, rows, width=64, parts=32, files=3)
    m_dir = in_layout(layout, tmp_path / "m")
    tensors = checkpoint_tensors(m_dir)
    with staging.stage("t", open_checkpoint(str(m_dir))) as r:
        m = r.manifest
        data = os.pread(r.fd, m.region_bytes, 0)
    params = ["weight", "weight_scale"] if dtype == "nvfp4" else ["weight"]
    assert [(a.prefix, a.param) for a in m.arrays] == [(PREFIX.format(layer), p) for layer in rows for p in params]
    end = m.data_offset
    for a in m.arrays:
        layer = int(a.prefix.split(".")[3])
        assert a.offset % MiB2 == 0 and a.offset >= end and a.parts == 32 and a.shape[0] == rows[layer]
        expected = b"".join(tensors[f"{a.prefix}.shard_{i}.{a.param}"] for i in range(32))
        assert data[a.offset:a.offset + a.nbytes] == expected  # verbatim, shard_0 ‖ shard_1 ‖ …
        padding = data[a.offset + a.nbytes: region.align(a.offset + a.nbytes)]
        assert padding == bytes(len(padding))
        for src in a.sources:  # each source: its file, name, rows and the digest of its bytes
            t = m.tensors[src.tensor]
            assert src.digest == "xxh3_128:" + hash_bytes("xxh3_128", tensors[t.name])
            assert t.offset == a.offset + src.rows[0] * a.row_bytes
        end = a.offset + a.nbytes
    assert m.source_bytes == sum(a.nbytes for a in m.arrays) and m.region_bytes == region.align(end)
    assert "weight_scale_2" not in {a.param for a in m.arrays}  # the small tensors stay with vLLM's loader


def test_the_region_reads_back_alone_and_a_client_maps_the_checkpoint_tensors(tmp_path, layout):
    from pled.client.mapped_table import Table

    make_checkpoint(str(tmp_path / "m"), "nvfp4", {0: 500, 1: 700}, width=64, parts=8, files=2, index=False)
    m_dir = in_layout(layout, tmp_path / "m")
    tensors = checkpoint_tensors(m_dir)
    with staging.stage("t", open_checkpoint(str(m_dir))) as r:
        # each file known by its real path (a snapshot's link resolved to its blob), in the files' name order
        assert [s.path for s in r.manifest.shards] == [os.path.realpath(m_dir / f"model-0000{k}-of-00002.safetensors")
                                                      for k in (1, 2)]
        assert region.read_manifest(r.fd) == r.manifest and region.is_sealed(r.fd)
        t = Table(os.dup(r.fd), 1, populate=True)
        for i in range(len(t.shards)):
            for name, index in t.shard_entries(i).items():  # each tensor of each file, where the client finds it
                e = t.manifest.tensors[index]
                assert t.buffer[e.offset:e.offset + e.nbytes] == tensors[name]
        t.close()


def test_an_unsharded_table_is_one_array(tmp_path):
    import numpy as np

    w = np.arange(6 * 32, dtype=np.uint8).reshape(6, 32)
    write(str(tmp_path / "model.safetensors"), [(f"{PREFIX.format(0)}.weight", "F8_E4M3", (6, 32), w.tobytes()),
                                                 (f"{PREFIX.format(0)}.weight_scale", "F32", (1,), bytes(4))])
    ck = open_checkpoint(str(tmp_path / "model.safetensors"))
    assert [(a.param, a.parts, a.rows, a.dtype) for a in ck.arrays] == [("weight", 0, 6, "F8_E4M3")]


def _refused(tmp_path, tensors, index=None) -> str:
    d = tmp_path / "ck"
    d.mkdir(exist_ok=True)
    write(str(d / "model-00001-of-00001.safetensors"), tensors)
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    with pytest.raises(SidecarError) as err:
        open_checkpoint(str(d))
    assert "\n" not in str(err.value)
    return str(err.value)


def shard(layer, i, param="weight", rows=4, width=32, dtype="U8"):
    return (f"{PREFIX.format(layer)}.shard_{i}.{param}", dtype, (rows, width), bytes(rows * width))


@pytest.mark.parametrize("case", ["none", "gap", "split", "both", "pair", "index-dir", "index-missing"])
def test_a_checkpoint_pled_cannot_serve_is_refused_naming_the_file_and_what_to_do(tmp_path, case):
    other = ("model.language_model.embed_tokens.weight", "BF16", (4, 8), bytes(64))
    if case == "none":
        msg = _refused(tmp_path, [other])
        assert "holds no PLE table: pled looked for tensors named <prefix>.ple.ple_embedding.ngram_embedding" \
               ".shard_<i>.weight" in msg and "ck" in msg
    elif case == "gap":
        msg = _refused(tmp_path, [shard(0, 0), shard(0, 1), shard(0, 3)])
        assert "shard 2 is missing" in msg
    elif case == "split":  # a middle shard with fewer rows than the first: not vLLM's split
        msg = _refused(tmp_path, [shard(0, 0), shard(0, 1, rows=3), shard(0, 2)])
        assert "its shards hold 4, 3, 4 rows; vLLM reads shards of 4 rows each" in msg
    elif case == "both":
        msg = _refused(tmp_path, [shard(0, 0), (f"{PREFIX.format(0)}.weight", "U8", (4, 32), bytes(128))])
        assert "keep one form" in msg
    elif case == "pair":  # nvfp4's weight and block scales split differently
        msg = _refused(tmp_path, [shard(0, 0), shard(0, 1, rows=2),
                                  shard(0, 0, "weight_scale", rows=3, width=4, dtype="F8_E4M3"),
                                  shard(0, 1, "weight_scale", rows=3, width=4, dtype="F8_E4M3")])
        assert "weight and weight_scale shards hold different rows" in msg
    elif case == "index-dir":
        msg = _refused(tmp_path, [shard(0, 0)], {shard(0, 0)[0]: "../elsewhere.safetensors"})
        assert "model.safetensors.index.json" in msg and "named without a directory" in msg
    else:
        msg = _refused(tmp_path, [shard(0, 0)], {shard(0, 0)[0]: "model-00001-of-00001.safetensors",
                                                 shard(0, 1)[0]: "model-00001-of-00001.safetensors"})
        assert "which model.safetensors.index.json says it holds" in msg


def test_a_stored_checkpoint_region_is_adopted_only_while_its_files_are_unchanged(tmp_path, caplog, layout):
    import logging

    make_checkpoint(str(tmp_path / "m"), "fp8", {0: 300, 1: 400}, width=32, parts=4, files=2)
    m_dir = in_layout(layout, tmp_path / "m")
    files = sorted(str(f) for f in m_dir.glob("*.safetensors"))
    planned = lambda: {"t": region.plan("t", open_checkpoint(str(m_dir)))}  # noqa: E731
    r = staging.stage("t", open_checkpoint(str(m_dir)))
    caplog.set_level(logging.INFO, logger="pled.daemon.systemd.fdstore")
    out = fdstore.adopt_stored([StoredFd(os.dup(r.fd), "pled.2.t")], planned(), fdstore.FdStore(Notifier({}), {}))
    assert out.adopted["t"][0].manifest == r.manifest
    out.adopted["t"][0].close()
    os.utime(files[1], ns=(0, 0))  # through the snapshot's link: its blob
    out = fdstore.adopt_stored([StoredFd(os.dup(r.fd), "pled.2.t")], planned(), fdstore.FdStore(Notifier({}), {}))
    assert "t" not in out.adopted and f"{os.path.basename(os.path.realpath(files[1]))}: modified since" in caplog.text
    r.close()


def test_pled_inspect_lists_a_checkpoints_ple_tables(tmp_path, layout):
    make_checkpoint(str(tmp_path / "m"), "nvfp4", {0: 100, 2: 130}, width=32, parts=4, files=2)
    m_dir = in_layout(layout, tmp_path / "m")
    out = harness.run_pled("inspect", m_dir)
    assert out.returncode == 0, out.stderr
    assert f"{PREFIX.format(2)}.weight_scale: F8_E4M3 130 x 2, 4 shards" in out.stdout
    doc = json.loads(harness.run_pled("inspect", "--json", m_dir).stdout)
    assert doc["form"] == "arrays" and [a["rows"] for a in doc["arrays"]] == [100, 100, 130, 130]
    bare = harness.run_pled("inspect", tmp_path / "nowhere")
    assert bare.returncode == 78


def flip(path: str, name: str) -> int:
    from pled.daemon.sources.safetensors_file import read_header

    t = next(t for t in read_header(path).tensors if t.name == name)
    at = t.begin + t.nbytes // 3
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    return t.nbytes // 3


def test_pled_serves_verifies_and_reloads_a_checkpoint_table(tmp_path, daemon, layout):
    make_checkpoint(str(tmp_path / "m"), "nvfp4", {0: 3000, 1: 3100}, width=64, parts=16, files=3)
    m_dir = in_layout(layout, tmp_path / "m")
    pled = daemon({"qwen": {"checkpoint": m_dir}})
    st = json.loads(harness.run_pled("status", "--json", "--socket", pled.socket).stdout)
    (t,) = st["tables"]
    assert t["form"] == "arrays" and t["state"] == "ready" and t["shards"] == 3 and t["sealed"]
    assert [(a["param"], a["rows"]) for a in t["arrays"]] == [("weight", 3000), ("weight_scale", 3000),
                                                            ("weight", 3100), ("weight_scale", 3100)]
    text = harness.run_pled("status", "--socket", pled.socket).stdout
    assert "qwen: 4 arrays for vLLM 0.33's PLE path, from 3 checkpoint file(s), a region of" in text
    ok = harness.run_pled("verify", "--socket", pled.socket)
    assert ok.returncode == 0 and ok.stdout.count("identical (") == 3, ok.stdout
    name = f"{PREFIX.format(1)}.shard_9.weight"
    index = json.loads((m_dir / "model.safetensors.index.json").read_text())["weight_map"]
    at = flip(str(m_dir / index[name]), name)  # through the snapshot's link: its blob, in place
    bad = harness.run_pled("verify", "--socket", pled.socket)
    assert bad.returncode == 1 and f"tensor {name} DIFFERS at byte {at}" in bad.stdout, bad.stdout
    assert pled.reload() == "reload done"
    st = json.loads(harness.run_pled("status", "--json", "--socket", pled.socket).stdout)
    assert st["tables"][0]["generation"] == 2
    assert harness.run_pled("verify", "--socket", pled.socket).returncode == 0
    prom = harness.run_pled("status", "--format", "prometheus", "--socket", pled.socket).stdout
    assert 'table="qwen"' in prom



@pytest.mark.daemon
@pytest.mark.parametrize("case", ["both", "none"])
def test_a_checkpoint_table_pled_cannot_serve_is_a_refusal_78(tmp_path, case):
    make_checkpoint(str(tmp_path / "m"), "fp8", {0: 100}, width=32, parts=4, files=2)
    if case == "both":
        tables = {"whole": tmp_path / "m" / "model-*.safetensors", "ple": {"checkpoint": tmp_path / "m"}}
        words = "tables whole and ple both hold"
    else:
        write(str(tmp_path / "plain.safetensors"), [("a.weight", "F32", (2,), bytes(8))])
        tables, words = {"ple": {"checkpoint": tmp_path / "plain.safetensors"}}, "holds no PLE table"
    config = harness.write_config(tmp_path / "pled.toml", tables)
    out = harness.run_pled("serve", "-c", config, timeout=60)
    assert out.returncode == 78 and words in out.stderr, out.stderr


@pytest.mark.daemon
def test_preflight_counts_the_arrays_exact_bytes(tmp_path):
    make_checkpoint(str(tmp_path / "m"), "bf16", {0: 5000}, width=64, parts=8, files=1)
    config = harness.write_config(tmp_path / "pled.toml", {"ple": {"checkpoint": tmp_path / "m"}})
    doc = json.loads(harness.run_pled("preflight", "--json", "-c", config).stdout)
    assert doc["needed_bytes"] == region.plan("ple", open_checkpoint(str(tmp_path / "m"))).region_bytes, doc


PREVIOUS = "1b5ddb2"  # the last commit of pled 0.1.0, before the arrays form


def test_a_client_of_the_previous_release_is_refused_naming_the_form(tmp_path, daemon):
    """pled 0.1.0's own client (its code from git) attaching to an arrays table: one line that names the form."""
    old = tmp_path / "old"
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS, "pled"], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"this checkout does not hold commit {PREVIOUS} (pled 0.1.0): {archive.stderr.decode()[:200]}")
    old.mkdir()
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    make_checkpoint(str(tmp_path / "m"), "fp8", {0: 100}, width=32, parts=4, files=1)
    make_sidecar(str(tmp_path / "s"), "ples_nvfp4", shards=2, rows=64)
    pled = daemon({"ple": {"checkpoint": tmp_path / "m"}, "side": tmp_path / "s"})
    code = ("import pled, sys; from pled.client import attach; assert pled.__file__.startswith(sys.argv[2])\n"
            "for name in ('ple', 'side'):\n"
            " try:\n  print('attached', attach(name, socket=sys.argv[1]).manifest.layout)\n"
            " except Exception as e:\n  print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code, pled.socket, str(old)], capture_output=True, text=True,
                         env=harness.clean_env(PYTHONPATH=str(old)), cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    arrays, sidecar = out.stdout.splitlines()
    assert arrays.startswith("BadRegion ") and "unknown key 'arrays'" in arrays, arrays
    assert sidecar == "attached ples_nvfp4"  # a sidecar table's manifest is as 0.1.0 wrote it
    shutil.rmtree(old)


def test_a_checkpoint_staged_through_a_huge_page_mapping_is_byte_identical(tmp_path):
    """The MADV_HUGEPAGE fill (a fixture sysfs that says 'advise'): each tensor copied into its array through the
    writable mapping; what the kernel gives is its own answer, the bytes must be right either way."""
    thp = tmp_path / "sys/sys/kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "shmem_enabled").write_text("always within_size [advise] never deny force\n")
    (thp / "hpage_pmd_size").write_text("2097152\n")
    make_checkpoint(str(tmp_path / "m"), "nvfp4", {0: 30_000, 1: 31_000}, width=64, parts=16, files=2)
    tensors = checkpoint_tensors(tmp_path / "m")
    with staging.stage("t", open_checkpoint(str(tmp_path / "m")), sys_root=str(tmp_path / "sys")) as r:
        assert r.stats.fill.method == staging.FAULT and region.is_sealed(r.fd)
        data = os.pread(r.fd, r.manifest.region_bytes, 0)
        for t in r.manifest.tensors:
            assert data[t.offset:t.offset + t.nbytes] == tensors[t.name]


@pytest.mark.root
@pytest.mark.daemon
def test_a_checkpoint_table_on_reserved_huge_pages_is_served_and_verified(tmp_path, daemon):
    from hugepool import MiB2 as PAGE2M, reserve

    make_checkpoint(str(tmp_path / "m"), "fp8", {0: 20_000, 1: 21_000}, width=64, parts=16, files=2)
    with reserve(8) as given:
        if given < 4:
            pytest.skip(f"this host gave {given} of 8 pages of 2 MiB asked")
        pled = daemon({"ple": {"checkpoint": tmp_path / "m"}}, huge_pages="hugetlb", huge_page_size="2M")
        assert "huge pages 100% (hugetlb 2 MiB), sealed" in pled.log()
        (t,) = json.loads(harness.run_pled("status", "--json", "--socket", pled.socket).stdout)["tables"]
        assert t["page_size_bytes"] == PAGE2M and t["form"] == "arrays" and t["resident_share"] == 1.0
        done = harness.run_pled("verify", "--socket", pled.socket)
        assert done.returncode == 0 and done.stdout.count("identical (") == 2, done.stdout + done.stderr
        assert pled.stop() == 0


@pytest.mark.parametrize("case", ["unicode-number", "long-number", "scale-alone", "scale-unsharded", "scale-bf16",
                                  "width-0"])
def test_a_table_vllm_would_read_otherwise_is_refused_naming_the_tensor(tmp_path, case):
    scales = [shard(0, i, "weight_scale", width=4, dtype="F8_E4M3") for i in (0, 1)]
    tensors = {
        "unicode-number": [shard(0, 0), (f"{PREFIX.format(0)}.shard_\u0661.weight", "U8", (4, 32), bytes(128))],
        "long-number": [shard(0, 0), (f"{PREFIX.format(0)}.shard_{'0' * 5}{10**9}.weight", "U8", (4, 32), bytes(128))],
        "scale-alone": scales,
        "scale-unsharded": [(f"{PREFIX.format(0)}.weight", "U8", (8, 32), bytes(256)), *scales],
        "scale-bf16": [shard(0, 0), shard(0, 1),
                       *((f"{PREFIX.format(0)}.shard_{i}.weight_scale", "BF16", (4, 4), bytes(32)) for i in (0, 1))],
        "width-0": [shard(0, 0, width=0), shard(0, 1, width=0)],
    }[case]
    msg = _refused(tmp_path, tensors)
    words = {"unicode-number": "vLLM reads its shard number '\u0661'", "long-number": "below 10**9 only",
             "scale-alone": "has block scales (weight_scale shards) but no weight",
             "scale-unsharded": "weight and weight_scale shards hold different rows",
             "scale-bf16": "are not nvfp4's (U8 x W/2 and F8_E4M3 x W/16)", "width-0": "rows of width 0"}[case]
    assert words in msg, msg


def test_names_sort_by_their_numbers_whatever_their_digits(tmp_path):
    from pled.daemon.sources.naming import natural_key

    names = ["shard_10", "shard_2", "shard_002", "m\u00b22", "x" + "7" * 5000, "x9"]
    assert sorted(names, key=natural_key)[:3] == ["m\u00b22", "shard_2", "shard_002"]
    assert sorted(names, key=natural_key)[-2:] == ["x9", names[4]]
    # a prefix with a superscript digit (not a number to Python's int()) is a name like any other
    write(str(tmp_path / "model.safetensors"), [("model.layers.1\u00b22.ple.ple_embedding.ngram_embedding.weight",
                                                 "U8", (6, 32), bytes(192))])
    assert open_checkpoint(str(tmp_path / "model.safetensors")).arrays[0].rows == 6


def test_one_file_of_a_checkpoint_is_a_checkpoint(tmp_path):
    """The file of a checkpoint that holds its PLE tensors, named as one of three: no numbering check."""
    (made,) = make_checkpoint(str(tmp_path / "m"), "fp8", {0: 100, 1: 120}, width=32, parts=4, files=1)
    path = tmp_path / "m" / "model-00002-of-00003.safetensors"
    os.rename(made, path)
    ck = open_checkpoint(str(path))
    assert [s.path for s in ck.shards] == [str(path)] and len(ck.arrays) == 2


def test_a_manifest_too_large_for_a_client_or_too_many_arrays_is_refused(tmp_path, monkeypatch):
    from pled.daemon.regions import planning
    from pled.daemon.sources import checkpoint

    make_checkpoint(str(tmp_path / "m"), "nvfp4", {0: 100, 1: 120, 2: 130}, width=32, parts=4, files=1)
    ck = open_checkpoint(str(tmp_path / "m"))
    monkeypatch.setattr(region, "MAX_MANIFEST", 4096)
    with pytest.raises(SidecarError, match="a client reads one of at most 4,096: serve fewer files in one table"):
        planning.plan_table("t", ck)
    monkeypatch.setattr(checkpoint, "MAX_ARRAYS", 5)
    with pytest.raises(SidecarError, match="holds 6 PLE tables and parameters; pled takes at most 5"):
        open_checkpoint(str(tmp_path / "m"))


def test_a_manifest_works_out_its_pieces_once(tmp_path):
    make_checkpoint(str(tmp_path / "m"), "nvfp4", {0: 100, 1: 120}, width=32, parts=8, files=2)
    m = region.plan("t", open_checkpoint(str(tmp_path / "m")))
    assert m.pieces() is m.pieces() and len(m.pieces()) == 32  # Status and each staging tick ask for its sums


@pytest.mark.daemon
def test_verify_finds_a_checkpoint_files_header_rewritten_at_the_same_size_and_mtime(tmp_path, daemon, layout):
    make_checkpoint(str(tmp_path / "m"), "fp8", {0: 400, 1: 400}, width=32, parts=8, files=1)
    m_dir = in_layout(layout, tmp_path / "m")
    (path,) = m_dir.glob("*.safetensors")
    pled = daemon({"ple": {"checkpoint": m_dir}})
    st = os.stat(path)
    data = Path(path).read_bytes()
    a, b = (f"{PREFIX.format(1)}.shard_{i}.weight".encode() for i in (4, 5))
    assert data.count(a) == data.count(b) == 1  # swap two shards' names: the rows vLLM would read move
    Path(path).write_bytes(data.replace(a, b"\0" * len(a)).replace(b, a).replace(b"\0" * len(a), b))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    out = harness.run_pled("verify", "--socket", pled.socket)
    assert out.returncode == 1 and "DIFFERS: its header is not the one pled staged" in out.stdout, out.stdout


def test_verify_of_a_region_whose_digests_are_not_pleds_is_one_line(tmp_path):
    from pled import verify
    from pled.client.mapped_table import Table

    make_checkpoint(str(tmp_path / "m"), "fp8", {0: 100}, width=32, parts=2, files=1)
    with staging.stage("t", open_checkpoint(str(tmp_path / "m"))) as r:
        lied = r.manifest.with_digests(["md5:" + "0" * 32] * len(r.manifest.pieces()))
        fd = os.memfd_create("lie", os.MFD_ALLOW_SEALING)
        os.write(fd, os.pread(r.fd, r.manifest.region_bytes, 0))
        os.pwrite(fd, region.encode_header(lied), 0)
        out = tmp_path / "out.txt"
        with Table(fd, 1, populate=False) as t, open(out, "w") as f:
            assert verify.verify_shard(t, 0, f) is False
    (line,) = out.read_text().splitlines()
    assert "the region records no digest pled knows ('md5:0000" in line
