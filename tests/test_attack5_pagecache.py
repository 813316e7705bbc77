"""The fifth attack on the page-cache handling of a checkpoint table (pled/shared/dropbehind.py): pages another
reader brings in while pled stages are not pled's to drop.

Finding (fixed): DropBehind took its one residency snapshot of a file when staging opened it, and at its close
dropped the "readahead tail" after each run of PLE tensors (up to 64 MiB, or 4 x read_ahead_kb) wherever that
snapshot said cold. Now pled reads a checkpoint's file with POSIX_FADV_RANDOM on its own fd and its own read-ahead
never passes a range: there is no tail to drop. A page that another process read between that snapshot and the
close (vLLM starting beside a reload, a backup, `sha256sum`) was dropped too, though pled did not bring it in: for a
checkpoint whose layers each hold a run of PLE shards, a window after every layer's run. Real page cache figures
(mincore over a mapping, read by the helper of tests/test_page_cache_ranges.py), real files on ext4; the other
reader reads with its own fd, from pled's staging thread's own check between chunks (a point inside the staging,
where a concurrent reader's read could fall), so that the test needs no timing."""
import os

from pled.daemon.regions import staging
from pled.daemon.sources.checkpoint import open_checkpoint
from pled.shared.pagecache import PAGE
from test_page_cache_ranges import MiB, checkpoint, fadvise, pages, ple_ranges

WINDOW = 1 * MiB  # what the other reader reads just past each run of PLE tensors (within 6 MiB of other tensors)


def runs(path) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in ple_ranges(path):
        if out and lo == out[-1][1]:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def test_pages_another_reader_brings_in_during_staging_stay_cached(tmp_path):
    files = checkpoint(tmp_path)
    for f in files:
        fadvise(f, 0, os.path.getsize(f))
    assert all(sum(pages(f)) == 0 for f in files), "the test could not drop the files' pages"
    windows = {f: [(-(-hi // PAGE) * PAGE, -(-hi // PAGE) * PAGE + WINDOW) for _, hi in runs(f)] for f in files}
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    read_at: list[int] = []

    def other_reader() -> bool:  # called by the staging thread between chunks: the other process's reads land here
        read_at.append(len(read_at))
        if len(read_at) > 1:  # once, inside the first file's staging (read again later, they would be cached anew)
            return False
        for f, ws in windows.items():
            for lo, hi in ws:
                os.pread(fds[f], hi - lo, lo)
        return False

    try:
        with staging.stage("t", open_checkpoint(str(tmp_path)), should_stop=other_reader, chunk=MiB):
            pass
        lost = {os.path.basename(f): [p for lo, hi in windows[f] for p in range(lo // PAGE, hi // PAGE)
                                      if not pages(f)[p]] for f in files}
    finally:
        for fd in fds.values():
            os.close(fd)
    assert read_at, "the other reader never read: the test would prove nothing"
    each = WINDOW // PAGE * len(runs(files[0]))
    assert not any(lost.values()), ("pages another reader read while pled staged were dropped: "
                                    + ", ".join(f"{f}: {len(v)} of {each}" for f, v in lost.items()))
