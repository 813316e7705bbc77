"""Breakages that the tests of reloads of several tables, pled's fds after a reload, multi-table status and verify
exit codes, Status's ``sources`` and gathers at uneven shard boundaries must catch (tools/mutations.py's format).

    python tools/mutations_reload.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_reload.py --list     # and its other options

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

RELOAD = "tests/test_reload_many_tables.py::"
CODES = "tests/test_status_verify_codes.py::"
ONE_FAILS = RELOAD + "test_a_reload_where_one_of_several_tables_fails_changes_nothing_then_a_good_one_switches_them_all"

MUTATIONS = [
    # Several tables in one reload.
    Mutation("a reload switches as soon as one of its tables is staged, not once all are", "pled/daemon/reload.py",
             "        if all(x.state is State.READY for x in self.registry.next.values()):\n",
             "        if t.state is State.READY:\n",
             (ONE_FAILS,)),
    Mutation("a table removed from the config stays served", "pled/daemon/regions/planning.py",
             "[n for n in served if n not in sidecars]", "[]",
             (RELOAD + "test_one_reload_changes_adds_removes_and_keeps_tables_at_once",)),
    # pled's fds after a reload.
    # Kept, not merely left unclosed: a Region nobody refers to is closed by its __del__ all the same.
    Mutation("a replaced or removed generation's memfd kept open by pled", "pled/daemon/registry.py",
             "        old.region.close()\n", "        self.__dict__.setdefault('kept', []).append(old.region)\n",
             (RELOAD + "test_one_reload_changes_adds_removes_and_keeps_tables_at_once",)),
    Mutation("a failed reload keeps the next generations it had staged (and their memfds)", "pled/daemon/reload.py",
             "        self.registry.drop_next()\n", "",
             (ONE_FAILS,)),
    Mutation("a reload's planning leaks the fd of every header it reads", "pled/daemon/sources/safetensors_file.py",
             "    finally:\n        os.close(fd)\n    if len(raw) != header_len:\n",
             "    finally:\n        pass\n    if len(raw) != header_len:\n",
             (RELOAD + "test_pleds_fds_return_to_their_baseline_after_every_kind_of_reload",)),
    # Exit codes with several tables.
    Mutation("pled status healthy when any table is ready and resident", "pled/cli.py",
             "    healthy = all(t[\"state\"] == \"ready\"", "    healthy = any(t[\"state\"] == \"ready\"",
             (CODES + "test_status_exits_1_while_one_of_three_tables_is_still_staging",)),
    Mutation("pled verify's exit status from the last table it checked only", "pled/verify.py",
             "            ok = same and ok\n",
             "            ok = same\n",
             (CODES + "test_one_changed_table_of_three_fails_verify_and_shows_in_sources_while_status_stays_0",)),
    # Status's sources; what a reload compares.
    Mutation("Status's sources compares sizes only, not mtimes", "pled/daemon/tables.py",
             "        if (st.st_size, st.st_mtime_ns) != (s.size, s.mtime_ns):\n",
             "        if st.st_size != s.size:\n",
             (CODES + "test_sources_reports_a_same_size_rewrite_by_its_mtime_and_verify_by_its_bytes",)),
    Mutation("a reload takes a table whose shards' mtimes moved as unchanged", "pled/shared/region.py",
             "replace(s, digest=d) for s, d in zip(self.shards",
             "replace(s, digest=d, mtime_ns=0) for s, d in zip(self.shards",
             (RELOAD + "test_a_same_size_rewrite_that_keeps_its_mtime_is_not_reloaded_and_only_verify_finds_it",)),
    Mutation("a reload refused while opening one table's files does not say which table",
             "pled/daemon/regions/planning.py",
             '            e.args = (f"table {clip(t.name)}: {e}",)\n', "",
             (RELOAD + "test_a_reload_refused_while_planning_names_the_table",)),
    Mutation("pled status --live exits 1 while a table stages (a liveness probe would kill a staging pled)",
             "pled/cli.py", "code = 0 if healthy or args.live else 1", "code = 0 if healthy else 1",
             (CODES + "test_status_exits_1_while_one_of_three_tables_is_still_staging",)),
    # Gathers at the boundaries of uneven shards.
    Mutation("gather: the first row of a shard taken from the shard before it", "pled/client/gather.py",
             "torch.searchsorted(self._boundaries, ids, right=True, out=shard)",
             "torch.searchsorted(self._boundaries, ids, right=False, out=shard)",
             ("tests/test_unaligned_tables.py::test_gather_is_exact_whatever_the_tensor_offsets",)),
    Mutation("gather: every shard taken to hold as many rows as the first", "pled/client/gather.py",
             "            first += shard.rows\n", "            first += manifest.shards[0].rows\n",
             ("tests/test_unaligned_tables.py::test_gather_is_exact_whatever_the_tensor_offsets",)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
