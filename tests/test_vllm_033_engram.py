"""vLLM 0.33's DeepSeek V4.1 Engram tables (ParallelEngramEmbedding) on pled's sealed pages (issue 46), with the real
vLLM 0.33 modules.

A real `pled serve` holds a synthetic DeepSeek V4.1 checkpoint (pled make-checkpoint --kind engram: two Engram layers
of different row counts, vLLM's own prime-sized hash heads, other tensors beside, an index) as a `checkpoint` table.
Real gloo worlds of TP = 2 and DP x TP = 2 x 2 (tests/vllm_env/engram_rank.py) build every Engram layer with vLLM
0.33's ParallelEngramEmbedding under a real VllmConfig, ParallelConfig and EngramConfig (sharing resolved by vLLM,
then asked of the model module's can_share_engram_tables), load them with the real DeepseekV4Model.load_weights fed
the real weights mapper's output of vLLM's own weight iterator, and build each again as vLLM does without pled
(DPSharedEngramStorage's /dev/shm file, or private pinned copies).

FAKED, because this machine has no GPU: the CUDA runtime (registration calls recorded by a fake, for pled's GPU side
and upstream's cudaHostRegister alike), Tensor.is_pinned for the registered ranges, the device index and SM count,
the UVA view (a private copy for what is not pinned, as the real helper makes one), upstream's pin_memory.
Everything up to those calls is vLLM's and pled's own.
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import harness
from cgroups import join_and_exec, oom_kills
from pled.generator import make_engram_checkpoint
from vllm_env.engram_world import run_world
from vllm_env.ple_world import VLLM_033

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1 << 20
CONFIG = {"engram_layer_ids": [1, 3], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 256,
          "engram_vocab_size": 20_000}  # 4 hash heads a layer, ~80,000 rows (~21 MB) a layer
READ_ONLY_MAPPED = 0x02 | 0x08

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.daemon, pytest.mark.timeout(1800),
              pytest.mark.skipif(not (VLLM_033 / ".ready").exists(),
                                 reason="no .cache/vllm-0.33.0: run `make test` (it installs it there)")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The checkpoint and a pled serving it: (pled, checkpoint dir, config)."""
    harness.require_marker("daemon", "this module's fixture starts pled")
    d = tmp_path_factory.mktemp("engram033")
    _, config = make_engram_checkpoint(str(d / "m"), CONFIG, files=3)
    assert len(set(config["engram_num_embeddings"])) == 2
    pled = harness.start(d, {"ds": {"checkpoint": d / "m"}}, headroom_margin="64MiB")
    yield pled, d / "m", config
    pled.stop()


def check_rank(report: dict, dp: int, tp: int, shared_upstream: bool) -> None:
    """Every layer's weight and weight_scale_inv a view of pled's sealed memfd at this rank's slice, registered once
    read-only, byte-equal to what upstream builds; no /dev/shm file, no private copy, nothing registered after."""
    case = report["cases"]["pled"]
    assert "error" not in case, case.get("traceback")
    assert report["seams"] == {"allocate": True, "uva": True, "share": True}
    assert report["edp"] == (dp if dp > 1 else 1) and report["tp_rank"] == report["rank"] % tp
    assert case["loaded"] == [f"layers.{layer}.engram.embed_tokens.{p}" for layer in (1, 3)
                              for p in ("weight", "weight_scale_inv")]  # the real load_weights ran to its end
    assert case["shared"] is (dp > 1) and case["upstream_shared"] is shared_upstream
    assert case["shm_files_made"] == []  # no /dev/shm/vllm_engram_* file
    for layer, rec in case["layers"].items():
        assert not rec["shared_memory"] and rec["dp_size"] == 1  # TP-only heads: one copy, no per-step collectives
        assert rec["upstream_shared_memory"] is shared_upstream
        lo, hi = rec["range"]
        assert tp == 1 or 0 < hi - lo < rec["rows"]
        for name, p in rec["params"].items():
            assert p["ptr"] == p["storage"] == p["expected"], (layer, name, p)  # the slice, no copy
            assert p["mapping"].startswith("r--s /memfd:pled:ds"), p["mapping"]  # sealed and read-only: unwritten
            assert p["pinned"] and p["shape"][0] == hi - lo
            mine = [c for c in case["calls"] if c[0] <= p["ptr"] < c[0] + c[1]]
            assert len(mine) == 1, (name, case["calls"])  # registered once for this array in this process
            start, length, flags = mine[0]
            assert flags == READ_ONLY_MAPPED and start % PAGE == 0 and start + length >= p["ptr"] + p["nbytes"]
        assert rec["equal_to_upstream"] == {"weight": True, "weight_scale_inv": True}, rec
    assert len(case["calls"]) == 4  # two arrays a layer, nothing else registered by pled
    assert case["views_same"] == [True, True] and case["uva_private_copies"] == []  # the UVA view is the slice
    smallest = min(rec["params"]["weight"]["nbytes"] for rec in case["layers"].values())
    assert case["big_new_maps"] == [] and case["rss_anon_growth"] < smallest / 2, (case["big_new_maps"],
                                                                                  case["rss_anon_growth"])
    # upstream's own build, measured alike: its writable /dev/shm file mapped, or its private copies in RssAnon
    if shared_upstream:
        for rec in case["layers"].values():
            assert rec["upstream_mapping"].startswith("rw-s /dev/shm/vllm_engram_"), rec["upstream_mapping"]
    else:
        slices = sum(p["nbytes"] for rec in case["layers"].values() for p in rec["params"].values())
        assert case["upstream_rss_anon_growth"] >= slices, (case["upstream_rss_anon_growth"], slices)
    # every registration (pled's and upstream's) released once the tables are gone
    assert report["registered_calls"] == report["unregistered"] and report["still_registered"] == 0


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 2)])
def test_every_rank_views_pleds_sealed_region_and_equals_upstreams(served, dp, tp):
    pled, ck, _ = served
    reports = run_world(dp, tp, str(ck), [{"name": "pled", "upstream": True, "env": {"PLED_SOCKET": pled.socket}}])
    assert len(reports) == dp * tp
    for report in reports:
        check_rank(report, dp, tp, shared_upstream=dp > 1)
    # every DP replica of a TP rank views the same rows of the same region
    by_tp: dict[int, set] = {}
    for report in reports:
        ranges = tuple(tuple(r["range"]) for r in report["cases"]["pled"]["layers"].values())
        by_tp.setdefault(report["tp_rank"], set()).add(ranges)
    assert all(len(v) == 1 for v in by_tp.values()) and len(by_tp) == tp


