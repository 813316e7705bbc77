"""Breakages that the tests of the client's last line of defence must catch (issue 44 findings 4 and 5, issue 48
classes 8 and 9a; tools/mutations.py's format): a region's geometry checked on both sides, the plugin's bound on a
pled that does not answer and its wait for a table still being staged, and an Attach reply's fds.

    python tools/mutations_client_44.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_client_44.py --list     # and its other options

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

G = "tests/test_client_geometry.py::"
A = "tests/test_answer_timeout.py::"
F = "tests/test_reply_fds.py::"
PARSED = G + "test_a_bad_geometry_is_refused_by_the_manifest_parser"
SERVED = G + "test_a_bad_geometry_from_a_hostile_server_is_refused_and_nothing_is_kept"
CONTROLS = G + "test_tensors_listed_out_of_offset_order_and_empty_tensors_anywhere_are_accepted"
NEVER = A + "test_a_server_that_never_answers_fails_the_load_in_one_line_naming_the_socket_and_the_wait"
STAGING = A + "test_a_table_still_being_staged_is_waited_for_with_its_progress_said"
REPLY_FDS = F + "test_an_attach_reply_without_exactly_one_fd_is_refused_and_every_fd_closed"

MUTATIONS = [
    # A region's geometry (issue 44.5, 48.8).
    Mutation("arrays.check takes the last source's row count for where the arrays so far end (main's bug)",
             "pled/shared/arrays.py", "        free = a.offset + a.nbytes\n", "        free = a.shape[0]\n",
             (PARSED + "[two arrays at one offset]", SERVED + "[two arrays at one offset]")),
    Mutation("arrays may lie over the header and manifest", "pled/shared/arrays.py",
             "    free, seen = m.data_offset, set()", "    free, seen = 0, set()",
             (PARSED + "[an array over the header and manifest]",)),
    Mutation("an array may end past the region", "pled/shared/arrays.py",
             "or a.offset + a.nbytes > m.region_bytes:", "or a.offset > m.region_bytes:",
             (PARSED + "[an array ending past the region]",)),
    Mutation("tensors of one shard over each other accepted (main's files form)", "pled/shared/region_geometry.py",
             "    _refuse_overlapping_tensors(m.tensors)\n", "",
             (PARSED + "[two tensors of a shard at one offset]", SERVED + "[a tensor inside another]")),
    Mutation("tensors sharing their last byte accepted", "pled/shared/region_geometry.py",
             "        if begin < end:\n", "        if begin < end - 1:\n",
             (PARSED + "[two tensors of a shard overlapping by a byte]",)),
    Mutation("tensors compared in the manifest's order, not the offsets'", "pled/shared/region_geometry.py",
             "    placed = sorted((t.offset, t.offset + t.nbytes, i)",
             "    placed = list((t.offset, t.offset + t.nbytes, i)",
             (CONTROLS,)),
    Mutation("an empty tensor counted as lying over its neighbour", "pled/shared/region_geometry.py",
             "for i, t in enumerate(tensors) if t.nbytes)", "for i, t in enumerate(tensors))", (CONTROLS,)),
    Mutation("the data may begin inside the manifest", "pled/shared/region.py",
             "        if manifest.data_offset < _PREFIX.size + len(raw):", "        if False:",
             (PARSED + "[the data over the manifest]",)),
    Mutation("the daemon stages a plan its clients refuse", "pled/daemon/regions/planning.py",
             "        region.check(manifest)\n", "        pass\n",
             (G + "test_the_daemon_refuses_a_plan_its_clients_would_refuse",)),
    # The plugin's bound on a pled that does not answer (issue 44.4).
    Mutation("the Attach bounded by a fixed wait, not the setting", "pled/client/held_files.py",
             "populate=s.populate, timeout=s.answer_timeout)", "populate=s.populate, timeout=STAGING_WAIT / 100)",
             (NEVER + "[attach]",)),
    Mutation("the Attach waits in pled for a table being staged (main: a hung pled looks the same)",
             "pled/client/held_files.py", "populate=s.populate, timeout=s.answer_timeout)",
             "populate=s.populate, wait=True, timeout=s.answer_timeout)", (STAGING,)),
    Mutation("the Status listing the tables bounded by its default, not the setting", "pled/client/held_files.py",
             "timeout=s.answer_timeout), s.socket)", "timeout=STAGING_WAIT / 100), s.socket)",
             (NEVER + "[status]",)),
    Mutation("the setting ignored", "pled/client/held_files.py",
             '"PLED_SOCKET", _answer_timeout(extra))', '"PLED_SOCKET", ANSWER_TIMEOUT)',
             (A + "test_the_answer_timeout_is_read_from_the_environment",)),
    Mutation("a boolean answer_timeout in vLLM's config taken as a number", "pled/client/held_files.py",
             "        ok = type(value) in (int, float)\n", "        ok = isinstance(value, (int, float))\n",
             (A + "test_the_answer_timeout_from_vllms_additional_config",)),
    Mutation("an environment value not a decimal number parsed anyway", "pled/client/held_files.py",
             "ok = len(value) <= 20 and whole.isascii() and whole.isdigit() and", "ok = len(value) <= 20 and",
             (A + "test_a_bad_answer_timeout_in_the_environment_is_refused_in_one_line",)),
    Mutation("an answer timeout of 0 or above the cap accepted", "pled/client/held_files.py",
             "or not 0 < value <= MAX_ANSWER_TIMEOUT:", "or not value == value:",
             (A + "test_a_bad_answer_timeout_in_the_environment_is_refused_in_one_line",)),
    Mutation("a staging table's progress said at every ask", "pled/client/held_files.py",
             "            if time.monotonic() - said >= PROGRESS_EVERY:", "            if True:",
             (A + "test_progress_is_said_once_every_few_seconds_not_at_every_ask",)),
    Mutation("a staging table's progress never said", "pled/client/held_files.py",
             "                said = time.monotonic()\n                emit(logging.INFO,",
             "                said = time.monotonic()\n                (lambda *a: None)(logging.INFO,", (STAGING,)),
    Mutation("a table still being staged waited for without end", "pled/client/held_files.py",
             "            if waited >= STAGING_WAIT:", "            if False:",
             (A + "test_a_table_staged_longer_than_the_staging_wait_fails_the_load_naming_the_wait",)),
    Mutation("a table pled could not stage waited for", "pled/client/held_files.py",
             '            if progress.get("state") == "failed":', "            if False:",
             (A + "test_a_table_pled_could_not_stage_is_not_waited_for",)),
    # An Attach reply's fds (issue 48.9a).
    Mutation("an Attach reply with no fd taken", "pled/client/library.py",
             "        if len(fds) != 1:\n", "        if len(fds) > 1:\n", (REPLY_FDS + "[none]",)),
    Mutation("a reply's second fd taken by the connection", "pled/client/connection.py",
             "                if len(fds) > MAX_REPLY_FDS:", "                if False:", (REPLY_FDS,)),
    Mutation("control data cut short (MSG_CTRUNC) not noticed", "pled/client/connection.py",
             "                if flags & socket_mod.MSG_CTRUNC:", "                if False:", (REPLY_FDS,)),
    Mutation("the fds of a refused reply left open", "pled/client/connection.py",
             "half-way through a reply too: its fds are ours to close\n            close_all(fds)\n",
             "half-way through a reply too: its fds are ours to close\n            pass\n", (REPLY_FDS,)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
