"""Breakages that the tests of overlapping reloads (issue 48, class 7) and of a reload's large plans kept off the loop
(issue 44, finding 3) must catch (tools/mutations.py's format).

    python tools/mutations_reloads.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_reloads.py --list     # and its other options

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

OVERLAP = "tests/test_reload_overlap.py::"
FIRST = OVERLAP + "test_sighups_during_the_first_staging_cause_one_reload_once_it_is_done"
SHARED = OVERLAP + "test_overlapping_reloads_share_one_answer_and_sighups_cause_one_more"
OFF_LOOP = "tests/test_reload_plan_off_loop.py::"
LIVE = ("tests/test_liveness.py::"
        "test_pings_are_answered_within_100_ms_while_a_reload_reads_the_largest_input_pled_accepts")

MUTATIONS = [
    # Overlapping reloads.
    Mutation("a SIGHUP during a reload or the first staging is forgotten", "pled/daemon/reload.py",
             "                self._again = True\n", "                pass\n",
             (FIRST, SHARED)),
    Mutation("the reload a SIGHUP asked for never clears the request: reloads run in a loop", "pled/daemon/reload.py",
             "            self._again = False\n            self.begin(None)\n",
             "            self.begin(None)\n",
             (FIRST, SHARED)),
    Mutation("the reload SIGHUPs asked for during the first staging never runs", "pled/daemon/reload.py",
             "        self._serving = True\n        self._run_deferred()\n", "        self._serving = True\n",
             (FIRST,)),
    Mutation("a SIGHUP during the first staging reloads at once, beside it", "pled/daemon/reload.py",
             "        if self.current is not None or not self._serving:\n",
             "        if self.current is not None:\n",
             (FIRST,)),
    Mutation("a second pled reload while one is under way is never answered", "pled/daemon/reload.py",
             "                self.current.callers.append(caller)  # it will answer this caller too\n",
             "                pass\n",
             (SHARED,)),
    Mutation("only the first caller of a reload gets its answer", "pled/daemon/reload.py",
             "        for conn in callers:\n            self.answer(conn, reply)\n",
             "        for conn in callers[:1]:\n            self.answer(conn, reply)\n",
             (SHARED,)),
    Mutation("a SIGHUP's reload runs before the held reload's callers are answered, and they get its answer",
             "pled/daemon/reload.py",
             "        for conn in callers:\n            self.answer(conn, reply)\n        if self.stopping.is_set():",
             "        if self._again and not self.stopping.is_set():\n            self._again = False\n"
             "            self.begin(None)\n            self.current.callers += callers\n            return\n"
             "        for conn in callers:\n            self.answer(conn, reply)\n        if self.stopping.is_set():",
             (SHARED,)),
    Mutation("a Reload call during the first staging waits instead of being refused", "pled/daemon/reload.py",
             '            return Reply(protocol.error(protocol.RELOAD_FAILED,\n'
             '                                        reason="the first staging is still under way; try again"))\n',
             "            return PENDING\n",
             (FIRST,)),
    Mutation("Status's reload progress counts no callers", "pled/daemon/reload.py",
             '"callers": len(r.callers),', '"callers": 1,',
             (SHARED,)),
    # A reload's large plan, kept off the loop.
    Mutation("a reload's planning parses in a thread of pled's, not in a child process",
             "pled/daemon/regions/parsing.py",
             "    import pled\n\n    root = os.path.dirname(",
             "    from pled.daemon.regions import planning\n\n"
             "    return planning.plan_reload(source, served, proc_root, served_pages, served_writable)\n"
             "    root = os.path.dirname(",
             (LIVE + "[an index of 2.3 million entries (32 MiB)]",)),
    Mutation("the plan is unpickled with the collector on", "pled/daemon/regions/parsing.py",
             "    gc.disable()\n    try:\n        return _loads(data)\n", "    try:\n        return _loads(data)\n",
             (OFF_LOOP + "test_a_large_plan_is_unpickled_without_a_collection_and_then_frozen",)),
    Mutation("the plan's objects are left to later collections (not frozen)", "pled/daemon/regions/parsing.py",
             "            gc.enable()\n        gc.freeze()\n", "            gc.enable()\n",
             (OFF_LOOP + "test_a_large_plan_is_unpickled_without_a_collection_and_then_frozen",)),
    Mutation("the collector is left off after a plan is unpickled", "pled/daemon/regions/parsing.py",
             "        if enabled:\n            gc.enable()\n", "        pass\n",
             (OFF_LOOP + "test_a_large_plan_is_unpickled_without_a_collection_and_then_frozen",
              OFF_LOOP + "test_the_collector_stays_off_only_while_unpickling_and_is_left_as_found")),
    Mutation("a checkpoint file's header keeps every tensor in the plan", "pled/daemon/sources/checkpoint.py",
             "            holding[path] = replace(header, tensors=tuple(t for t, _ in hits))\n",
             "            holding[path] = header\n",
             (OFF_LOOP + "test_a_checkpoint_file_keeps_only_its_ple_tensors_and_its_identity",)),
    Mutation("a checkpoint file's header keeps its PLE tensors but not its fingerprint",
             "pled/daemon/sources/checkpoint.py",
             "replace(header, tensors=tuple(t for t, _ in hits))",
             "replace(header, tensors=tuple(t for t, _ in hits), fingerprint='')",
             (OFF_LOOP + "test_a_checkpoint_file_keeps_only_its_ple_tensors_and_its_identity",)),
    Mutation("a uid at the end of a mapped range taken as mapped one past it", "pled/daemon/serving/access.py",
             "bisect.bisect_left(left, inside + count)", "bisect.bisect_right(left, inside + count)",
             (OFF_LOOP + "test_unmapped_ids_by_the_maps_ranges_at_their_edges",)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
