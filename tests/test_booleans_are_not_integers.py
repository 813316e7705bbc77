"""Issue 48, class 6: JSON's (and TOML's) booleans are not integers. Python's ``bool`` is an ``int``, so a parser that
asks ``isinstance(v, int)`` (or pydantic's lax ``int``) takes ``true`` for 1 and ``false`` for 0. Wherever pled
parses a number from a file or a peer (a safetensors header, META.json, a region's manifest on the server's side
and the client's, the Attach reply, the config), ``true``/``false`` in its place is refused, as safetensors' own
reader refuses them.

The property is checked over every integer field of each parser's well-formed input: each integer in turn is
replaced by ``true`` and by ``false`` (the rest kept, so that ``true`` in place of a 1 leaves an input that would
otherwise be consistent), and the parser must refuse it with its documented error. On the pled this was filed
against, the config took ``fdstore_max = true``, ``allow_uids = [true]`` and ``allow_groups = [false]``.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterator

import pytest

from pled.daemon import config
from pled.daemon.sources import checkpoint, safetensors_file, sidecar_meta
from pled.daemon.sources.sidecar import open_table
from pled.generator import make_checkpoint, make_sidecar
from pled.shared import region
from pled.shared.errors import ConfigError, SidecarError
from test_client_untrusted import attach_reply, manifest, memfd, refused


def int_paths(doc: object, at: tuple = ()) -> Iterator[tuple]:
    """Where ``doc`` holds an integer (not a boolean): each a path of keys and indexes."""
    if type(doc) is int:
        yield at
    elif isinstance(doc, dict):
        for k, v in doc.items():
            yield from int_paths(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from int_paths(v, (*at, i))


def with_value(doc: object, at: tuple, value: object) -> object:
    out = copy.deepcopy(doc)
    target = out
    for step in at[:-1]:
        target = target[step]  # type: ignore[index]
    target[at[-1]] = value  # type: ignore[index]
    return out


def each_boolean(doc: object) -> list[tuple[tuple, bool]]:
    cases = [(at, b) for at in int_paths(doc) for b in (True, False)]
    assert cases, "the document holds no integer: the property checks nothing"
    return cases


# -- a safetensors header ---------------------------------------------------------------------------------------

HEADER = {"a": {"dtype": "U8", "shape": [1, 2], "data_offsets": [0, 2]},
          "b": {"dtype": "U8", "shape": [1], "data_offsets": [2, 3]},
          "c": {"dtype": "U8", "shape": [0, 4], "data_offsets": [3, 3]}}


def _parse_header(doc: dict):
    raw = json.dumps(doc).encode()
    return safetensors_file.parse_header("/m/shard_0.safetensors", 8 + len(raw) + 3, raw)


def test_header_control_is_accepted():
    assert [t.name for t in _parse_header(HEADER).tensors] == ["a", "b", "c"]


@pytest.mark.parametrize("at, value", each_boolean(HEADER))
def test_a_boolean_in_a_headers_shape_or_offsets_is_refused(at, value):
    with pytest.raises(SidecarError, match="shape|data_offsets") as err:
        _parse_header(with_value(HEADER, at, value))
    assert str(err.value).startswith("/m/shard_0.safetensors: ")


# -- META.json ----------------------------------------------------------------------------------------------------

META = {"layout": "ples_int4", "shards": 2, "rows": 128, "width": 160, "num_shards": 2, "total_rows": 128,
        "row_width": 160}


def test_meta_control_is_accepted():
    sidecar_meta.check("/s/META.json", META, "ples_int4", 2, 128, 160)


@pytest.mark.parametrize("at, value", each_boolean(META))
def test_a_boolean_count_in_meta_json_is_refused(at, value):
    with pytest.raises(SidecarError, match="not a whole number"):
        sidecar_meta.check("/s/META.json", with_value(META, at, value), "ples_int4", 2, 128, 160)


def test_a_sidecar_whose_meta_json_says_shards_true_is_refused_naming_it(tmp_path):
    """The whole path, not the check alone: a one-shard sidecar whose META.json says ``"shards": true`` (== 1)."""
    make_sidecar(str(tmp_path / "s"), "ples_int4", shards=1, rows=16)
    meta = tmp_path / "s" / "META.json"
    doc = json.loads(meta.read_text()) if meta.exists() else {}
    meta.write_text(json.dumps({**doc, "shards": True}))
    with pytest.raises(SidecarError, match="says shards = True, not a whole number") as err:
        open_table(str(tmp_path / "s"))
    assert str(err.value).startswith(str(meta))


# -- the index -------------------------------------------------------------------------------------------------

def test_a_boolean_for_a_file_name_in_the_index_is_refused():
    name = "m.ple.ple_embedding.ngram_embedding.shard_0.weight"
    for value in (True, False, 1):
        with pytest.raises(SidecarError, match="weight_map"):
            checkpoint.parse_index("/m/model.safetensors.index.json",
                                   json.dumps({"weight_map": {name: value}}).encode())


# -- a region's manifest (the server's plan, read back by pled at adoption and by every client) -------------------

def _manifests(tmp_path) -> dict[str, dict]:
    make_sidecar(str(tmp_path / "s"), "ples_int4", shards=2, rows=16)
    make_checkpoint(str(tmp_path / "c"), "nvfp4", {0: 40, 1: 50}, width=32, parts=2, files=2)
    files = region.plan("s", open_table(str(tmp_path / "s")))
    arrays = region.plan("c", checkpoint.open_checkpoint(str(tmp_path / "c")))
    return {"files": json.loads(files.to_json()), "arrays": json.loads(arrays.to_json())}


@pytest.mark.parametrize("form", ["files", "arrays"])
def test_a_boolean_anywhere_a_manifest_holds_an_integer_is_refused(tmp_path, form):
    doc = _manifests(tmp_path)[form]
    assert region.Manifest.from_json(json.dumps(doc).encode()).to_json() == json.dumps(
        doc, separators=(",", ":"), sort_keys=True).encode()  # the control: accepted, and read back the same
    accepted = []
    cases = each_boolean(doc)
    for at, value in cases:
        try:
            region.Manifest.from_json(json.dumps(with_value(doc, at, value)).encode())
        except ValueError:
            continue
        accepted.append((at, value))
    assert not accepted, f"{len(accepted)} of {len(cases)} booleans accepted as integers: {accepted[:5]}"


@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_generation_in_an_attach_reply_is_refused_by_the_client(tmp_path, value):
    refused(tmp_path, memfd(region.encode_header(manifest())), "ProtocolError", "not a count",
            attach_reply(generation=value))


# -- the config ----------------------------------------------------------------------------------------------------

TABLE = '[[table]]\nname = "t"\npath = "/srv/t"\n'
CONFIG_INTS = {  # every key the config reads a number from -> the line with a well-formed value, then the key
    "fdstore_max": "fdstore_max = {}\n",
    "allow_uids": "allow_uids = [{}]\n",
    "allow_groups": "allow_groups = [{}]\n",
    "headroom_margin": "headroom_margin = {}\n",
    "staging_bandwidth": "staging_bandwidth = {}\n",
    "metrics_interval": "metrics_interval = {}\n",
    "numa": "numa = [{}]\n",
    "table numa": None,
}


def _config(key: str, value: str) -> str:
    if key == "table numa":
        return f'[[table]]\nname = "t"\npath = "/srv/t"\nnuma = [{value}]\n'
    return CONFIG_INTS[key].format(value) + TABLE  # type: ignore[union-attr]


@pytest.mark.parametrize("key", list(CONFIG_INTS))
def test_a_boolean_for_a_number_in_the_config_is_refused_naming_the_key(key):
    control = config.parse(_config(key, "1" if key != "metrics_interval" else "15"), "/etc/pled/pled.toml")
    assert control is not None
    for value in ("true", "false"):
        with pytest.raises(ConfigError) as err:
            config.parse(_config(key, value), "/etc/pled/pled.toml")
        assert str(err.value).startswith("/etc/pled/pled.toml: ") and key.split()[-1] in str(err.value), err.value
        assert "\n" not in str(err.value)
        # One complaint, not one per member of a union ("key numa.literal[...]: ...; key numa.tuple[int, ...][0]:
        # ..."), which is what pydantic says where no before-validator refuses the boolean first.
        assert str(err.value).count("key ") == 1, err.value
