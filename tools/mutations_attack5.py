"""Breakages that the fifth attack's tests (tests/test_attack5_*.py, issue 44 "Must show") must catch
(tools/mutations.py's format).

    python tools/mutations_attack5.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_attack5.py --list     # and its other options

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

WRITERS = "tests/test_attack5_writers.py::"
HEADER = "tests/test_attack5_writable_header.py::"
EVICTS = HEADER + "test_root_verify_never_reads_or_evicts_a_file_a_writer_names_in_the_header"
REFUSES = HEADER + "test_a_client_refuses_a_writable_region_whose_header_a_writer_changed"
REPAIR = HEADER + "test_verify_repair_restages_a_data_change_the_scheduled_verify_has_not_seen"
MAKERS = ("tests/test_attack5_makers.py::"
          "test_a_checkpoint_too_large_to_write_is_refused_in_one_line_before_anything_is_written")

MUTATIONS = [
    Mutation("a writable table's writers looked up by name at every Attach (NSS on the loop)", "pled/daemon/config.py",
             "        return self._writer_uids\n",
             "        return frozenset(writer_uid(w) for w in self.writers) if self.writable else frozenset()\n",
             (WRITERS + "test_removing_a_writer_from_the_user_database_does_not_fail_every_attach",
              WRITERS + "test_a_writers_name_given_to_another_uid_gives_it_no_write_access_without_a_reload",
              WRITERS + "test_names_in_a_loaded_config_are_resolved_once")),
    Mutation("allow_groups looked up by name whenever the policy is made", "pled/daemon/config.py",
             "        return self._allow_gids\n",
             "        return frozenset(g if isinstance(g, int) else grp.getgrnam(g).gr_gid\n"
             "                         for g in self.allow_groups)\n",
             (WRITERS + "test_names_in_a_loaded_config_are_resolved_once",)),
    # A writable table's header: in the writers' reach, checked by every client against the reply's digest.
    Mutation("the client takes a writable region's header whatever the reply's digest", "pled/shared/region.py",
             "    if expect_sha256 is not None and digest != expect_sha256:", "    if False:", (EVICTS, REFUSES)),
    Mutation("a writable table's client asks for no staged digest", "pled/client/library.py",
             'staged = _staged_manifest(params, conn.path, table) if gpu_access == "writable" else None',
             "staged = None", (EVICTS, REFUSES)),
    Mutation("the daemon's Attach reply leaves out manifest_sha256", "pled/daemon/handlers.py",
             "if writable and t.header else {}", "if False else {}",
             ("tests/test_writable_route.py::test_the_writer_gets_one_read_write_mapping_it_can_turn_read_only",)),
    # pled verify --repair: the writable tables it found changed are staged anew.
    Mutation("verify --repair names no table to restage", "pled/cli.py",
             '**({"restage": restage} if restage else {})', "**{}", (REPAIR,)),
    Mutation("a reload ignores restage", "pled/daemon/reload.py",
             "for name, identity in served.items() if name not in restage}",
             "for name, identity in served.items()}", (REPAIR,)),
    # pled make-checkpoint: what it would write, bounded before anything is drawn (the runs are bounded by pytest's
    # own timeout where the breakage lets one run on: tools/mutations.py counts that as not caught, so each
    # mutation keeps a case that fails at once).
    Mutation("make-checkpoint writes rows without looking at the free space", "pled/makers.py",
             "    if nbytes <= free:\n", "    if True:\n", (MAKERS + "[args0---rows 99999999999999]",)),
    Mutation("make-checkpoint takes any number of parts", "pled/makers.py",
             '("--parts", args.parts, 1 <= args.parts <= MAX_PARTS)', '("--parts", args.parts, 1 <= args.parts)',
             (MAKERS + "[args1---parts 1000000000]",)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