def test_a_64mib_dev_shm_keeps_sharing_on_with_one_copy(served):
    """Each rank in its own mount namespace with a 64 MiB tmpfs at /dev/shm (a container's default): upstream cannot
    share (it falls back to splitting heads over DP), pled's copy is shared, and no file is made there."""
    pled, ck, _ = served
    small = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]
    if subprocess.run([*small, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a mount namespace with a tmpfs here (needs root)")
    big = dict(CONFIG, engram_vocab_size=70_000)  # ~150 MB of tables: more than 64 MiB
    d = ck.parent / "big"
    if not d.exists():
        _, c = make_engram_checkpoint(str(d), big, files=2)
        assert sum(c["engram_num_embeddings"]) * 264 > 64 * MiB
    other = harness.start(ck.parent, {"big": {"checkpoint": d}}, headroom_margin="64MiB")
    try:
        reports = run_world(2, 1, str(d), [{"name": "pled", "upstream": True,
                                            "env": {"PLED_SOCKET": other.socket}}], prefix=small)
    finally:
        other.stop()
    for report in reports:
        case = report["cases"]["pled"]
        assert "error" not in case, case.get("traceback")
        assert case["shared"] is True and case["upstream_shared"] is False  # upstream: no room, heads over DP
        assert case["shm_files_made"] == [] and case["big_new_maps"] == []
        for rec in case["layers"].values():
            assert rec["dp_size"] == 1 and not rec["upstream_shared_memory"]
            assert all(p["mapping"].startswith("r--s /memfd:pled:big") for p in rec["params"].values())
        assert "Sharding the offloaded Engram tables across DP replicas" in report["stderr"]  # upstream's warning


def flip_one_byte(path: Path, name: str) -> None:
    from pled.daemon.sources.safetensors_file import read_header

    t = next(t for t in read_header(str(path)).tensors if t.name == name)
    with open(path, "r+b") as f:
        f.seek(t.begin + t.nbytes // 2)
        b = f.read(1)
        f.seek(t.begin + t.nbytes // 2)
        f.write(bytes([b[0] ^ 0x10]))


def retype_scale(d: Path, name: str) -> None:
    """Make ``name`` (an Engram scale) F32 of the same shape: a scale vLLM would convert numerically."""
    from pled.daemon.sources.safetensors_file import read_header, write

    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    path = d / index[name]
    header = read_header(str(path))
    raw = path.read_bytes()
    tensors = []
    for t in header.tensors:
        data = raw[t.begin:t.begin + t.nbytes]
        if t.name == name:
            tensors.append((t.name, "F32", tuple(t.shape), data * 4))
        else:
            tensors.append((t.name, t.dtype, tuple(t.shape), data))
    write(str(path), tensors)


def test_refusals_name_the_tensor_in_one_line(served, tmp_path):
    pled, ck, config = served
    changed, cast = tmp_path / "changed", tmp_path / "cast"
    shutil.copytree(ck, changed)
    shutil.copytree(ck, cast)
    index = json.loads((changed / "model.safetensors.index.json").read_text())["weight_map"]
    flip_one_byte(changed / index["layers.3.engram.embed.weight"], "layers.3.engram.embed.weight")
    retype_scale(cast, "layers.1.engram.embed.scale")
    on = {"PLED_SOCKET": pled.socket}
    wrong = [n + 6 for n in config["engram_num_embeddings"]]
    cases = [
        {"name": "changed", "checkpoint": str(changed), "env": on},
        {"name": "cast", "checkpoint": str(cast), "env": on},
        {"name": "dummy", "env": on, "load_config": {"load_format": "dummy"}},
        {"name": "heads", "env": on, "config": {"engram_vocab_size": CONFIG["engram_vocab_size"] * 2}},
        {"name": "rows", "env": on, "config": {"engram_num_embeddings": wrong}},
    ]
    (report,) = run_world(1, 1, str(ck), cases)
    errors = {c: report["cases"][c].get("error", "") for c in ("changed", "cast", "dummy", "heads", "rows")}
    for case, error in errors.items():
        assert error and "\n" not in error, (case, report["cases"][case])
    assert "layers.3.engram.embed.weight differs from the rows pled's region holds" in errors["changed"]
    assert "layers.1.engram.embed.scale is torch.float32" in errors["cast"] and "a cast" in errors["cast"]
    assert "load_format=dummy would write vLLM's dummy values into pled's sealed Engram table" in errors["dummy"]
    # head sizes the config draws larger than the checkpoint's rows: upstream's own assertion, raised in vLLM
    assert errors["heads"].startswith("AssertionError"), errors["heads"]
    assert "assert sum(head_sizes) <= num_embeddings" in report["cases"]["heads"]["traceback"]
    assert "pled/client" not in report["cases"]["heads"]["traceback"]
    assert f"vLLM builds an Engram layer of {wrong[0]} rows x 256" in errors["rows"]
    assert "not this model's checkpoint" in errors["rows"]


def test_where_pled_is_off_vllms_own_path_is_unchanged(served):
    """The same TP = 2 build with pled's plugin absent, installed but not configured, and configured but left out by
    VLLM_PLUGINS: the same bytes, none of them a view of pled's, nothing registered by pled."""
    pled, ck, _ = served
    case = [{"name": "pled", "upstream": False}]
    runs = {
        "absent": run_world(1, 2, str(ck), case, env={"VLLM_PLUGINS": "", "PLED_AUTOLOAD": "0"}, load_plugins=False),
        "not configured": run_world(1, 2, str(ck), case),
        "left out": run_world(1, 2, str(ck), [c | {"env": {"PLED_SOCKET": pled.socket}} for c in case],
                              env={"VLLM_PLUGINS": "another"}),
    }
    assert runs["absent"][0]["seams"] == {"allocate": False, "uva": False, "share": False}
    assert runs["not configured"][0]["seams"] == {"allocate": True, "uva": True, "share": True}
    for k, reports in runs.items():
        for rank, report in enumerate(reports):
            rec = report["cases"]["pled"]
            assert "error" not in rec, rec.get("traceback")
            base = runs["absent"][rank]["cases"]["pled"]
            for layer, lrec in rec["layers"].items():
                for name, p in lrec["params"].items():
                    assert p["digest"] == base["layers"][layer]["params"][name]["digest"], (k, layer, name)
                    assert "expected" not in p and "memfd" not in p["mapping"], (k, p)
            assert rec["calls"] == [], k
    assert "VLLM_PLUGINS='another' leaves pled out" in runs["left out"][0]["stderr"]


def test_a_rank_in_a_memory_cgroup_smaller_than_its_table_loads(memcg, tmp_path, daemon):
    """A TP = 1 rank (all of both tables: ~1 GiB) in a v1 memory cgroup of 900 MiB, vLLM's interpreter included:
    it builds and loads, and is never OOM-killed; the table stays charged to pled's cgroup, not the rank's."""
    big = {"engram_layer_ids": [1, 3], "engram_max_ngram_size": 2, "engram_n_heads": 2, "engram_head_dim": 256,
           "engram_vocab_size": 1_000_000}  # 2 heads of ~1 M rows a layer: 2 x 528 MB
    _, config = make_engram_checkpoint(str(tmp_path / "m"), big, files=2)
    table = sum(config["engram_num_embeddings"]) * 264
    limit = 900 * MiB
    assert table > limit
    pled = daemon({"big": {"checkpoint": tmp_path / "m"}})
    cg = memcg(limit)
    (report,) = run_world(1, 1, str(tmp_path / "m"), [{"name": "pled", "env": {"PLED_SOCKET": pled.socket},
                                                      "uva": True}], prefix=join_and_exec(cg))
    case = report["cases"]["pled"]
    assert "error" not in case, case.get("traceback")
    assert oom_kills(cg) == 0
    peak = int((cg / "memory.max_usage_in_bytes").read_text())
    assert peak <= limit
    for rec in case["layers"].values():
        assert all(p["mapping"].startswith("r--s /memfd:pled:big") for p in rec["params"].values())
    shmem = next(int(line.split()[1]) for line in (cg / "memory.stat").read_text().splitlines()
                 if line.startswith("total_shmem "))
    assert shmem < table / 10  # the table's pages are charged where pled staged them
