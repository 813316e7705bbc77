"""Breakages that the tests of the writable route (issue 45: gpu_access = "writable", its writers, the scheduled
verify) must catch (tools/mutations.py's format).

    python tools/mutations_writable.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_writable.py --list     # and its other options

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

UNITS = "tests/test_writable_units.py::"
ROUTE = "tests/test_writable_route.py::"
NON_WRITER = ROUTE + "test_a_non_writer_in_pleds_group_cannot_write_the_table_by_any_route"
SEALS = UNITS + "test_a_writable_table_is_sealed_against_all_but_writing_and_its_inode_is_0440"
WRITER = ROUTE + "test_the_writer_gets_one_read_write_mapping_it_can_turn_read_only"
FOUND = ROUTE + "test_a_byte_the_writer_changed_is_found_within_the_period_shown_everywhere_and_repaired"
SCHEDULED = ROUTE + "test_an_unchanged_writable_table_is_verified_on_schedule_and_stays_healthy"
RANGE = UNITS + "test_a_changed_byte_is_found_and_named_by_its_exact_range"

MUTATIONS = [
    # The daemon: the memfd, who gets which fd.
    Mutation("a writable table sealed against writing too (its writers could not map it)",
             "pled/daemon/regions/staging.py", "region.WRITABLE_SEALS if writable else region.SEALS", "region.SEALS",
             (SEALS,)),
    Mutation("a writable table's inode left 0444 (any uid may reopen it read-only through /proc)",
             "pled/daemon/regions/staging.py", "region.WRITABLE_MODE if writable else 0o444", "0o444", (SEALS,)),
    Mutation("every client of a writable table gets pled's read-write fd", "pled/daemon/serving/session.py",
             "                if reply.writable:  # a writer", "                if True:  # a writer",
             (NON_WRITER + "[write]", NON_WRITER + "[mmap-PROT_WRITE-MAP_SHARED]")),
    Mutation("any uid counted as a writer", "pled/daemon/handlers.py",
             "conn.peer.uid in cfg.writer_uids", "conn.peer.uid >= 0", (NON_WRITER + "[fchmod]",)),
    Mutation("the fd store adopts a writable region after a restart", "pled/daemon/systemd/fdstore.py",
             "if region.seals(item.fd) & region.SEALS == region.WRITABLE_SEALS:", "if False:",
             (UNITS + "test_the_fd_store_never_adopts_a_writable_region_nor_a_sealed_one_for_a_writable_table",)),
    Mutation("writers accepted on a read-only table", "pled/daemon/config.py",
             '        if self.gpu_access != "writable":\n            for key, given in',
             '        if False:\n            for key, given in',
             (UNITS + "test_bad_writable_keys_are_refused_naming_the_key",)),
    # The client.
    Mutation("the writer maps its table read-only", "pled/client/mapped_table.py",
             "prot=mmap.PROT_READ | mmap.PROT_WRITE) if writer", "prot=mmap.PROT_READ) if writer", (WRITER,)),
    Mutation("protect() leaves the writer's mapping writable", "pled/client/mapped_table.py",
             "libc.mprotect(self.address, len(self.buffer), mmap.PROT_READ)",
             "libc.mprotect(self.address, len(self.buffer), mmap.PROT_READ | mmap.PROT_WRITE)",
             (WRITER, ROUTE + "test_a_write_through_the_protected_mapping_faults")),
    Mutation("the client takes a read-write fd without being told it is a writer", "pled/client/library.py",
             "if mode != (os.O_RDWR if writer else os.O_RDONLY) and", "if False and",
             (UNITS + "test_the_client_takes_the_gpu_side_of_the_reply_and_checks_the_fds_mode",)),
    # The scheduled verify.
    Mutation("the verify skips the header and manifest", "pled/daemon/regions/integrity.py",
             "        if got != want:\n", "        if False:\n", (RANGE,)),
    Mutation("a changed piece named whole, its source not compared", "pled/daemon/regions/integrity.py",
             "    return Difference(piece.offset + first, piece.offset + last + 1, piece.name)",
             "    return whole", (RANGE,)),
    Mutation("the last changed byte searched on the wrong side", "pled/daemon/regions/integrity.py",
             "(not first and not right_differs)", "(not first and right_differs)", (RANGE,)),
    Mutation("the throttle keeps the bandwidth only, not the CPU share", "pled/daemon/regions/integrity.py",
             "max(cpu / self.cpu_share, self.done / self.bandwidth)", "self.done / self.bandwidth",
             (UNITS + "test_the_throttle_keeps_the_cpu_share_and_the_bandwidth",)),
    Mutation("no header kept for a writable table: it is never verified", "pled/daemon/registry.py",
             "                if t.writable:  # its header as staged",
             "                if False:  # its header as staged",
             (SCHEDULED,)),
    Mutation("the verify never scheduled", "pled/daemon/lifecycle.py",
             "        if self.ready and not self.stopping.is_set():\n            self._verify_due(now)\n",
             "        pass\n", (SCHEDULED,)),
    Mutation("a modified table kept by a reload (no repair)", "pled/daemon/registry.py",
             "for name, t in self._served.items() if t.modified is None}", "for name, t in self._served.items()}",
             (FOUND,)),
    Mutation("pled status exits 0 with a modified table", "pled/cli.py",
             '                  and not t.get("modified") for t in st["tables"])',
             '                  for t in st["tables"])', (FOUND,)),
    Mutation("the writers' pids left out of the crit line", "pled/daemon/scheduled_verify.py",
             "if t.name in c.writes and c.attached.get(t.name) == t.generation", "if False", (FOUND,)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
