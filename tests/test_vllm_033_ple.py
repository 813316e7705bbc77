"""vLLM 0.33's own PLE path (Qwen4ExpPLEPinnedHostEmbedding) on pled's sealed pages, with the real vLLM 0.33 modules.

A real `pled serve` holds three synthetic Qwen4Exp checkpoints (bf16, fp8, nvfp4) as `checkpoint` tables: two PLE
layers each, of different row counts (vLLM's own prime vocabularies), 512 shard tensors per table as vLLM splits
them (the last partial, the trailing ones empty), spread unaligned over three files with an index. Real gloo worlds
of 1, 2 and 3 processes (tests/vllm_env/ple_rank.py) build every dtype and layer with vLLM 0.33's classes,
VllmConfig, EngramConfig(cpu_offload=True) and Qwen4ExpTextConfig, load them with vLLM's own load_weights from
vLLM's own weight iterator, and build each table again as vLLM does without pled.

FAKED, because this machine has no GPU: the CUDA registration call (a fake runtime records it), Tensor.is_pinned for
the registered ranges, the UVA view (a private copy for what is not pinned, as the real helper makes one), and
upstream's pin_memory. Everything up to those calls is vLLM's and pled's own.

Skipped, with the reason, where .venv-vllm or the 0.33.0 copy is missing (`make test` makes both).
"""
import json
import os
import shutil
from pathlib import Path

import pytest

import harness
from pled.generator import make_checkpoint, shard_rows
from vllm_env.ple_world import VLLM_033, run_world, sizes

PAGE = os.sysconf("SC_PAGE_SIZE")
DTYPES = ("bf16", "fp8", "nvfp4")
# 4 n-gram heads of 64 columns; ~400k rows a layer; a divisor that 1, 2 and 3 ranks divide; 1,000 shards, so that
# each layer's last shards are empty and the one before them partial (vLLM's ceil(rows / parts) each, then the rest)
TEXT = {"ngram_size": 3, "heads_per_ngram": 2, "ple_embed_dim": 256, "ngram_vocab_size_base": 100_000,
        "make_ngram_vocab_size_divisible_by": 6, "split_ngram_parts": 1000, "eos_token_id": 1, "vocab_size": 1000}
LAYERS = [0, 1]
PREFIX0 = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding"
PINNED = {"bf16": ["weight"], "fp8": ["weight"], "nvfp4": ["weight", "weight_scale"]}
LOADED = {"bf16": ["ngram_embedding.weight"], "fp8": ["ngram_embedding.weight", "ngram_embedding.weight_scale"],
          "nvfp4": ["ngram_embedding.weight", "ngram_embedding.weight_scale", "ngram_embedding.weight_scale_2"]}

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.daemon, pytest.mark.timeout(1800),
              pytest.mark.skipif(not (VLLM_033 / ".ready").exists(),
                                 reason="no .cache/vllm-0.33.0: run `make test` (it installs it there)")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The three checkpoints, with vLLM's own row counts, and a pled serving them: (pled, {dtype: dir}, rows)."""
    harness.require_marker("daemon", "this module's fixture starts pled")
    d = tmp_path_factory.mktemp("ple033")
    rows = sizes(TEXT, LAYERS)
    assert len(set(rows.values())) == len(rows)  # each layer's table has its own row count
    for n in rows.values():  # uneven shards: full ones, a partial one, then empty ones
        split = shard_rows(n, TEXT["split_ngram_parts"])
        assert split[-1] == 0 and 0 < min(r for r in split if r) < split[0], split[-5:]
    dirs = {}
    for dtype in DTYPES:
        dirs[dtype] = d / dtype
        make_checkpoint(str(dirs[dtype]), dtype, rows, width=TEXT["ple_embed_dim"] // 4,
                        parts=TEXT["split_ngram_parts"], files=3, seed=DTYPES.index(dtype))
    pled = harness.start(d, {dtype: {"checkpoint": dirs[dtype]} for dtype in DTYPES}, headroom_margin="64MiB")
    yield pled, dirs, rows
    pled.stop()


