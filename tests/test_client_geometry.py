"""A region's geometry, checked by the client as the last line before a GPU reads its bytes (issue 44 finding 5,
issue 48 class 8), and by the daemon of its own plan.

Every bad manifest here is built by hand, one thing wrong in a manifest the checks accept (the control): arrays over
each other, over the header and manifest, or past the region's end; tensors of one shard over each other; negative
or boolean numbers. Each is refused by ``Manifest.from_json`` (a ValueError naming what is wrong) and through
``client.attach`` from a hostile server (tests/fakeserver.py: a real socket and a real sealed memfd), with every fd
that arrived closed. On main, arrays at one offset and tensors of one shard at one offset were both accepted.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import types
from dataclasses import replace

import pytest

from fakeserver import FakeServer
from pled.client.connection import BadRegion
from pled.client.library import attach
from pled.daemon.regions import planning
from pled.shared import region
from pled.shared.arrays import ArrayEntry
from pled.shared.errors import SidecarError
from pled.shared.region import _PREFIX, ALIGN, MAGIC, Manifest, ShardEntry, TensorEntry

FINGERPRINT = "f" * 64
PREFIX = "model.language_model.layers.{}.ple.ple_embedding.ngram_embedding"


def files_manifest() -> Manifest:
    """A generic table: one shard of 128 bytes at 2 MiB, two U8[64] tensors side by side."""
    shard = ShardEntry(0, "/srv/t/shard_0.safetensors", 128, 1, 2, 3, "a" * 64, ALIGN, 0, "")
    return Manifest("t", "safetensors", 0, 0, ALIGN, 2 * ALIGN, FINGERPRINT, (shard,),
                    (TensorEntry("a", 0, "U8", (64,), ALIGN, 64), TensorEntry("b", 0, "U8", (64,), ALIGN + 64, 64)))


def arrays_manifest() -> Manifest:
    """The arrays form: two layers' tables from one checkpoint file, each one U8[4, 16] tensor in its own array,
    the first at 2 MiB, the second at 4 MiB, in a 6 MiB region."""
    shard = ShardEntry(0, "/srv/m/model.safetensors", 1000, 1, 2, 3, "a" * 64, 0, 0, "")
    tensors = tuple(TensorEntry(f"{PREFIX.format(i)}.weight", 0, "U8", (4, 16), (i + 1) * ALIGN, 64) for i in (0, 1))
    arrays = tuple(ArrayEntry(PREFIX.format(i), "weight", "U8", (4, 16), (i + 1) * ALIGN, 64, 0, (i,), (8 + 64 * i,),
                              (0,), ("",)) for i in (0, 1))
    return Manifest("t", "ple-arrays", 0, 0, ALIGN, 3 * ALIGN, FINGERPRINT, (shard,), tensors, arrays=arrays)


def moved(m: Manifest, array: int, offset: int) -> Manifest:
    """``m`` with one array, and its tensor, at ``offset``: everything else about it consistent."""
    arrays = list(m.arrays)
    arrays[array] = replace(arrays[array], offset=offset)
    tensors = list(m.tensors)
    tensors[array] = replace(tensors[array], offset=offset)
    return replace(m, arrays=tuple(arrays), tensors=tuple(tensors))


def tensor_at(m: Manifest, i: int, offset: int) -> Manifest:
    tensors = list(m.tensors)
    tensors[i] = replace(tensors[i], offset=offset)
    return replace(m, tensors=tuple(tensors))


BAD = {  # what is wrong -> (the manifest, what the refusal says)
    "two arrays at one offset": (lambda: moved(arrays_manifest(), 1, ALIGN), "not on a 2 MiB boundary at or after"),
    "an array before the one before it": (lambda: moved(moved(arrays_manifest(), 0, 2 * ALIGN), 1, ALIGN),
                                          "at or after byte"),
    "an array over the header and manifest": (lambda: moved(arrays_manifest(), 0, 0), "at or after byte 2097152"),
    "an array past the region's end": (lambda: moved(arrays_manifest(), 1, 3 * ALIGN), "inside the region's"),
    "an array ending past the region": (lambda: replace(moved(arrays_manifest(), 1, 2 * ALIGN),
                                                        region_bytes=2 * ALIGN + 32), "inside the region's"),
    "two tensors of a shard at one offset": (lambda: tensor_at(files_manifest(), 1, ALIGN), "over tensor 'a'"),
    "two tensors of a shard overlapping by a byte": (lambda: tensor_at(files_manifest(), 1, ALIGN + 63),
                                                     "over tensor 'a'"),
    "a tensor inside another": (lambda: replace(files_manifest(), tensors=(
        TensorEntry("a", 0, "U8", (128,), ALIGN, 128), TensorEntry("b", 0, "U8", (8,), ALIGN + 8, 8))),
        "over tensor 'a'"),
    "a tensor past its shard": (lambda: tensor_at(files_manifest(), 1, ALIGN + 100), "outside its shard 0"),
    "a shard over the header and manifest": (lambda: replace(files_manifest(), shards=(
        replace(files_manifest().shards[0], offset=0),), tensors=()), "outside bytes 2097152"),
    "the data over the manifest": (lambda: replace(files_manifest(), data_offset=_PREFIX.size + 10, shards=(
        replace(files_manifest().shards[0], offset=_PREFIX.size + 10),), tensors=()), "over the header's 64 bytes"),
    "a shard past the region's end": (lambda: replace(files_manifest(), region_bytes=ALIGN + 100),
                                      "outside bytes"),
}


def test_the_controls_are_accepted():
    for m in (files_manifest(), arrays_manifest()):
        assert Manifest.from_json(m.to_json()) == m
        region.check(m)


def test_tensors_listed_out_of_offset_order_and_empty_tensors_anywhere_are_accepted():
    """A safetensors header lists its tensors by name, not by offset; an empty tensor holds no byte, so lies over
    nothing wherever it is."""
    a, b = files_manifest().tensors
    for tensors in ((b, a), (a, b, TensorEntry("e", 0, "U8", (0,), ALIGN + 8, 0)),
                    (TensorEntry("e", 0, "U8", (0,), ALIGN, 0), b, a)):
        m = replace(files_manifest(), tensors=tensors)
        assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize("what", list(BAD))
def test_a_bad_geometry_is_refused_by_the_manifest_parser(what):
    m, says = BAD[what]
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        Manifest.from_json(m().to_json())


def _ints(doc, path=()):
    """Every integer in a manifest document, by its path (the lists of a record's columns and shapes too)."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _ints(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _ints(v, (*path, i))
    elif type(doc) is int:
        yield path


def _set(doc, path, value):
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


GEOMETRY = {"rows", "row_width", "data_offset", "region_bytes", "offset", "size", "nbytes", "shape", "shard",
            "index", "parts", "tensors", "begins", "starts", "format"}


@pytest.mark.parametrize("form", ["files", "arrays"])
def test_every_integer_as_a_boolean_is_refused_and_every_geometric_one_negative(form):
    """Each integer of the control manifest as ``true``, as ``false``, and (where it places or sizes something) as -1
    and as -ALIGN: refused, each. (mtime_ns, dev and ino identify a file; they place nothing.)"""
    doc = json.loads((files_manifest() if form == "files" else arrays_manifest()).to_json())
    paths = list(_ints(doc))
    assert len(paths) >= 20
    tried = 0
    for path in paths:
        key = next(k for k in reversed(path) if isinstance(k, str))
        values = [True, False] + ([-1, -ALIGN] if key in GEOMETRY else [])
        for value in values:
            bad = json.loads(json.dumps(doc))
            _set(bad, path, value)
            with pytest.raises(ValueError):
                Manifest.from_json(json.dumps(bad).encode())
            tried += 1
    assert tried > 60


# -- through client.attach, from a hostile server --------------------------------------------------------------

def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def region_fd(m: Manifest) -> int:
    raw = m.to_json()
    fd = os.memfd_create("fake-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, m.region_bytes)
    os.pwrite(fd, _PREFIX.pack(MAGIC, region.FORMAT_VERSION, 0, m.data_offset, len(raw),
                               hashlib.sha256(raw).digest()) + raw, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, region.SEALS)
    return fd


def serve(tmp_path, m: Manifest):
    reply = json.dumps({"parameters": {"table": "t", "generation": 1, "fingerprint": FINGERPRINT,
                                       "region_bytes": m.region_bytes}}).encode()
    server = FakeServer(str(tmp_path / "pled.sock"), reply, [region_fd(m)])
    try:
        return attach("t", socket=server.path, timeout=10, populate=False)
    finally:
        server.join()


@pytest.mark.parametrize("form", ["files", "arrays"])
def test_the_controls_are_attached_from_the_fake_server(tmp_path, form):
    m = files_manifest() if form == "files" else arrays_manifest()
    with serve(tmp_path, m) as t:
        assert t.manifest == m


@pytest.mark.parametrize("what", [w for w in BAD if w != "the data over the manifest"])
def test_a_bad_geometry_from_a_hostile_server_is_refused_and_nothing_is_kept(tmp_path, what):
    """The region's header puts the data where the manifest says (the manifest's data_offset), its size is the
    manifest's region_bytes: only the geometry is wrong. ("The data over the manifest" cannot be sent this way: the
    header's own check refuses it first.)"""
    m, says = BAD[what]
    before = _fds()
    with pytest.raises(BadRegion, match="refusing to map it|the region's manifest") as caught:
        serve(tmp_path, m()).close()
    assert says in str(caught.value) and "\n" not in str(caught.value), caught.value
    assert _fds() == before


# -- the daemon's side: its own plan is checked as a client will check it --------------------------------------

def test_the_daemon_refuses_a_plan_its_clients_would_refuse(monkeypatch):
    """pled stages nothing a client would refuse: plan_table checks the plan with the clients' own checks, a refusal
    (78) naming the table's source. No real file gives such a plan today (the safetensors and checkpoint parsers
    refuse overlapping tensors first), so the planner's answer is substituted here: arrays at one offset."""
    monkeypatch.setattr(region, "plan", lambda name, source: moved(arrays_manifest(), 1, ALIGN))
    source = types.SimpleNamespace(source="/srv/m/model.safetensors.index.json")
    with pytest.raises(SidecarError, match="table t: its region's plan places array") as caught:
        planning.plan_table("t", source)
    assert caught.value.exit_status == 78 and "/srv/m/model.safetensors.index.json" in str(caught.value)
