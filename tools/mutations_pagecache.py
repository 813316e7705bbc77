"""Breakages that the page-cache tests (tests/test_page_cache_ranges.py: what staging, `pled verify`, a reload and
the scheduled verify leave of a checkpoint's page cache) must catch (tools/mutations.py's format).

    python tools/mutations_pagecache.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_pagecache.py --list     # and its other options

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

DB = "pled/shared/dropbehind.py"
T = "tests/test_page_cache_ranges.py::"
UNIT = T + "test_pages_shared_with_a_neighbour_stay_and_a_range_read_in_chunks_goes"
CACHED = T + "test_a_cached_checkpoint_keeps_every_page_through_staging"
EXACT = T + "test_a_tensor_not_at_the_files_start_exactly_the_ranges_read_are_dropped"
COLD = T + "test_a_cold_checkpoint_ends_with_no_more_than_a_chunk_of_pleds_pages"
UNSEEN = T + "test_a_file_pled_may_not_see_the_cache_of_is_dropped_in_the_ranges_read_only"
SERVED = T + "test_serve_verify_and_reload_keep_a_cached_checkpoints_pages"
VERIFY = T + "test_verify_of_a_cold_checkpoint_takes_out_what_it_read_and_keeps_the_rest"
LOCATE = T + "test_the_scheduled_verify_locating_a_change_keeps_the_checkpoints_other_pages"
PARTWAY = T + "test_a_range_left_partway_loses_every_page_read_at_close"
AHEAD = T + "test_a_range_read_brings_in_nothing_past_it_and_the_next_bytes_of_it_ahead"
ATTACK = "tests/test_attack5_pagecache.py::test_pages_another_reader_brings_in_during_staging_stay_cached"

MUTATIONS = [
    # Inward rounding: a page shared with a neighbouring tensor stays.
    Mutation("a range's first page rounded outward (the neighbour's shared page dropped)", DB,
             "        self._to = [page_up(b) for b, _ in self.runs]",
             "        self._to = [page_down(b) for b, _ in self.runs]",
             (UNIT, EXACT)),
    Mutation("a range's last page rounded outward", DB,
             "        stop = page_down(self.runs[i][1]) if end >= self.runs[i][1]",
             "        stop = page_up(self.runs[i][1]) if end >= self.runs[i][1]", (UNIT, EXACT)),
    # Only what was not cached before.
    Mutation("pages cached before pled read the file dropped too (the resident-before check skipped)", DB,
             '        if b"\\x01" not in was:\n', "        if True:\n", (UNIT, CACHED, EXACT)),
    Mutation("no residency snapshot: every checkpoint file taken for cold", DB,
             "        self.before = None if everything else resident(fd, size, *span)", "        self.before = None",
             (CACHED, EXACT)),
    Mutation("a partly cached file taken for wholly cached by cachestat's count (nothing of it dropped)", DB,
             "    if counted is not None and counted >= n:", "    if counted is not None and counted > 0:",
             (EXACT,)),
    Mutation("a partly cached file taken for cold by cachestat's count (its cached pages dropped)", DB,
             "    if counted == 0:", "    if counted is not None and counted < n:", (EXACT,)),
    Mutation("a process that may not see a file's cache trusts mincore's all-cached answer", DB,
             "    if not _may_see(fd):\n        return None\n", "",
             (UNSEEN,)),
    # Dropping behind; no kernel readahead past a range, pled's own read-ahead within it.
    Mutation("nothing dropped behind a read until its range is done", DB,
             "else end // PMD_SIZE * PMD_SIZE", "else self._to[i]", (UNIT,)),
    Mutation("a checkpoint's file read with the kernel's readahead (POSIX_FADV_RANDOM not set)", DB,
             "os.POSIX_FADV_SEQUENTIAL if everything else os.POSIX_FADV_RANDOM)",
             "os.POSIX_FADV_SEQUENTIAL)", (AHEAD, COLD, ATTACK)),
    Mutation("pled's read-ahead runs past the range's end", DB,
             "        ahead = min(self.runs[i][1], end + (end - begin)) - end",
             "        ahead = end - begin", (AHEAD, COLD)),
    Mutation("no read-ahead of the range's next bytes", DB,
             "        if not self.everything and ahead > 0:", "        if False:", (AHEAD,)),
    Mutation("the last chunk of a range left cached at close", DB,
             "            if self._touched[i] and page_down(end) > self._to[i]:", "            if False:",
             (PARTWAY,)),
    Mutation("pages dropped where the file's residency is unknown past the ranges read (the whole file)", DB,
             "        if self.before is None:\n            self._advise(lo, hi - lo)",
             "        if self.before is None:\n            self._advise(0, 0)", (UNSEEN,)),
    # Each path that reads a checkpoint: staging (serve and reload), pled verify, the scheduled verify.
    Mutation("staging (serve, reload) drops a checkpoint's file whole, as a sidecar's",
             "pled/daemon/regions/staging.py",
             "shard.path, everything=whole)", "shard.path, everything=True)", (CACHED, SERVED)),
    Mutation("pled verify drops a checkpoint's file whole", "pled/verify.py",
             'everything=table.manifest.form == "files")', "everything=True)", (SERVED, VERIFY)),
    Mutation("pled verify drops nothing behind its reads of a checkpoint", "pled/verify.py",
             "            behind.read(piece.begin + done, piece.begin + done + len(data))\n", "", (VERIFY,)),
    Mutation("the scheduled verify drops a checkpoint's file whole", "pled/daemon/regions/integrity.py",
             "everything=piece.begin == 0 and piece.nbytes == shard.size)", "everything=True)", (LOCATE,)),
    Mutation("the scheduled verify leaves what it read of a checkpoint", "pled/daemon/regions/integrity.py",
             "            behind.read(piece.begin + at, piece.begin + at + size)\n", "", (LOCATE,)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