def slices(rec: dict) -> int:
    return sum(p["nbytes"] for p in rec["params"].values())


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_views_pleds_sealed_region_and_equals_upstreams_copy(served, world):
    pled, dirs, rows = served
    cases = [{"name": d, "dtype": d, "checkpoint": str(dirs[d]), "layers": LAYERS, "upstream": True,
              "env": {"PLED_SOCKET": pled.socket}} for d in DTYPES]
    for report in run_world(world, TEXT, cases):
        rank = report["rank"]
        assert report["etp"] == [rank, world]
        assert report["seams"] == {"allocate": True, "uva": True}
        for dtype in DTYPES:
            for layer in LAYERS:
                rec = report["cases"][dtype]["layers"][str(layer)]
                assert "error" not in rec, rec.get("traceback")
                assert rec["loaded"] == LOADED[dtype]  # vLLM's own load_weights ran to its end
                share = rows[layer] // world
                assert rec["rows_total"] == rows[layer] and rec["range"] == [rank * share, (rank + 1) * share]
                assert set(rec["params"]) == set(PINNED[dtype])
                for name, p in rec["params"].items():
                    # a view of pled's sealed memfd, its storage starting at this rank's rows, pinned
                    assert p["ptr"] == p["storage"] == p["expected"], (dtype, layer, name, p)
                    assert p["mapping"].startswith(f"r--s /memfd:pled:{dtype}"), p["mapping"]
                    assert p["pinned"] and p["shape"][0] == share
                    # registered once, Mapped|ReadOnly, over the page-rounded range that holds the slice
                    mine = [c for c in rec["calls"] if c[0] <= p["ptr"] < c[0] + c[1]]
                    assert len(mine) == 1, (name, rec["calls"])
                    start, length, flags = mine[0]
                    assert flags == 0x02 | 0x08 and start % PAGE == 0 and length % PAGE == 0
                    end = p["ptr"] + p["nbytes"]
                    assert start <= p["ptr"] and end <= start + length < end + PAGE
                assert len(rec["calls"]) == len(PINNED[dtype])  # and nothing else registered
                # byte for byte what vLLM builds for this rank without pled (every parameter, scales included)
                assert rec["equal_to_upstream"] == {n: True for n in rec["digests"]}, rec["equal_to_upstream"]
                # no private copy: the process's anonymous memory (RssAnon, measured after glibc gave back what was
                # freed) grew by less than half of the smallest slice, and the UVA helper copied nothing; upstream's
                # build, measured the same way, grew by its slices at least (its private pinned copy).
                # (New anonymous mappings are no measure: glibc moves memory between its heap and mappings.)
                smallest = min(p["nbytes"] for p in rec["params"].values())
                assert rec["rss_anon_growth"] < smallest / 2, (dtype, layer, rec["rss_anon_growth"], smallest)
                assert rec["uva_private_copies"] == []
                # (RssAnon counts whole pages, and what the process freed meanwhile: within 1% of the slices)
                assert rec["upstream_rss_anon_growth"] >= 0.99 * slices(rec), (dtype, layer,
                                                                                rec["upstream_rss_anon_growth"])
                assert rec["upstream_uva_private_copies"] == []  # pinned (faked as cudaHostAlloc'd): no further copy
        # every registration released once the tables are gone
        assert report["registered_calls"] == report["unregistered"] and report["still_registered"] == 0
        # the UVA helper, guarded: a slice of pled's region that is not pinned is refused, never copied
        assert report["guard"].startswith("PledUnavailable: pled: refusing vLLM's UVA view of a pled table"), \
            report["guard"]
        assert "differs" not in report["stderr"]


