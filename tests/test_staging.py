"""Staging into real memfds: bytes, seals, page cache, the region header."""
import errno
import mmap
import os

import numpy as np
import pytest

from harness import LAYOUTS
from pled.daemon.regions import staging
from pled.daemon.sources.sidecar import open_table
from pled.shared import dequant, hugepages, region
from pled.shared.errors import RegionError, StagingError
from pled.shared.pagecache import PAGE, cached_bytes


def stage(d, **kw):
    return staging.stage("t", open_table(str(d)), **kw)


def assert_identical(r):
    m = region.map_readonly(r.fd)
    try:
        for s in r.manifest.shards:
            assert s.offset % region.ALIGN == 0
            with open(s.path, "rb") as f:
                assert m[s.offset : s.offset + s.size] == f.read(), s.path
    finally:
        m.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_byte_identical(sidecar, layout):
    d = sidecar(layout, shards=5, rows=3000)
    with stage(d) as r:
        assert os.fstat(r.fd).st_size == r.manifest.region_bytes
        assert_identical(r)
        # The host's own setting decides the fill: read() into a MADV_HUGEPAGE mapping where it allows huge pages.
        real = hugepages.read_policy()
        assert r.stats.fill.method == (staging.FAULT if real and real.allows_huge else staging.SENDFILE)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_dequantize_the_same_from_region_and_file(sidecar, layout):
    d = sidecar(layout, shards=2, rows=500)
    with stage(d) as r:
        m = region.map_readonly(r.fd)
        rows = np.array([0, 17, 499])
        for s in r.manifest.shards:
            from_region = {t.name: dequant.view(m, t.offset, t.dtype, t.shape)
                           for t in r.manifest.tensors if t.shard == s.index}
            data = open(s.path, "rb").read()
            from_file = {t.name: dequant.view(data, t.offset - s.offset, t.dtype, t.shape)
                         for t in r.manifest.tensors if t.shard == s.index}
            a = dequant.dequant_rows(layout, from_region, rows)
            b = dequant.dequant_rows(layout, from_file, rows)
            assert a.shape == (3, 160) and np.isfinite(a).all() and np.abs(a).max() > 0
            assert np.array_equal(a, b)
            del from_region, a
        m.close()


def test_fault_fill_for_huge_pages_is_byte_identical(sidecar, tmp_path):
    """The MADV_HUGEPAGE path, chosen from a fixture sysfs that says 'advise'.

    Whether the kernel then gives huge pages depends on the real setting, which
    the tests do not change (it is a host setting); the bytes must be right either way.
    """
    thp = tmp_path / "sys/sys/kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "shmem_enabled").write_text("always within_size [advise] never deny force\n")
    (thp / "hpage_pmd_size").write_text("2097152\n")
    d = sidecar("ples_nvfp4", shards=3, rows=20000)
    with stage(d, sys_root=str(tmp_path / "sys")) as r:
        assert r.stats.fill.method == staging.FAULT and r.stats.fill.policy == "advise"
        # The fixture said advise, so pled asked; what it got is the real kernel's answer.
        real = hugepages.read_policy()
        if real is not None and real.allows_huge:
            assert r.stats.huge_bytes > 0 and r.stats.huge_bytes % hugepages.PMD_SIZE == 0
        else:
            assert r.stats.huge_bytes == 0, (real, r.stats.huge_bytes)
        assert region.is_sealed(r.fd)
        assert_identical(r)


def test_policy_is_read_from_sysfs(tmp_path):
    thp = tmp_path / "sys/kernel/mm/transparent_hugepage"
    (thp / "hugepages-2048kB").mkdir(parents=True)
    (thp / "shmem_enabled").write_text("always within_size advise [never] deny force\n")
    (thp / "hugepages-2048kB/shmem_enabled").write_text("always [inherit] within_size advise never\n")
    p = hugepages.read_policy(str(tmp_path))
    assert p.effective == "never" and not p.allows_huge
    plan = staging.plan_fill("auto", p)
    assert plan.method == staging.SENDFILE and "4 KiB pages" in plan.note and "shmem_enabled" in plan.note
    (thp / "hugepages-2048kB/shmem_enabled").write_text("always inherit [within_size] advise never\n")
    p = hugepages.read_policy(str(tmp_path))
    assert p.effective == "within_size" and staging.plan_fill("auto", p).method == staging.FAULT
    assert staging.plan_fill("off", p).method == staging.SENDFILE
    assert hugepages.read_policy(str(tmp_path / "nothing")) is None


def test_the_whole_region_is_resident_padding_included(sidecar):
    """Alignment padding is zeroed while staging: the region is exactly as big as the preflight said,
    and a client touching a padding page never allocates one on its own account."""
    from pled.shared.pagecache import cached_bytes_fd

    with stage(sidecar("ples_int4", shards=3, rows=3001)) as r:
        assert cached_bytes_fd(r.fd) == r.manifest.region_bytes
        last = r.manifest.shards[-1]
        assert os.pread(r.fd, 4096, region.align(last.offset + last.size) - 4096)[-100:] == bytes(100)


