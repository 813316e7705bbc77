"""Breakages an outside audit made on purpose that the suite missed (issue 33): the journal's binary field form, huge
page pools as the kernel has them (a parent cgroup's limit, two page sizes at once), NUMA where the kernel refuses
the call, a region sealed against writing only, the pled command's output (escaped notes, the Prometheus form's exit
status), `pled verify`'s report past its first chunk, and a kill -9 at each point of staging (tools/mutations.py's
format and runner).

    python tools/mutations_audit_kernel.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_audit_kernel.py --list     # and its other options (-k, --timeout)

tools/mutations.py runs these with its own (``every_mutation()``). Some tests need root (a hugetlb cgroup, a memory
cgroup, reserved huge pages); they skip elsewhere, and a skipped test catches nothing.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

JOURNAL = "tests/test_journal.py::"
REFUSED = ("tests/test_pageplan.py::"
           "test_where_the_kernel_refuses_mbind_and_set_mempolicy_tables_are_staged_unplaced_and_the_log_says_why")
TWO_SIZES = "tests/test_pageplan.py::test_tables_on_2m_and_1g_pages_at_once_each_count_against_their_own_pool_only"
CODES = "tests/test_status_verify_codes.py::"
ESCAPES = "tests/test_escapes.py::"
WRITE_ONLY = "tests/test_systemd.py::test_a_stored_region_sealed_against_writing_only_is_not_adopted_and_is_staged_anew"

MUTATIONS = [
    # The journal's native protocol: a value's length in bytes.
    Mutation("a multi-line journal value's length counted in characters, not bytes", "pled/daemon/health/journal.py",
             'struct.pack("<Q", len(data)) + data', 'struct.pack("<Q", len(value)) + data',
             (JOURNAL + "test_a_multi_line_message_in_other_scripts_arrives_whole_its_length_counted_in_bytes",)),
    # Huge-page pools as the kernel has them: a parent cgroup's limit; two page sizes, each its own pool.
    Mutation("the hugetlb cgroup's limit read on pled's own cgroup only, not on the levels above it",
             "pled/daemon/memory/hugetlb.py", "    for level, directory in place.upwards():\n",
             "    for level, directory in list(place.upwards())[:1]:\n",
             ("tests/test_hugetlb_tables.py::test_a_hugetlb_limit_on_a_parent_cgroup_is_honoured_by_the_preflight",)),
    Mutation("every hugetlb table counted against the pool of every page size", "pled/daemon/memory/preflight.py",
             "{n: tables[n] for n, (s, _) in huge.items() if s == size},\n"
             "                                 {n: b for n, (s, b) in huge.items() if s == size}",
             "{n: tables[n] for n, (s, _) in huge.items()},\n"
             "                                 {n: b for n, (s, b) in huge.items()}",
             (TWO_SIZES,)),
    Mutation("a hugetlb table's pages taken from the 2 MiB pool's room whatever their size",
             "pled/daemon/memory/pageplan.py", "            pools.take(page_size, need)\n",
             "            pools.take(PMD_SIZE, need)\n", (TWO_SIZES,)),
    # NUMA where the kernel refuses the call (a system-call filter answering EPERM).
    Mutation("a region placed by its NUMA policy even where the kernel refuses mbind/set_mempolicy",
             "pled/daemon/regions/regionfd.py",
             "policy = pages.numa if pages is not None and not pages.numa.refused else None",
             "policy = pages.numa if pages is not None else None", (REFUSED,)),
    Mutation("whether the kernel refuses mbind/set_mempolicy never asked", "pled/daemon/memory/pageplan.py",
             '    refused = numa.refused() if root == "/" else ""\n', '    refused = ""\n', (REFUSED,)),
    Mutation("Status says nothing of why a table's pages were not placed (the log alone does)",
             "pled/daemon/memory/pageplan.py",
             "    not_placed = (plan.numa.refused or None) if plan is not None else None",
             "    not_placed = None", (REFUSED,)),
    Mutation("pled status shows no note for a table whose pages were not placed", "pled/cli.py",
             '        if numa.get("not_placed"):\n', "        if False:\n", (REFUSED,)),
    # A region sealed against writing only: it may still shrink under a client's mapping (SIGBUS).
    Mutation("a memfd sealed against writing only counts as sealed (client and adoption alike)", "pled/shared/memfd.py",
             "    if have & SEALS != SEALS:\n", "    if not have & fcntl.F_SEAL_WRITE:\n",
             ("tests/test_client_untrusted.py::test_a_memfd_sealed_against_writes_only_is_refused", WRITE_ONLY)),
    Mutation("adoption from the fd store checks only the write seal", "pled/daemon/systemd/fdstore.py",
             "            region.check_sealed_memfd(item.fd)  # first,",
             '            if not region.seals(item.fd) & 0x8: raise RegionError("not sealed")  # first,',
             (WRITE_ONLY,)),
    # The pled command's output: notes escaped; the Prometheus form printed with exit 0 while a table stages.
    Mutation("pled status prints a table's notes (its error, its huge-page note) unescaped", "pled/cli.py",
             'say(f"  note: {note}")', 'print(f"  note: {note}")',
             (ESCAPES + "test_a_tables_error_and_its_huge_page_note_reach_the_terminal_escaped",)),
    Mutation("pled status --format prometheus exits 1 while a table stages (a scrape script drops the figures)",
             "pled/cli.py", "        sys.stdout.buffer.write(metrics.render(st))\n        return 0\n",
             "        sys.stdout.buffer.write(metrics.render(st))\n        return code\n",
             (CODES + "test_status_exits_1_while_one_of_three_tables_is_still_staging",)),
    # A kill -9 at each point of a start: the next start is not blocked by what the dead one left.
    Mutation("a stale socket left by a killed pled refused like a live one (the next start fails)",
             "pled/daemon/serving/listener.py",
             '            log.info("removing stale socket %s left by a daemon that is gone", path)\n'
             "            os.unlink(path)\n",
             '            raise SocketInUse(f"{path} exists; remove it if no pled is running")\n',
             ("tests/test_faults.py::test_kill_9_at_each_point_of_staging_pled_reports_leaves_nothing_behind",)),
    # pled verify: a difference past the first chunk it reads.
    Mutation("pled verify names a difference by its offset in the chunk read, not in the file", "pled/verify.py",
             "at = done + _first_difference(", "at = _first_difference(",
             (CODES + "test_verify_names_the_byte_and_both_values_of_a_difference_past_its_first_read",)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
