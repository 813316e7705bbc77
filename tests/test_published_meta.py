"""The published sidecars' META.json ({"layout": "group16_int4_fp16scale_lownibblefirst", "shards": 128,
"rows": 320001536, "width": 160, ...}): accepted by `pled inspect` and `pled serve` for all three layouts,
refused where it contradicts the shards, a layout string read by its family words."""
import json

import pytest

from harness import LAYOUTS, run_pled, write_config
from pled.daemon.sources.sidecar import open_table
from pled.daemon.sources.sidecar_meta import META_LAYOUT, PUBLISHED_LAYOUT, layout_family
from pled.shared.errors import SidecarError

# The published strings. fp8's exact string is unknown (any with e4m3 and without e2m1 is fp8): its entry here is a
# stand-in of the published style, not the published string.
PUBLISHED = {"ples_int4": "group16_int4_fp16scale_lownibblefirst",
             "ples_nvfp4": "group16_e2m1_e4m3scale_lownibblefirst", "ples_fp8": "rowwise_e4m3_fp32scale"}


def edit_meta(d, **changes):
    meta = json.loads((d / "META.json").read_text())
    meta.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del meta[k]
    (d / "META.json").write_text(json.dumps(meta))
    return meta


def test_make_sidecar_writes_the_published_form(tmp_path):
    r = run_pled("make-sidecar", tmp_path / "s", "--layout", "ples_int4", "--shards", "3", "--rows", "40")
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "s" / "META.json").read_text())
    assert {k: meta[k] for k in ("layout", "shards", "rows", "width")} == {
        "layout": "group16_int4_fp16scale_lownibblefirst", "shards": 3, "rows": 120, "width": 160}
    assert not {"num_shards", "total_rows", "row_width"} & set(meta)
    assert PUBLISHED_LAYOUT == {k: PUBLISHED[k] for k in ("ples_int4", "ples_nvfp4")}  # the known ones only


def test_make_sidecar_marks_its_fp8_layout_string_as_its_own(tmp_path):
    r = run_pled("make-sidecar", tmp_path / "s", "--layout", "ples_fp8", "--shards", "2", "--rows", "40")
    assert r.returncode == 0, r.stderr
    assert "layout string 'pled_rowwise_e4m3_fp32scale' (pled's own: the published fp8 string is not known)" in r.stdout
    meta = json.loads((tmp_path / "s" / "META.json").read_text())
    assert meta["layout"] == META_LAYOUT["ples_fp8"] == "pled_rowwise_e4m3_fp32scale"
    assert "ples_fp8" not in PUBLISHED_LAYOUT and layout_family(meta["layout"]) == "ples_fp8"
    r = run_pled("inspect", tmp_path / "s")
    assert r.returncode == 0 and "WARNING" not in r.stderr, r.stderr
    assert 'layout = "pled_rowwise_e4m3_fp32scale", shards = 2, rows = 80, width = 160' in r.stdout


FP8_STRINGS = ["rowwise_e4m3_fp32scale", "E4M3_rowwise", "fp8-e4m3fn", "FP8_E4M3FN", "e4m3",
               "pled_rowwise_e4m3_fp32scale"]


@pytest.mark.parametrize("text", FP8_STRINGS)
def test_any_string_naming_e4m3_reads_as_fp8(sidecar, caplog, text):
    assert layout_family(text) == "ples_fp8"
    d = sidecar("ples_fp8", shards=2, rows=16)
    edit_meta(d, layout=text)
    with caplog.at_level("WARNING"):
        assert open_table(str(d)).layout == "ples_fp8"
    assert not caplog.records
    d = sidecar("ples_int4", shards=2, rows=16)  # e4m3 names fp8: an int4 sidecar that says so is refused
    edit_meta(d, layout=text)
    with pytest.raises(SidecarError, match=f"says layout = '{text}', which is ples_fp8, but the shards hold ples_int4"):
        open_table(str(d))


@pytest.mark.parametrize("text, family", [("GROUP16_E2M1_E4M3SCALE", "ples_nvfp4"), ("e2m1", "ples_nvfp4"),
                                          ("Group16_INT4", "ples_int4"), ("ples_fp8", "ples_fp8"), ("fp8", None),
                                          ("e5m2_rowwise", None)])
