"""What ``attach()`` does with a region it must not map: one missing any one of pled's four seals, and one whose
header's fingerprint is not the one the reply names. Each is refused with a ``ClientError`` that says why, and the
client is left with exactly the fds and mappings it had before (/proc/self/fd and /proc/self/maps).

The server here is a stand-in, on purpose: pled itself never sends either (staging adds all four seals in one
F_ADD_SEALS before a region is served, and an Attach reply takes its fingerprint from the very table whose region it
sends), so a real daemon cannot be made to offer one. The stand-in is as close to pled as the case allows: a real
Unix socket, a real memfd passed with SCM_RIGHTS on the reply's first byte, and the bytes of a region that pled's own
staging code (``pled.daemon.regions.staging.stage``) made from a real sidecar. Only the seals, or the reply's
fingerprint, differ from what pled would send; ``test_the_stand_in_is_attached_when_nothing_is_wrong`` shows that with
nothing changed the same stand-in is attached, so each refusal below is for the one thing changed.
"""
from __future__ import annotations

import fcntl
import os

import pytest

from fakeserver import FakeServer
from pled.client import connection
from pled.client.library import attach
from pled.daemon.regions import staging
from pled.daemon.sources.sidecar import open_table
from pled.shared import protocol, region

MEMFD_NAME = "pled-test-stand-in"  # how the stand-in's memfds show in /proc/self/maps
SEAL_NAMES = {fcntl.F_SEAL_SEAL: "F_SEAL_SEAL", fcntl.F_SEAL_SHRINK: "F_SEAL_SHRINK",
              fcntl.F_SEAL_GROW: "F_SEAL_GROW", fcntl.F_SEAL_WRITE: "F_SEAL_WRITE"}


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> tuple[bytes, region.Manifest]:
    """A real region's bytes and manifest, as pled's staging makes them from a real sidecar (its fd closed)."""
    from pled.generator import make_sidecar

    d = tmp_path_factory.mktemp("sidecar") / "sc"
    make_sidecar(str(d), "ples_int4", shards=2, rows=64)
    with staging.stage("t", open_table(str(d))) as r:
        assert region.seals(r.fd) & region.SEALS == region.SEALS  # pled's own region has all four
        return os.pread(r.fd, r.manifest.region_bytes, 0), r.manifest


def memfd_with(data: bytes, seals: int) -> int:
    """A new memfd holding ``data`` (a region's bytes), sealed with exactly ``seals``."""
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, len(data))
    os.pwrite(fd, data, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    assert region.seals(fd) == seals
    return fd


def open_fds() -> list[str]:
    """What this process's fds are (the listing's own fd shows as "?")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            out.append("?")
    return sorted(out)


def stand_in_mappings() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if MEMFD_NAME in line]


def attach_from_stand_in(tmp_path, data: bytes, seals: int, params: dict):
    """``attach("t")`` against a stand-in serving ``data`` in a memfd with ``seals``, replying ``params``: (the table
    or the exception, the fds this process had before, the fds it has once the stand-in is done). The exception is
    still held when the fds are counted, as a caller handling it holds it."""
    before = open_fds()
    # the stand-in for pled (see the module's docstring) answers one Attach with params and the memfd
    server = FakeServer(str(tmp_path / "pled.sock"), protocol.encode(protocol.reply(**params))[:-1],
                        [memfd_with(data, seals)])
    try:
        got = attach("t", socket=server.path, timeout=10, populate=False)
    except connection.ClientError as err:
        got = err
    server.join()
    assert server.call == {"method": protocol.ATTACH, "parameters": {"table": "t"}}, server.call
    return got, before, open_fds()


def reply_for(manifest: region.Manifest, **over) -> dict:
    """The Attach reply pled sends for this region (handlers.attach_reply), with ``over`` changed."""
    return {"table": manifest.table, "generation": 1, "fingerprint": manifest.fingerprint,
            "region_bytes": manifest.region_bytes, **over}


def test_the_stand_in_is_attached_when_nothing_is_wrong(tmp_path, staged):
    data, manifest = staged
    got, before, after = attach_from_stand_in(tmp_path, data, region.SEALS, reply_for(manifest))
    assert not isinstance(got, Exception), got
    try:
        assert got.manifest == manifest and got.generation == 1
        assert bytes(got.buffer[: len(data)]) == data
        assert len(stand_in_mappings()) == 1
    finally:
        got.close()
    assert open_fds() == before and stand_in_mappings() == []


@pytest.mark.parametrize("missing", list(SEAL_NAMES), ids=list(SEAL_NAMES.values()))
def test_a_region_missing_one_seal_is_refused_with_no_fd_left(tmp_path, staged, missing):
    """Three of the four seals are not a region: without SHRINK it may shrink under a mapping (SIGBUS), without
    GROW or WRITE its bytes may change after they were checked, without SEAL its sender may remove the others."""
    data, manifest = staged
    have = region.SEALS & ~missing
    got, before, after = attach_from_stand_in(tmp_path, data, have, reply_for(manifest))
    if not isinstance(got, Exception):
        got.close()
        pytest.fail(f"a region without {SEAL_NAMES[missing]} (seals {have:#x}) was attached")
    assert type(got) is connection.BadRegion, repr(got)
    message = str(got)
    assert message.startswith(f"the region pled at {tmp_path / 'pled.sock'} sent for table 't' is refused: "), message
    assert f"is not sealed (seals {have:#x}; a region has {region.SEALS:#x}: shrink, grow, write, seal)" in message
    assert message.endswith("refusing to map it"), message
    assert after == before, f"left open: {sorted(set(after) - set(before))}"
    assert stand_in_mappings() == []  # refused before anything was mapped


def test_a_reply_whose_fingerprint_is_not_the_regions_is_refused_with_no_fd_left(tmp_path, staged):
    """The region is whole and sealed, its header names table t, but the reply names another fingerprint (as a
    reply for another generation of t would): the client cannot tell which is right and refuses it."""
    data, manifest = staged
    other = "0" * 64 if manifest.fingerprint != "0" * 64 else "1" * 64
    got, before, after = attach_from_stand_in(tmp_path, data, region.SEALS, reply_for(manifest, fingerprint=other))
    if not isinstance(got, Exception):
        got.close()
        pytest.fail("a region whose fingerprint is not the reply's was attached")
    assert type(got) is connection.ProtocolError, repr(got)  # not BadRegion: the region itself is sound
    assert str(got) == "the region sent for table 't' does not match the reply (fingerprint or name)"
    assert after == before, f"left open: {sorted(set(after) - set(before))}"
    assert stand_in_mappings() == []  # it was mapped to read its header, and unmapped
