"""What pled leaves in the host's page cache of a model checkpoint (pled/shared/dropbehind.py): staging, `pled
verify` and a reload's restaging drop only the pages of the byte ranges they read (rounded inward: a page shared with
a neighbouring tensor stays) that were not cached before pled read the file; they bring in nothing past those ranges
(pled's own fd reads with POSIX_FADV_RANDOM); every other page is as pled found it. A sidecar's pages are pled's
alone and are dropped (test_staging.py).

Figures are real page-cache residency: mincore(2) over a mapping of real files on the tests' file system (ext4 here;
not tmpfs, whose pages are never dropped), read by a helper written here, not by pled's. The files are fsynced
first: a dirty page cannot be dropped. Each assertion names its figures, before and after."""
import ctypes
import json
import mmap
import os
import struct
from pathlib import Path

import pytest

import harness
from pled.daemon.regions import staging
from pled.daemon.sources.checkpoint import open_checkpoint
from pled.generator import make_checkpoint
from pled.shared.dropbehind import DropBehind, resident
from pled.shared.hugepages import PMD_SIZE
from pled.shared.pagecache import PAGE, mapping_address

MiB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent
_libc = ctypes.CDLL(None, use_errno=True)


def pages(path) -> bytearray:
    """One byte a page of ``path``: 1 where it is in the page cache now (mincore over a mapping never read)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        try:
            vec = (ctypes.c_ubyte * -(-size // PAGE))()
            assert _libc.mincore(ctypes.c_void_p(mapping_address(m)), ctypes.c_size_t(size), vec) == 0
            return bytearray(v & 1 for v in vec)
        finally:
            m.close()
    finally:
        os.close(fd)


def in_cache(fd: int, offset: int, length: int) -> int:
    """Pages of fd's [offset, offset + length) in the page cache, being read in or not: cachestat(2), called here."""
    rng, st = (ctypes.c_uint64 * 2)(offset, length), (ctypes.c_uint64 * 5)()
    assert _libc.syscall(451, fd, rng, st, 0) == 0, os.strerror(ctypes.get_errno())
    return st[0]


def page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def page_down(n: int) -> int:
    return n // PAGE * PAGE


def ple_ranges(path) -> list[tuple[int, int]]:
    """The file's byte ranges of PLE tensors (ngram_embedding), from its header read here."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return sorted((8 + n + t["data_offsets"][0], 8 + n + t["data_offsets"][1])
                  for name, t in header.items() if "ngram_embedding" in name)


def inside(ranges) -> set[int]:
    """Pages wholly inside the ranges (adjacent ranges are one)."""
    out: set[int] = set()
    for lo, hi in ranges:
        out.update(range(-(-lo // PAGE), hi // PAGE))
    return out


def fadvise(path, lo: int, hi: int, advice=os.POSIX_FADV_DONTNEED) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, lo, hi - lo, advice)
    finally:
        os.close(fd)


def checkpoint(d: Path) -> list[str]:
    """A checkpoint whose PLE tensors sit between other tensors: each layer's norm (8 KiB) before its PLE shards,
    and 6 MiB of other tensors after them in every file; a file holds both layers' tables, neither at its start."""
    import numpy as np

    rng = np.random.default_rng(5)
    extra = [(f"model.language_model.layers.{i}.mlp.down_proj.weight", "BF16", (768, 2048),
              rng.integers(0, 2**16, (768, 2048), dtype=np.uint16)) for i in range(4)]
    files = make_checkpoint(str(d), "bf16", {0: 1200, 1: 1300}, width=2048, parts=4, files=2, extra=extra)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return files


def figures(before: bytearray, after: bytearray, ranges) -> str:
    return (f"cached before {sum(before) * PAGE / MiB:.2f} MiB, after {sum(after) * PAGE / MiB:.2f} MiB, "
            f"PLE ranges {sum(h - lo for lo, h in ranges) / MiB:.2f} MiB")


def lost_and_brought(before: bytearray, after: bytearray) -> tuple[list[int], list[int]]:
    lost = [p for p, (b, a) in enumerate(zip(before, after, strict=True)) if b and not a]
    brought = [p for p, (b, a) in enumerate(zip(before, after, strict=True)) if a and not b]
    return lost, brought


def test_a_cached_checkpoint_keeps_every_page_through_staging(tmp_path):
    files = checkpoint(tmp_path)
    for f in files:  # read in first, as a checkpoint that vLLM just read would be
        Path(f).read_bytes()
    before = {f: pages(f) for f in files}
    assert all(sum(v) == len(v) for v in before.values()), "the test could not cache the files: it would prove nothing"
    with staging.stage("t", open_checkpoint(str(tmp_path))):
        for f in files:
            after = pages(f)
            lost, _ = lost_and_brought(before[f], after)
            assert not lost, (f"{len(lost)} pages of {os.path.basename(f)} dropped (first at byte {lost[0] * PAGE}); "
                              + figures(before[f], after, ple_ranges(f)))