def test_refusals_name_the_tensor_or_the_device_and_the_fallback_warns_once(served, tmp_path, daemon):
    pled, dirs, rows = served
    other = tmp_path / "other-model"  # a checkpoint whose layer 0 has 6 rows more than this model's
    make_checkpoint(str(other), "fp8", {0: rows[0] + 6}, width=TEXT["ple_embed_dim"] // 4, parts=16, files=1)
    elsewhere = daemon({"other": {"checkpoint": other}})
    changed = tmp_path / "changed"
    shutil.copytree(dirs["nvfp4"], changed)
    index = json.loads((changed / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight"
    flip_one_byte(changed / index[name], name)
    on = {"PLED_SOCKET": pled.socket}
    cases = [
        {"name": "changed", "dtype": "nvfp4", "checkpoint": str(changed), "layers": [1], "env": on},
        {"name": "cast", "dtype": "bf16", "checkpoint": str(dirs["bf16"]), "layers": [0], "env": on,
         "params_dtype": "float16"},
        {"name": "refused", "dtype": "fp8", "checkpoint": str(dirs["fp8"]), "layers": [0], "env": on,
         "refuse": True},
        {"name": "read-only", "dtype": "fp8", "checkpoint": str(dirs["fp8"]), "layers": [1], "env": on,
         "read_only": False},
        {"name": "unpinned", "dtype": "fp8", "checkpoint": str(dirs["fp8"]), "layers": [0], "env": on,
         "pin": False},
        {"name": "rows", "dtype": "fp8", "checkpoint": str(other), "layers": [0],
         "env": {"PLED_SOCKET": elsewhere.socket}},
        {"name": "fallback", "dtype": "nvfp4", "checkpoint": str(dirs["nvfp4"]), "layers": LAYERS, "refuse": True,
         "env": on | {"PLED_FALLBACK": "disk"}, "upstream": True},
    ]
    (report,) = run_world(1, TEXT, cases)
    errors = {c: report["cases"][c]["layers"] for c in ("changed", "cast", "refused", "read-only", "unpinned", "rows")}
    for case, layers in errors.items():
        (rec,) = layers.values()
        assert "error" in rec and "\n" not in rec["error"], (case, rec)
    assert f"{name} differs from the rows pled's region holds" in errors["changed"]["1"]["error"]
    assert f"vLLM asks for model.layers.0.ple.ple_embedding.ngram_embedding (torch.float16, width 64, {rows[0]} " \
           "rows), but pled holds weight BF16 width 64 (table bf16), " in errors["cast"]["0"]["error"]
    assert ": a cast, and pled serves a PLE table only in its checkpoint's dtype" in errors["cast"]["0"]["error"]
    assert "cudaHostRegister(Mapped|ReadOnly) of model.language_model.layers.0" in errors["refused"]["0"]["error"]
    assert "device 0 (FakeGPU (no read-only registration)) cannot read model.language_model.layers.1" in \
        errors["read-only"]["1"]["error"]
    assert "read-only registration: no read-only host registration (cudaDevAttrHostRegisterReadOnlySupported = 0)" \
        in errors["read-only"]["1"]["error"] and "PLED_FALLBACK=disk" in errors["read-only"]["1"]["error"]
    assert "rows 0..400116 (table fp8) is not pinned after cudaHostRegister" in errors["unpinned"]["0"]["error"]
    assert f"pled holds {PREFIX0}.weight with {rows[0] + 6} rows (table other), but vLLM's " \
           f"model.layers.0.ple.ple_embedding.ngram_embedding has {rows[0]}: not this model's checkpoint" in \
        errors["rows"]["0"]["error"]
    for layer in LAYERS:  # the fallback: vLLM's own private copy, filled from pled's pages, equal to upstream's
        rec = report["cases"]["fallback"]["layers"][str(layer)]
        assert "error" not in rec and rec["equal_to_upstream"] == {n: True for n in rec["digests"]}
        assert all(not p.get("expected") for p in rec["params"].values())
    warned = [line for line in report["stderr"].splitlines() if "fallback = \"disk\"" in line]
    assert len(warned) == 1 and "cudaHostRegister" in warned[0], warned


def flip_one_byte(path: Path, name: str) -> None:
    from pled.daemon.sources.safetensors_file import read_header

    t = next(t for t in read_header(str(path)).tensors if t.name == name)
    with open(path, "r+b") as f:
        f.seek(t.begin + t.nbytes // 2)
        b = f.read(1)
        f.seek(t.begin + t.nbytes // 2)
        f.write(bytes([b[0] ^ 0x10]))


def test_where_pled_is_off_vllms_own_path_is_unchanged(served, tmp_path):
    """The same builds with pled's plugin absent, installed but not configured, configured but left out by
    VLLM_PLUGINS, and serving but holding no array for the layer: the same bytes, the same error without a faked
    pin_memory; none of them a view, none registered."""
    pled, dirs, _ = served
    cases = [{"name": "built", "dtype": "nvfp4", "checkpoint": str(dirs["nvfp4"]), "layers": [0]},
             {"name": "unpinnable", "dtype": "nvfp4", "checkpoint": str(dirs["nvfp4"]), "layers": [0],
              "fake_pin_memory": False}]
    runs = {
        "absent": run_world(1, TEXT, cases, env={"VLLM_PLUGINS": "", "PLED_AUTOLOAD": "0"}, load_plugins=False),
        "not configured": run_world(1, TEXT, cases),
        "left out": run_world(1, TEXT, [c | {"env": {"PLED_SOCKET": pled.socket}} for c in cases],
                              env={"VLLM_PLUGINS": "another"}),
    }
    built = {k: r[0]["cases"]["built"]["layers"]["0"] for k, r in runs.items()}
    unpinnable = {k: r[0]["cases"]["unpinnable"]["layers"]["0"] for k, r in runs.items()}
    assert runs["absent"][0]["seams"] == {"allocate": False, "uva": False}
    assert runs["not configured"][0]["seams"] == {"allocate": True, "uva": True}
    for k in runs:
        assert built[k]["digests"] == built["absent"]["digests"], k
        assert all("expected" not in p and "memfd" not in p["mapping"] for p in built[k]["params"].values()), k
        assert built[k]["calls"] == [], k
        assert "pin_memory=True requires" in unpinnable[k]["error"], unpinnable[k]
        assert unpinnable[k]["error"] == unpinnable["absent"]["error"], k
    assert "VLLM_PLUGINS='another' leaves pled out" in runs["left out"][0]["stderr"]
    # serving, but no array for this layer (layer 2 is not in the checkpoint): vLLM's own allocation
    (report,) = run_world(1, TEXT, [{"name": "other layer", "dtype": "nvfp4", "checkpoint": str(dirs["nvfp4"]),
                               "layers": [2], "env": {"PLED_SOCKET": pled.socket}}])
    rec = report["cases"]["other layer"]["layers"]["2"]
    assert "error" not in rec and rec["calls"] == [] and all("expected" not in p for p in rec["params"].values())


def test_configured_but_unreachable_fails_the_load_with_pleds_message_or_falls_back_once(served, tmp_path):
    _, dirs, _ = served
    dead = str(tmp_path / "dead.sock")
    case = {"name": "dead", "dtype": "fp8", "checkpoint": str(dirs["fp8"]), "layers": LAYERS,
            "env": {"PLED_SOCKET": dead}}
    (report,) = run_world(1, TEXT, [case])
    for layer in LAYERS:
        error = report["cases"]["dead"]["layers"][str(layer)]["error"]
        assert "PledUnavailable" in error and dead in error and "PLED_FALLBACK=disk" in error, error
    (report,) = run_world(1, TEXT, [case | {"env": case["env"] | {"PLED_FALLBACK": "disk"}, "upstream": True}])
    for layer in LAYERS:
        rec = report["cases"]["dead"]["layers"][str(layer)]
        assert "error" not in rec and rec["equal_to_upstream"] == {n: True for n in rec["digests"]}
    assert sum("cannot attach" in line for line in report["stderr"].splitlines()) == 1  # one warning a process


ATS = {"99": 1, "113": 0, "88": 1, "100": 1}  # Grace / GB10: pageable memory through the host's page tables
BARE = {"99": 1, "113": 0, "88": 0, "100": 0}  # B300, RTX PRO 6000 without HMM: registration, not read-only


def test_the_seam_takes_each_gpu_route_and_never_a_private_copy(served, tmp_path, daemon):
    """vLLM 0.33's own PLE classes through each of pled.client.gpu's routes, only CUDA faked (the device's attributes
    and registration results: pled.client.gpu.use(FakeCuda())): read-only registration refused with 801 then pageable
    access (ATS), pageable access outright, and the writable route from a writer of a gpu_access = "writable" table.
    Each rank's tables are pled's pages, equal to upstream's, and what vLLM's lookup reads (its UVA views) is at
    pled's address: on the pageable route nothing is registered and no anonymous mapping as large as a slice
    appears; on the writable route the whole mapping is registered Mapped, then made read-only in this process."""
    pled, dirs, _ = served
    writable = daemon({"w": {"checkpoint": dirs["nvfp4"], "gpu_access": "writable", "writers": [os.geteuid()],
                             "verify_interval": 3600}}, headroom_margin="64MiB")
    on = {"PLED_SOCKET": pled.socket}
    cases = [{"name": f"pageable {d}", "dtype": d, "checkpoint": str(dirs[d]), "layers": [0], "env": on,
              "attrs": ATS, "upstream": True} for d in DTYPES]
    cases += [{"name": "801 then pageable", "dtype": "fp8", "checkpoint": str(dirs["fp8"]), "layers": [1], "env": on,
               "attrs": ATS | {"113": 1}, "refuse": 801, "refuse_flags": [0x0A]},
              {"name": "writable", "dtype": "nvfp4", "checkpoint": str(dirs["nvfp4"]), "layers": LAYERS,
               "env": {"PLED_SOCKET": writable.socket}, "attrs": BARE, "upstream": True}]
    (report,) = run_world(1, TEXT, cases)
    for name, case in report["cases"].items():
        for layer, rec in case["layers"].items():
            assert "error" not in rec, (name, layer, rec.get("traceback"))
            if "equal_to_upstream" in rec:
                assert rec["equal_to_upstream"] == {n: True for n in rec["digests"]}, (name, rec["equal_to_upstream"])
            assert rec["uva_private_copies"] == [], name
            for pname, p in rec["params"].items():
                assert p["ptr"] == p["storage"] == p["expected"], (name, pname, p)
                assert p["uva"] == p["ptr"], (name, pname, p)  # the lookup reads pled's pages, at their address
            smallest = min(p["nbytes"] for p in rec["params"].values())
            if name == "writable":  # the whole mapping registered Mapped (no ReadOnly), then read-only here
                assert all(p["pinned"] and p["mapping"].startswith("r--s /memfd:pled:w") for p in
                           rec["params"].values()), rec["params"]
                assert all(flags == 0x02 for _, _, flags in rec["calls"]), rec["calls"]
            else:  # pageable: nothing registered, no copy, the device view made at the host address
                assert not any(p["pinned"] for p in rec["params"].values()), (name, rec["params"])
                # the 801 case: read-only registration tried once for the table, refused, never tried again
                assert [c[2] for c in rec["calls"]] == ([0x0A] if name.startswith("801") else []), (name, rec["calls"])
                assert sorted(a[0] for a in rec["aliases"]) == sorted(p["ptr"] for p in rec["params"].values())
                assert all(n < smallest for n in rec["new_anonymous_mappings"]), (name, rec["new_anonymous_mappings"])
                assert rec["rss_anon_growth"] < smallest / 2, (name, rec["rss_anon_growth"], smallest)
    calls = [c for layer in report["cases"]["writable"]["layers"].values() for c in layer["calls"]]
    assert len(calls) == 1 and calls[0][2] == 0x02, calls  # the whole mapping once, for both layers' four slices
    lines = [x for x in report["stderr"].splitlines() if "pled: rank 0: " in x]
    assert sum(": pageable access on device 0 (FakeGPU)" in x for x in lines) == \
        sum(len(PINNED[d]) for d in DTYPES) + 1, lines  # one line per slice: each dtype's layer 0, the 801 case
    assert sum(": writable registration on device 0 (FakeGPU)" in x and "writable by its writers" in x
               for x in lines) == 2 * len(LAYERS), lines
    assert sum("trying the next route" in x and "fake error 801" in x for x in report["stderr"].splitlines()) == 1
