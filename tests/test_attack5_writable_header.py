"""The fifth attack on the writable route (gpu_access = "writable"): a writer can write the region's header too, and
what it writes there must not steer anyone else.

Finding: a writable table's memfd is not write-sealed, and its header (the prefix and the JSON manifest, with each
source file's path) is in it. A writer rewrote the manifest (a shard's path, the prefix's sha256 recomputed) and
every other client took it: `pled verify`, run by root, then opened, read and dropped from the page cache the file
the writer named (a whole-file POSIX_FADV_DONTNEED where the piece was a whole sidecar shard): a confused deputy that
reads and evicts any file on the host. Fix: a writable table's Attach reply carries the sha256 of the manifest as
pled staged it (from the header pled kept), and the client refuses a region whose header does not hash to it.

Real processes and uids: pled as its own user, the writer a uid in pled's group (tests/test_writable_route.py's
set-up), `pled verify` as root; the decoy's page cache read with mincore (tests/test_page_cache_ranges.py's helper)."""
import encodings.ascii  # noqa: F401 (a forked child that dropped root cannot import from root's Python any more)
import hashlib
import json
import os
import struct
from pathlib import Path

import pytest

from harness import run_pled
from pled import client
from test_page_cache_ranges import pages
from test_writable_route import OTHER, WRITER, as_uid, start_pled

pytestmark = [pytest.mark.root, pytest.mark.daemon]


def rewrite_header(sock: str, old: bytes, new: bytes) -> str:
    """As the writer: replace ``old`` by ``new`` (same length) in the region's manifest and recompute the prefix's
    sha256, as a hostile writer would."""
    def action():
        t = client.attach("t", socket=sock, populate=False)
        buf = t.buffer
        length = struct.unpack_from("<Q", buf, 24)[0]
        raw = bytes(buf[64:64 + length])
        assert raw.count(old) == 1, "the shard's path is not in the manifest once"
        raw = raw.replace(old, new)
        buf[64:64 + length] = raw
        buf[32:64] = hashlib.sha256(raw).digest()
        return "rewritten"
    return as_uid(WRITER, action)


@pytest.fixture
def tampered(open_dir, pleds):
    sock = start_pled(open_dir, pleds, "h")
    t = client.attach("t", socket=sock, populate=False)
    shard = t.shards[0].path
    t.close()
    decoy = Path(shard).with_name("shard_0.safetensorZ")  # a path of the same length: the manifest keeps its size
    decoy.write_bytes(os.urandom(os.path.getsize(shard)))  # its size: verify reads it whole
    os.chmod(decoy, 0o600)  # root's alone: the writer cannot read it
    fd = os.open(decoy, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    decoy.read_bytes()
    assert all(pages(decoy)), "the test could not cache the decoy: it would prove nothing"
    assert rewrite_header(sock, json.dumps(shard).encode(), json.dumps(str(decoy)).encode()) == "rewritten"
    yield sock, decoy, pleds[-1]
    decoy.unlink()


def test_root_verify_never_reads_or_evicts_a_file_a_writer_names_in_the_header(tampered):
    sock, decoy, pled = tampered
    r = run_pled("verify", "--socket", sock)
    cached = pages(decoy)
    assert all(cached), (f"`pled verify` (root) dropped {len(cached) - sum(cached)} of {len(cached)} pages of "
                         f"{decoy}, a file the writer named in the region's header; it said: {r.stdout}{r.stderr}")
    assert decoy.name not in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.returncode == 1 and "header is not the one pled staged" in r.stderr, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert pled.poll() is None


def test_a_client_refuses_a_writable_region_whose_header_a_writer_changed(tampered):
    sock, decoy, pled = tampered

    def attach():
        t = client.attach("t", socket=sock, populate=False)
        return f"attached, shard 0 at {t.shards[0].path}"
    said = as_uid(OTHER, attach)
    assert said.startswith("BadRegion:") and "header" in said and decoy.name not in said, said
    assert len(said.splitlines()) == 1, said


def test_verify_repair_stages_a_clean_generation_before_the_scheduled_verify_ran(tampered):
    """`pled verify --repair` right after the change (the scheduled verify's period is an hour here): the table is
    staged anew, and a new attach gets a clean generation whose header is pled's."""
    sock, decoy, pled = tampered
    r = run_pled("verify", "--repair", "--socket", sock)
    assert r.returncode == 0 and "changed: t (generation 2)" in r.stdout, r.stdout + r.stderr
    t = client.attach("t", socket=sock, populate=False)
    assert (t.generation, t.shards[0].path.endswith("shard_0.safetensors")) == (2, True)
    t.close()
    assert run_pled("verify", "--socket", sock).returncode == 0


def test_verify_repair_restages_a_data_change_the_scheduled_verify_has_not_seen(open_dir, pleds):
    """A writer changes one byte of the data (the header untouched); `pled verify --repair` at once, the scheduled
    verify an hour away: the repair stages generation 2 (it said "nothing changed" and exited 0 before)."""
    sock = start_pled(open_dir, pleds, "d")

    def change():
        t = client.attach("t", socket=sock, populate=False)
        at = t.manifest.shards[1].offset + 100
        t.buffer[at] = (t.buffer[at] + 1) % 256
        return "changed"
    assert as_uid(WRITER, change) == "changed"
    assert run_pled("verify", "--socket", sock).returncode == 1
    r = run_pled("verify", "--repair", "--socket", sock)
    assert r.returncode == 0 and "changed: t (generation 2)" in r.stdout, r.stdout + r.stderr
    assert run_pled("verify", "--socket", sock).returncode == 0