@pytest.mark.parametrize("cold", ["ple", "second-half-of-each-ple-tensor"])
def test_a_tensor_not_at_the_files_start_exactly_the_ranges_read_are_dropped(tmp_path, cold):
    """The file's other tensors cached, its PLE tensors (none at the file's start) cold or half cold: staging leaves
    every cached page cached, PLE pages included, and takes out every page it brought in."""
    files = checkpoint(tmp_path)
    for f in files:
        Path(f).read_bytes()
        for lo, hi in ple_ranges(f):
            fadvise(f, (lo + hi) // 2 if cold != "ple" else lo, hi)
    before = {f: pages(f) for f in files}
    for f in files:
        ranges = ple_ranges(f)
        assert ranges[0][0] > 8 * 1024, "a PLE tensor at the file's start: the test would not see the rounding"
        assert 0 < sum(before[f]) < len(before[f]) and any(not before[f][p] for p in inside(ranges)), \
            "the test could not make the PLE ranges cold: it would prove nothing"
    with staging.stage("t", open_checkpoint(str(tmp_path))):
        for f in files:
            after = pages(f)
            lost, brought = lost_and_brought(before[f], after)
            say = f"{os.path.basename(f)}: " + figures(before[f], after, ple_ranges(f))
            assert not lost, f"{len(lost)} pages cached before were dropped (first at byte {lost[0] * PAGE}); {say}"
            assert not brought, f"{len(brought)} pages pled brought in are still cached (first at byte " \
                                f"{brought[0] * PAGE}); {say}"


def test_a_cold_checkpoint_ends_with_no_more_than_a_chunk_of_pleds_pages(tmp_path):
    """Cold files: of what staging brought in, at most the folio at each end of each run of PLE tensors stays (a
    page shared with a neighbouring tensor stays, and its folio with it), and nothing past them. What
    planning's reads of the headers brought in before staging (the headers and their readahead) is not staging's."""
    files = checkpoint(tmp_path)
    for f in files:
        fadvise(f, 0, os.path.getsize(f))
    assert all(sum(pages(f)) == 0 for f in files), "the test could not drop the files' pages"
    chunk = 8 * MiB
    source = open_checkpoint(str(tmp_path))  # planning: reads each file's header
    before = {f: pages(f) for f in files}
    with staging.stage("t", source, chunk=chunk):
        for f in files:
            _, brought = lost_and_brought(before[f], pages(f))
            runs = len([r for i, r in enumerate(ple_ranges(f)) if i == 0 or r[0] != ple_ranges(f)[i - 1][1]])
            ple = sum(hi - lo for lo, hi in ple_ranges(f))
            left, bound = len(brought) * PAGE, min(runs * 2 * PMD_SIZE, chunk)  # two folios a run, under a chunk
            assert left <= bound, (f"{os.path.basename(f)}: staging left {left / MiB:.2f} MiB it brought in, of "
                                   f"{ple / MiB:.2f} MiB of PLE tensors read in {runs} runs; at most "
                                   f"{bound / MiB:.2f} MiB may stay")


def test_pages_shared_with_a_neighbour_stay_and_a_range_read_in_chunks_goes(tmp_path):
    """DropBehind alone, over a file of 4 KiB folios (each page read with POSIX_FADV_RANDOM, so the kernel makes no
    larger ones): a range that starts and ends inside pages drops exactly the pages wholly inside it, read in
    chunks that end off any 2 MiB boundary; pages cached before it are kept."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(24 * MiB))
    fadvise(path, 0, 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        lo, hi = 3 * MiB + 100, 17 * MiB + 5  # ends inside pages
        kept = [lo // PAGE + 40, lo // PAGE + 41, hi // PAGE - 7]  # cached before: stay
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for p in kept:
            os.pread(fd, PAGE, p * PAGE)
        before = pages(path)
        assert sum(before) == len(kept), "the test could not cache just those pages"
        behind = DropBehind(fd, [(lo, hi)], str(path))
        at, late = lo, []
        while at < hi:
            got = len(os.pread(fd, min(3 * MiB + 12345, hi - at), at))
            behind.read(at, at + got)
            at += got
            now = pages(path)  # behind the read, up to its last 2 MiB boundary: nothing it brought in
            late += [p for p in inside([(lo, min(at // PMD_SIZE * PMD_SIZE, hi))]) if now[p] and p not in kept]
        behind.close()
        after = pages(path)
    finally:
        os.close(fd)
    assert after[lo // PAGE] and after[hi // PAGE], "a page shared with the neighbouring bytes was dropped"
    assert all(after[p] for p in kept), f"pages cached before were dropped: {[p for p in kept if not after[p]]}"
    left = [p for p in inside([(lo, hi)]) if after[p] and p not in kept]
    assert not left, f"{len(left)} pages read were left cached (first {left[0]})"
    assert sum(after) == len(kept) + 2, f"{sum(after)} pages cached, expected the {len(kept)} + 2 shared"
    assert not late, f"{len(late)} pages behind the read were not dropped as it went (first {late[0]})"


def test_a_range_read_brings_in_nothing_past_it_and_the_next_bytes_of_it_ahead(tmp_path):
    """DropBehind alone, over a cold file whose fd the caller set POSIX_FADV_SEQUENTIAL on (the kernel's widest
    readahead): DropBehind sets RANDOM, so reading a range in chunks brings in no page past the range's last one, and
    after each read the next bytes of the range are in the page cache already (pled's own read-ahead, WILLNEED: a
    page being read in is in the page cache, counted by cachestat(2) though mincore says it is not yet, so this needs
    no timing)."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(40 * MiB))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        lo, hi = MiB + 100, 13 * MiB + 5
        assert sum(pages(path)) == 0, "the test could not drop the file's pages"
        behind = DropBehind(fd, [(lo, hi)], str(path))
        at, past, missing = lo, [], []
        while at < hi:
            got = len(os.pread(fd, min(MiB + 4321, hi - at), at))
            behind.read(at, at + got)
            at += got
            now = pages(path)
            past += [p for p in range(hi // PAGE + 1, len(now)) if now[p]]
            want = page_up(min(at + got, hi)) - page_down(at)
            if want > 0 and in_cache(fd, page_down(at), want) < want // PAGE:  # read in or being read in
                missing.append(at)
        behind.close()
        after = pages(path)
    finally:
        os.close(fd)
    assert not past, f"{len(set(past))} pages past the range were brought in (first at byte {min(past) * PAGE})"
    assert not missing, f"the range's next bytes were not read ahead after {len(missing)} reads (first at {missing[0]})"
    left = [p for p in inside([(lo, hi)]) if after[p]]
    assert not left, f"{len(left)} pages read were left cached (first {left[0]})"


def test_a_range_left_partway_loses_every_page_read_at_close(tmp_path):
    """A read that stops partway through a range (staging cancelled, a read error): close() drops what was read,
    past the last 2 MiB boundary that dropping behind the reads had reached."""
    path = tmp_path / "f"
    path.write_bytes(os.urandom(24 * MiB))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        lo, hi = MiB + 100, 20 * MiB
        behind = DropBehind(fd, [(lo, hi)], str(path))
        at = lo
        for _ in range(3):
            got = len(os.pread(fd, MiB + 4321, at))
            behind.read(at, at + got)
            at += got
        assert any(pages(path)[p] for p in inside([(lo, at)])), "nothing read is cached: the test proves nothing"
        behind.close()
        after = pages(path)
    finally:
        os.close(fd)
    left = [p for p in inside([(lo, at)]) if after[p]]
    assert not left, f"{len(left)} pages read before the stop were left cached (first at byte {left[0] * PAGE})"


@pytest.fixture
def shared_dir():
    """A directory on the tests' file system that another uid may read."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="pled-pagecache-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


@pytest.mark.root
def test_a_file_pled_may_not_see_the_cache_of_is_dropped_in_the_ranges_read_only(shared_dir):
    """A process that neither owns a file nor may write it gets no truth from cachestat or mincore (Linux 5.2+):
    pled then drops the ranges it read and nothing past them (the neighbours may be another reader's). The reader
    is a forked child as uid 65534; the file is root's, 0644."""
    from forked import as_user

    path = shared_dir / "f"
    path.write_bytes(os.urandom(8 * MiB))
    os.chmod(path, 0o644)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    Path(path).read_bytes()
    lo, hi = 2 * MiB - 1, 6 * MiB + 1  # inward: [2 MiB, 6 MiB), whole folios whatever their size

    def read_as_nobody() -> str:
        fd = os.open(path, os.O_RDONLY)
        try:
            if resident(fd, os.fstat(fd).st_size) is not None:
                return "residency claimed known"
            behind = DropBehind(fd, [(lo, hi)], "f")
            os.pread(fd, hi - lo, lo)
            behind.read(lo, hi)
            behind.close()
            return "read"
        finally:
            os.close(fd)

    assert as_user(read_as_nobody) == "read"
    after = pages(path)
    gone = [p for p in range(len(after)) if not after[p]]
    assert gone == sorted(inside([(lo, hi)])), f"dropped pages {gone[:3]}...{gone[-3:]}, {len(gone)} in all"
    fd = os.open(path, os.O_RDONLY)
    try:
        assert resident(fd, os.path.getsize(path)) == bytes(after), "root's view of the file's residency is wrong"
    finally:
        os.close(fd)


@pytest.mark.daemon
@pytest.mark.slow
def test_serve_verify_and_reload_keep_a_cached_checkpoints_pages(tmp_path, daemon):
    d = tmp_path / "m"
    files = checkpoint(d)
    for f in files:
        Path(f).read_bytes()
    before = {f: pages(f) for f in files}
    assert all(sum(v) == len(v) for v in before.values()), "the test could not cache the files"

    def kept(when: str) -> None:
        for f in files:
            after = pages(f)
            lost, _ = lost_and_brought(before[f], after)
            assert not lost, (f"after {when}: {len(lost)} pages of {os.path.basename(f)} dropped (first at byte "
                              f"{lost[0] * PAGE}); " + figures(before[f], after, ple_ranges(f)))

    pled = daemon({"qwen": {"checkpoint": d}})
    kept("pled serve staged the table")
    ok = harness.run_pled("verify", "--socket", pled.socket)
    assert ok.returncode == 0 and ok.stdout.count("identical (") == 2, ok.stdout
    kept("pled verify")
    lo, _ = ple_ranges(files[1])[2]
    with open(files[1], "r+b") as fh:  # a changed tensor: the reload restages the table
        fh.seek(lo + 10)
        b = fh.read(1)
        fh.seek(lo + 10)
        fh.write(bytes([b[0] ^ 1]))
        os.fsync(fh.fileno())
    assert pled.reload() == "reload done"
    st = json.loads(harness.run_pled("status", "--json", "--socket", pled.socket).stdout)
    assert st["tables"][0]["generation"] == 2, "the reload did not restage the table: it would prove nothing"
    kept("a reload restaged the table")


@pytest.mark.daemon
def test_verify_of_a_cold_checkpoint_takes_out_what_it_read_and_keeps_the_rest(tmp_path, daemon):
    d = tmp_path / "m"
    files = checkpoint(d)
    pled = daemon({"qwen": {"checkpoint": d}})
    for f in files:  # the other tensors cached, the PLE tensors cold
        Path(f).read_bytes()
        for lo, hi in ple_ranges(f):
            fadvise(f, lo, hi)
    before = {f: pages(f) for f in files}
    assert all(any(not before[f][p] for p in inside(ple_ranges(f))) for f in files), "PLE ranges not cold"
    ok = harness.run_pled("verify", "--socket", pled.socket)
    assert ok.returncode == 0, ok.stdout
    for f in files:
        after = pages(f)
        lost, brought = lost_and_brought(before[f], after)
        say = f"{os.path.basename(f)}: " + figures(before[f], after, ple_ranges(f))
        assert not lost, f"pled verify dropped {len(lost)} pages cached before (first at byte {lost[0] * PAGE}); {say}"
        assert not brought, f"pled verify left {len(brought)} pages it read (first at byte {brought[0] * PAGE}); {say}"


def test_the_scheduled_verify_locating_a_change_keeps_the_checkpoints_other_pages(tmp_path):
    """A writable table's scheduled verify (integrity.py) reads a changed piece's source to name the changed bytes:
    of a checkpoint file it drops only what that read brought in."""
    from pled.daemon.regions import integrity

    checkpoint(tmp_path)
    with staging.stage("t", open_checkpoint(str(tmp_path)), writable=True) as rw:
        piece = next(p for p in rw.manifest.pieces() if p.file == 1 and p.nbytes > 4 * PAGE)
        path = rw.manifest.shards[1].path
        os.pwrite(rw.fd, b"\x01" if os.pread(rw.fd, 1, piece.offset + 5) != b"\x01" else b"\x02", piece.offset + 5)
        Path(path).read_bytes()
        fadvise(path, piece.begin, piece.begin + piece.nbytes)  # the other tensors cached, this piece cold
        before = pages(path)
        assert any(not before[p] for p in inside([(piece.begin, piece.begin + piece.nbytes)])), "piece not cold"
        header = os.pread(rw.fd, rw.manifest.data_offset, 0)
        (diff,) = integrity.verify(rw.fd, rw.manifest, header, integrity.Throttle(1.0, 1 << 60)).differences
        assert (diff.start, diff.end) == (piece.offset + 5, piece.offset + 6), "the change was not located"
        after = pages(path)
    lost, brought = lost_and_brought(before, after)
    say = f"{os.path.basename(path)}: " + figures(before, after, [(piece.begin, piece.begin + piece.nbytes)])
    assert not lost, f"the verify dropped {len(lost)} pages cached before (first at byte {lost[0] * PAGE}); {say}"
    assert not brought, f"the verify left {len(brought)} pages it read (first at byte {brought[0] * PAGE}); {say}"
