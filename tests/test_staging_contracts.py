"""What staging promises, each in a test that fails when the promise is broken (tools/mutations.py breaks them)."""
import ctypes
import json
import mmap
import os

import pytest

from pled import client
from pled.daemon.regions import staging
from pled.daemon.sources.sidecar import open_table
from pled.shared import region
from pled.shared.errors import SidecarError
from pled.shared.hugepages import PMD_SIZE
from pled.shared.pagecache import PAGE, cached_bytes_fd, mapping_address

MiB = 1024**2


def drop(files):
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def memfds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("/memfd:pled:"):
            out.add(f"{fd} {link}")
    return out


def cached_below(path: str, end: int) -> int:
    """Bytes of ``path``'s first ``end`` bytes in the page cache (mincore over a mapping that is never read)."""
    if end <= 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, end, access=mmap.ACCESS_COPY)
        try:
            vec = (ctypes.c_ubyte * -(-end // PAGE))()
            assert libc.mincore(ctypes.c_void_p(mapping_address(m)), ctypes.c_size_t(end), vec) == 0
            return sum(v & 1 for v in vec) * PAGE
        finally:
            m.close()
    finally:
        os.close(fd)


def test_each_chunk_leaves_the_page_cache_as_soon_as_it_is_copied(sidecar):
    """A shard of a dozen chunks: before each chunk (when should_stop is asked), nothing of the part already copied
    is left in the page cache. (Ahead of the copy the kernel's readahead may hold several MiB; that is not counted.)"""
    d = sidecar("ples_fp8", shards=1, rows=300_000)  # 47 MiB
    path = str(d / "shard_0.safetensors")
    drop([path])
    chunk = 4 * MiB
    behind = []

    def probe():
        done = len(behind) * chunk  # the n-th question comes before the n-th chunk
        # a huge folio at the edge may stay
        behind.append(cached_below(path, min(done, os.path.getsize(path)) - PMD_SIZE))
        return False

    with staging.stage("t", open_table(str(d)), should_stop=probe, chunk=chunk) as r:
        shard = r.manifest.shards[0].size
    assert len(behind) == -(-shard // chunk)
    assert behind == [0] * len(behind), [f"{b / MiB:.1f}" for b in behind]


def test_cancel_after_the_first_chunk_closes_the_half_built_region(sidecar):
    d = sidecar("ples_fp8", shards=2, rows=50_000)  # 8 MiB a shard: 8 chunks of 1 MiB each
    before = memfds()
    calls = []

    def stop_at_the_second_chunk():
        calls.append(1)
        if len(calls) == 2:
            assert memfds() - before, "staging holds no memfd while copying?"
            return True
        return False

    with pytest.raises(staging.StagingCancelled):
        staging.stage("t", open_table(str(d)), should_stop=stop_at_the_second_chunk, chunk=MiB)
    assert len(calls) == 2
    assert memfds() == before  # the region's only fd is closed, so its memory is freed


def test_a_shard_that_does_not_match_its_shipped_digest_is_refused_at_once(sidecar):
    d = sidecar("ples_int4", shards=3, rows=500)
    path = d / "shard_1.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # the last byte of the data; the header is untouched, so the file still validates
    path.write_bytes(data)
    s = open_table(str(d))
    with pytest.raises(SidecarError,
                       match=r"shard_1.safetensors: content xxh3_128:.* does not match .* in .*META.json"):
        staging.stage("t", s)


@pytest.mark.parametrize("sums,algo", [("B3SUMS", "blake3"), ("SHA256SUMS", "sha256")])
def test_correct_shipped_sums_pass_and_a_wrong_one_is_refused(sidecar, sums, algo):
    import hashlib

    import blake3

    digest = {"blake3": lambda b: blake3.blake3(b).hexdigest(), "sha256": lambda b: hashlib.sha256(b).hexdigest()}[algo]
    d = sidecar("ples_int4", shards=2, rows=100)
    meta = json.loads((d / "META.json").read_text())
    del meta["digests"]  # the sums file alone decides
    (d / "META.json").write_text(json.dumps(meta))
    names = ["shard_0.safetensors", "shard_1.safetensors"]
    (d / sums).write_text("".join(f"{digest((d / n).read_bytes())}  {n}\n" for n in names))
    s = open_table(str(d))
    assert {n: s.expected_digests[n][0] for n in names} == {n: algo for n in names}
    with staging.stage("t", s) as r:  # the correct sums pass
        assert r.manifest.content_digest
    (d / sums).write_text(f"{digest((d / names[0]).read_bytes())}  {names[0]}\n{'0' * 64}  {names[1]}\n")
    with pytest.raises(SidecarError, match=rf"shard_1.safetensors: content {algo}:.* in .*{sums}"):
        staging.stage("t", open_table(str(d)))


def test_residency_is_measured_not_assumed():
    """A memfd of 8 MiB with 3 MiB written: 3 MiB resident, not 8 and not 0."""
    fd = os.memfd_create("pled-test")
    try:
        os.ftruncate(fd, 8 * MiB)
        os.pwrite(fd, b"x" * (3 * MiB), 2 * MiB)
        assert cached_bytes_fd(fd) == 3 * MiB
    finally:
        os.close(fd)


def test_a_client_table_partly_in_memory_says_so_and_populate_brings_it_in(sidecar):
    """A region whose data pages were never written (holes in an unsealed copy of a real region): residency is the
    header's share; populate() faults every page in, and residency then is 1."""
    d = sidecar("ples_fp8", shards=2, rows=20_000)
    with staging.stage("t", open_table(str(d))) as r:
        m = r.manifest
        header = os.pread(r.fd, m.data_offset, 0)
    fd = os.memfd_create("pled-test-copy")
    os.ftruncate(fd, m.region_bytes)
    os.pwrite(fd, header, 0)  # only the header: every shard's pages are holes
    t = client.Table(fd, 1, populate=False)
    try:
        share = t.residency()
        assert share == pytest.approx(m.data_offset / m.region_bytes)
        assert share < 0.5
        t.populate()
        assert t.residency() == 1.0
    finally:
        t.close()


def test_the_whole_staged_region_is_resident_and_the_measure_sees_a_change(sidecar):
    with staging.stage("t", open_table(str(sidecar(shards=2, rows=3000)))) as r:
        assert cached_bytes_fd(r.fd) == r.manifest.region_bytes
    # The same measure, on a memfd of the same size with nothing written, sees nothing.
    fd = os.memfd_create("empty")
    try:
        os.ftruncate(fd, r.manifest.region_bytes)
        assert cached_bytes_fd(fd) == 0
    finally:
        os.close(fd)
    assert region.ALIGN == 2 * MiB