def test_sealed_region_cannot_be_written_resized_or_mapped_writable(sidecar):
    with stage(sidecar(shards=2, rows=100)) as r:
        seals = region.seals(r.fd)
        import fcntl

        for seal in (fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW, fcntl.F_SEAL_WRITE, fcntl.F_SEAL_SEAL):
            assert seals & seal
        with pytest.raises(PermissionError):
            mmap.mmap(r.fd, r.manifest.region_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(r.fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(r.fd, r.manifest.region_bytes + 4096)
        with pytest.raises(PermissionError):
            os.ftruncate(r.fd, 4096)
        with pytest.raises(PermissionError):  # F_SEAL_SEAL: nobody can even remove seals
            fcntl.fcntl(r.fd, fcntl.F_ADD_SEALS, 0)
        # A private writable mapping is a copy-on-write view: allowed, and it never reaches the region.
        priv = mmap.mmap(r.fd, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        priv[:8] = b"XXXXXXXX"
        assert os.pread(r.fd, 8, 0) == region.MAGIC
        priv.close()


def test_source_page_cache_after_staging_is_at_most_about_one_shard(sidecar):
    d = sidecar("ples_fp8", shards=6, rows=25000)  # ~4 MiB per shard
    files = sorted(str(p) for p in d.glob("*.safetensors"))
    for f in files:  # warm the page cache, as a previous mmapped run would leave it
        with open(f, "rb") as fh:
            while fh.read(1 << 20):
                pass
    total = sum(os.path.getsize(f) for f in files)
    before = sum(cached_bytes(f) for f in files)
    assert before >= total * 0.9, "the test could not warm the page cache, so it would prove nothing"
    with stage(d) as r:
        after = sum(cached_bytes(f) for f in files)
        largest = max(s.size for s in r.manifest.shards)
        assert after <= largest + len(files) * PAGE, (after, largest)


def test_manifest_is_read_back_from_the_region_alone(sidecar):
    d = sidecar("ples_int4", shards=3, rows=700)
    s = open_table(str(d))
    with staging.stage("ples_int4", s) as r:
        m = region.read_manifest(r.fd)
        assert m == r.manifest and m.identity() == region.plan("ples_int4", s).identity()
        # Each shard's digest, computed while staging, is the digest of its file (the generator wrote them down).
        assert [sh.digest for sh in m.shards] == [s.meta["digests"][f"shard_{i}.safetensors"] for i in range(3)]
        assert m.content_digest.startswith("sha256:")
        assert (m.table, m.layout, m.rows, m.row_width, m.format) == ("ples_int4", "ples_int4", 2100, 160, 1)
        assert [sh.path for sh in m.shards] == [os.path.realpath(d / f"shard_{i}.safetensors") for i in range(3)]
        assert all(sh.mtime_ns and sh.size and len(sh.fingerprint) == 64 for sh in m.shards)
        # Every tensor's absolute offset points at its bytes.
        for t in m.tensors:
            sh = m.shards[t.shard]
            with open(sh.path, "rb") as f:
                f.seek(t.offset - sh.offset)
                assert os.pread(r.fd, t.nbytes, t.offset) == f.read(t.nbytes)


def test_a_memfd_that_is_not_a_region_is_refused():
    fd = os.memfd_create("other", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 1 << 20)
        with pytest.raises(RegionError, match="not a pled region"):
            region.read_manifest(fd)
    finally:
        os.close(fd)


def test_a_region_whose_manifest_was_tampered_with_is_refused(sidecar):
    with stage(sidecar(shards=1, rows=10)) as r:
        fd = os.memfd_create("copy", os.MFD_CLOEXEC)
        data = bytearray(os.pread(r.fd, r.manifest.region_bytes, 0))
        data[100] ^= 1
        os.write(fd, data)
        with pytest.raises(RegionError, match="checksum"):
            region.read_manifest(fd)
        os.close(fd)


def test_a_file_changed_after_validation_fails_staging(sidecar):
    d = sidecar(shards=3, rows=100)
    s = open_table(str(d))
    with open(d / "shard_1.safetensors", "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(StagingError, match=r"shard_1.safetensors changed while pled was staging it \(size"):
        staging.stage("t", s)


def test_cancel_stops_between_chunks_and_frees_the_region(sidecar):
    d = sidecar(shards=3, rows=100)
    with pytest.raises(staging.StagingCancelled):
        staging.stage("t", open_table(str(d)), should_stop=lambda: True)


def test_close_is_idempotent(sidecar):
    r = stage(sidecar(shards=1, rows=10))
    fd = r.fd
    r.close()
    r.close()
    assert r.closed
    with pytest.raises(OSError) as err:
        os.fstat(fd)
    assert err.value.errno == errno.EBADF


@pytest.mark.parametrize("swap", ["fifo", "device"])
def test_a_shard_swapped_for_a_fifo_or_device_after_validation_is_refused_unopened(sidecar, swap):
    """Staging opens each shard as the regular file it must be (boundary.open_regular): a FIFO or a device put in
    its place after validation is refused by its stat, never opened (opening some devices has effects)."""
    d = sidecar(shards=3, rows=100)
    s = open_table(str(d))
    shard = d / "shard_1.safetensors"
    shard.unlink()
    if swap == "fifo":
        os.mkfifo(shard)
    else:
        os.symlink("/dev/null", shard)
    with pytest.raises(StagingError, match=r"cannot stage .*shard_1\.safetensors: is a (FIFO|character device), "
                                           r"not a regular file; nothing of it is served"):
        staging.stage("t", s)
