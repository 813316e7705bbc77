"""Issue 44, finding 1: every name, number and shape pled reads from a checkpoint's files (its index, its headers)
goes through one total parser, which returns a value or pled's own refusal naming the file; never another
exception. On the pled this was filed against, an index key ``…ngram_embedding.shard_1000000000.weight`` or
``…shard_².weight`` made `pled inspect --checkpoint` and `pled serve` end in a traceback (exit 1, a restart every
2 s under pled.service), and a reload onto it logged one: ``checkpoint.ple_name``'s refusal was caught for header
names only.

The properties run the parsers themselves over generated names, numbers and documents (Hypothesis); the commands
are then run for real (`pled inspect`, `pled serve`, a reload of a running pled) on the shapes that broke them.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import harness
from pled.daemon.sources import checkpoint, safetensors_file
from pled.daemon.sources.safetensors_file import write
from pled.generator import make_checkpoint
from pled.shared import arrays
from pled.shared.boundary import ascii_count
from pled.shared.errors import SidecarError

PREFIX = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding"
INDEX = "/ck/model.safetensors.index.json"
HEADER = "/ck/model-00001-of-00001.safetensors"
# What a shard number may be written as: ASCII digits of any length (ten and more too), digits of other scripts
# (str.isdigit takes '²' and '١'; int() refuses the one and reads the other), signs, spaces, nothing.
DIGITS = st.text(st.sampled_from("0123456789²³¹١٢߀०𝟘𝟙\u0663"), min_size=1, max_size=14)
NUMBER = st.one_of(DIGITS, st.integers(0, 10**12).map(str), st.text(max_size=12), st.sampled_from(["", "-1", "+1",
                                                                                                   " 1", "1_0"]))
PARAM = st.sampled_from([*arrays.PARAMS, "weight_scale_2", "bias", "", "weight.x"])
NAME = st.one_of(
    st.builds(lambda n, p: f"{PREFIX}.shard_{n}.{p}", NUMBER, PARAM),
    st.builds(lambda p: f"{PREFIX}.{p}", PARAM),
    st.builds(lambda a, b: f"{a}{arrays.SUFFIX}.{b}", st.text(max_size=20), st.text(max_size=20)),
    st.text(max_size=40),
)
FILENAME = st.one_of(st.just("model-00001-of-00001.safetensors"),
                     st.sampled_from(["", ".", "..", "a/b", "\0", "\ud800"]), st.text(max_size=20))


def _value_or_refusal(call, path: str):
    """What a total parser may do: return, or refuse with one line that names ``path``."""
    try:
        return call()
    except SidecarError as err:
        text = str(err)
        assert text.startswith(path + ": ") and "\n" not in text, text
        return err


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(NAME, st.one_of(FILENAME, st.integers(), st.booleans(), st.none()), max_size=6))
def test_the_index_parser_returns_a_value_or_refuses_naming_the_index(weight_map):
    for doc in ({"weight_map": weight_map}, weight_map, {"metadata": {}, "weight_map": weight_map}):
        raw = json.dumps(doc).encode()
        got = _value_or_refusal(lambda: checkpoint.parse_index(INDEX, raw), INDEX)  # noqa: B023
        if isinstance(got, dict):  # accepted: each file named plainly, each tensor a PLE tensor pled takes
            for filename, names in got.items():
                assert filename and "/" not in filename and filename not in (".", "..") and "\0" not in filename
                filename.encode("utf-8")
                assert all(checkpoint.ple_name(n, INDEX) is not None for n in names)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_the_index_parser_refuses_any_bytes_naming_the_index(raw):
    _value_or_refusal(lambda: checkpoint.parse_index(INDEX, raw), INDEX)


def _header_bytes(names: list[str]) -> bytes:
    doc, offset = {}, 0
    for name in names:
        doc[name] = {"dtype": "U8", "shape": [2, 4], "data_offsets": [offset, offset + 8]}
        offset += 8
    raw = json.dumps(doc).encode()
    return raw


@settings(max_examples=300, deadline=None)
@given(st.lists(NAME, max_size=6, unique=True))
def test_a_headers_names_are_read_by_the_same_total_parser(names):
    """The header, then the checkpoint's reading of each tensor's name (what open_checkpoint does with them)."""
    raw = _header_bytes(names)

    def read():
        header = safetensors_file.parse_header(HEADER, 8 + len(raw) + 8 * len(names), raw)
        return [checkpoint.ple_name(t.name, HEADER) for t in header.tensors]

    _value_or_refusal(read, HEADER)


@given(NUMBER)
def test_a_shard_number_is_a_short_ascii_count_or_refused(number):
    name = f"{PREFIX}.shard_{number}.weight"
    got = _value_or_refusal(lambda: checkpoint.ple_name(name, INDEX), INDEX)
    if isinstance(got, tuple):
        assert number.isascii() and number.isdigit() and got[1] == int(number) < 10**9
    elif isinstance(got, SidecarError):
        assert number.isdigit() and not (number.isascii() and int(number) < 10**9)
    else:  # not a PLE shard name at all: vLLM 0.33 skips it as well (str.isdigit)
        assert not number.isdigit()


@given(st.text(max_size=30), st.integers(1, 25))
def test_ascii_count_is_total(text, digits):
    got = ascii_count(text, digits)
    if got is None:
        assert not (text.isascii() and text.isdigit()) or len(text.lstrip("0")) > digits
    else:
        assert text.isascii() and text.isdigit() and got == int(text) and len(str(got)) <= max(1, digits)


# -- the commands, for real ---------------------------------------------------------------------------------------

BAD_KEYS = {"ten digits": f"{PREFIX}.shard_1000000000.weight", "a superscript digit": f"{PREFIX}.shard_\u00b2.weight",
            "an arabic-indic digit": f"{PREFIX}.shard_\u0661.weight"}


def _checkpoint_with_index_key(directory, key: str) -> str:
    make_checkpoint(str(directory), "fp8", {0: 100}, width=32, parts=4, files=2)
    index = directory / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"][key] = "model-00001-of-00002.safetensors"  # the key alone: no such tensor exists
    index.write_text(json.dumps(doc))
    return str(index)


def _refusal_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("case", list(BAD_KEYS))
def test_pled_inspect_refuses_an_index_key_it_does_not_take_with_78_naming_the_index(tmp_path, case):
    index = _checkpoint_with_index_key(tmp_path / "m", BAD_KEYS[case])
    out = harness.run_pled("inspect", "--checkpoint", tmp_path / "m")
    lines = _refusal_lines(out.stderr)
    assert out.returncode == 78 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(lines) == 1 and index in lines[0] and "below 10**9 only" in lines[0], out.stderr


def test_pled_inspect_refuses_a_header_name_it_does_not_take_with_78_naming_the_file(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    path = d / "model.safetensors"
    write(str(path), [(f"{PREFIX}.shard_0.weight", "U8", (4, 32), bytes(128)),
                      (BAD_KEYS["a superscript digit"], "U8", (4, 32), bytes(128))])
    out = harness.run_pled("inspect", "--checkpoint", path)
    lines = _refusal_lines(out.stderr)
    assert out.returncode == 78 and len(lines) == 1 and str(path) in lines[0], out.stderr


def test_pled_inspect_refuses_a_surrogate_file_name_in_the_index_naming_the_index(tmp_path):
    make_checkpoint(str(tmp_path / "m"), "fp8", {0: 100}, width=32, parts=4, files=1)
    index = tmp_path / "m" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"][f"{PREFIX}.shard_0.weight"] = "\ud800.safetensors"
    index.write_text(json.dumps(doc))  # json.dumps writes the lone surrogate as its escape: valid JSON
    out = harness.run_pled("inspect", "--checkpoint", tmp_path / "m")
    lines = _refusal_lines(out.stderr)
    assert out.returncode == 78 and len(lines) == 1 and str(index) in lines[0], out.stderr


@pytest.mark.daemon
@pytest.mark.parametrize("case", ["ten digits", "a superscript digit"])
def test_pled_serve_refuses_an_index_key_it_does_not_take_with_78(tmp_path, case):
    index = _checkpoint_with_index_key(tmp_path / "m", BAD_KEYS[case])
    config = harness.write_config(tmp_path / "pled.toml", {"ple": {"checkpoint": tmp_path / "m"}},
                                  socket=str(tmp_path / "pled.sock"))
    out = harness.run_pled("serve", "-c", config, timeout=60)
    assert out.returncode == 78 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert index in out.stderr and "below 10**9 only" in out.stderr, out.stderr


@pytest.mark.daemon
def test_a_reload_onto_such_an_index_logs_one_refusal_and_keeps_serving(tmp_path, sidecar, pleds):
    index = _checkpoint_with_index_key(tmp_path / "m", BAD_KEYS["ten digits"])
    pled = harness.start(tmp_path, {"t": sidecar(shards=2, rows=64)}, name="live")
    pleds.append(pled)
    config = tmp_path / "live.toml"
    config.write_text(config.read_text() + f'\n[[table]]\nname = "ple"\ncheckpoint = "{tmp_path / "m"}"\n')
    out = harness.run_pled("reload", "--socket", pled.socket, timeout=120)
    assert out.returncode == 1 and index in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    log = pled.log()
    assert "Traceback" not in log, log[-3000:]
    refusals = [line for line in log.splitlines() if index in line]
    assert len(refusals) == 1 and "below 10**9 only" in refusals[0], log[-3000:]
    status = harness.run_pled("status", "--json", "--socket", pled.socket)
    assert status.returncode == 0 and pled.poll() is None, status.stderr
    assert [t["table"] for t in json.loads(status.stdout)["tables"]] == ["t"], status.stdout


def test_make_fuzz_fuzzes_the_checkpoints_own_index_parser_from_seeds_of_the_keys_that_broke_it():
    """tests/parsers.py's "index" is checkpoint.parse_index (what `make fuzz` runs), refusing as SidecarError."""
    import parsers

    p = parsers.PARSERS["index"]
    raw = json.dumps({"weight_map": {key: "a.safetensors" for key in BAD_KEYS.values()}}).encode()
    refused = _value_or_refusal(lambda: p.parse(raw), "model.safetensors.index.json")
    assert isinstance(refused, SidecarError) and issubclass(SidecarError, p.errors), refused
    seeds = parsers.corpus("index")
    for key in ("shard_1000000000", "shard_\\u00b2"):
        assert any(key.encode() in s for s in seeds), key
    for seed in seeds:
        try:
            p.parse(seed)
        except p.errors:
            pass