def test_family_words_in_any_case_e2m1_before_e4m3(text, family):
    assert layout_family(text) == family


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_and_serve_accept_the_published_form(sidecar, daemon, layout):
    d = sidecar(layout, shards=3, rows=64)
    edit_meta(d, layout=PUBLISHED[layout], quant_group=16, source_model="Qwen3.8-Flash-Next", digests=None)
    r = run_pled("inspect", d)
    assert r.returncode == 0, r.stderr
    assert f"layout     {layout}" in r.stdout
    assert f'layout = "{PUBLISHED[layout]}", shards = 3, rows = 192, width = 160' in r.stdout
    assert 'source_model = "Qwen3.8-Flash-Next"' in r.stdout and "quant_group = 16" in r.stdout  # other keys shown
    j = json.loads(run_pled("inspect", d, "--json").stdout)
    assert j["meta"]["source_model"] == "Qwen3.8-Flash-Next" and j["layout"] == layout
    pled = daemon({layout: d})
    assert f"table {layout}" in pled.log() or layout in pled.log()
    st = json.loads(run_pled("status", "--json", "--socket", pled.socket).stdout)
    assert [t["table"] for t in st["tables"]] == [layout]


@pytest.mark.parametrize("key, value", [("rows", 193), ("width", 128), ("shards", 4), ("rows", "192")])
@pytest.mark.daemon
def test_a_contradicting_count_is_refused_naming_the_key(sidecar, tmp_path, key, value):
    d = sidecar("ples_int4", shards=3, rows=64)
    edit_meta(d, **{key: value})
    r = run_pled("inspect", d)
    assert r.returncode == 78
    assert f"META.json: says {key} = {value!r}" in r.stderr and "the shards give" in r.stderr
    r = run_pled("serve", "-c", write_config(tmp_path / "p.toml", {"t": d}, headroom_margin=0))
    assert r.returncode == 78 and f"says {key} = {value!r}" in r.stderr


@pytest.mark.parametrize("layout, says", [("ples_int4", "group16_e2m1_e4m3scale_lownibblefirst"),
                                          ("ples_nvfp4", "group16_int4_fp16scale_lownibblefirst"),
                                          ("ples_fp8", "group16_e2m1_e4m3scale_lownibblefirst"),
                                          ("ples_nvfp4", "rowwise_e4m3_fp32scale")])
@pytest.mark.daemon
def test_layout_words_that_contradict_the_tensors_are_refused(sidecar, tmp_path, layout, says):
    d = sidecar(layout, shards=2, rows=32)
    edit_meta(d, layout=says)
    r = run_pled("inspect", d)
    assert r.returncode == 78
    assert (f"META.json: says layout = '{says}', which is {layout_family(says)}, "
            f"but the shards hold {layout}") in r.stderr
    r = run_pled("serve", "-c", write_config(tmp_path / "p.toml", {"t": d}, headroom_margin=0))
    assert r.returncode == 78 and "but the shards hold" in r.stderr


def test_an_unknown_layout_string_is_a_warning_and_the_tensors_decide(sidecar):
    d = sidecar("ples_nvfp4", shards=2, rows=32)
    edit_meta(d, layout="group16_mystery_lownibblefirst")
    r = run_pled("inspect", d)
    assert r.returncode == 0, r.stderr
    assert "layout     ples_nvfp4" in r.stdout
    assert "WARNING" in r.stderr and "'group16_mystery_lownibblefirst' names no known family" in r.stderr


def test_pleds_earlier_keys_are_still_accepted_and_checked(sidecar):
    d = sidecar("ples_fp8", shards=2, rows=32)
    edit_meta(d, layout="ples_fp8", num_shards=2, total_rows=64, row_width=160, shards=None, rows=None, width=None)
    r = run_pled("inspect", d)
    assert r.returncode == 0, r.stderr
    assert ('layout = "ples_fp8", num_shards = 2, total_rows = 64, row_width = 160 '
            '(checked against the shards)') in r.stdout
    edit_meta(d, total_rows=65)
    r = run_pled("inspect", d)
    assert r.returncode == 78 and "says total_rows = 65 but the shards give 64" in r.stderr
    edit_meta(d, total_rows=64, layout="ples_int4")
    r = run_pled("inspect", d)
    assert r.returncode == 78
    assert "says layout = 'ples_int4', which is ples_int4, but the shards hold ples_fp8" in r.stderr
