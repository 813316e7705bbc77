"""Breakages that issue 32's tests must catch: the parsers of untrusted bytes back in superlinear time (the regex of
the JSON depth, the framer's search from the start, a shape's product before its rank, tomllib's dotted keys), a
client's parse no longer bounded by its timeout, the number checks skipped, the metrics writer blocking on a FIFO
or writing into one, and the kustomize overlay naming files outside its directory (tools/mutations.py's format and
runner).

    python tools/mutations_parsers.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_parsers.py --list     # and its other options (-k, --timeout)

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

L = "tests/test_linear_parsers.py::"
CALL = L + "test_a_call_of_escaped_quotes_is_refused_in_time_linear_in_its_size"
HEADER = L + "test_every_json_file_and_reply_of_escaped_quotes_is_refused_in_linear_time"
SHAPE = L + "test_a_shape_of_60000_extents_is_refused_at_the_cost_of_a_few_json_loads"
DOTTED = L + "test_a_config_of_long_dotted_keys_is_refused_in_linear_time"
TRICKLE = L + "test_a_message_trickled_a_byte_at_a_time_is_searched_once"
NUMBERS = L + "test_numbers_are_checked_wherever_one_could_be_too_long_or_infinite"
TIMEOUT = ("tests/test_client_untrusted.py::"
           "test_a_manifest_too_long_to_check_within_the_timeout_ends_attach_at_the_timeout")
NEGATIVE = "tests/test_attack_files.py::test_inspect_and_serve_refuse_a_bad_shard_in_one_line"
TMPFILE = "tests/test_metrics.py::test_the_temporary_file_is_opened_without_blocking_and_must_be_regular"
KUSTOMIZE = "tests/test_deploy.py::test_every_kustomization_builds_as_kubectl_apply_k_builds_it"

MUTATIONS = [
    Mutation("the JSON depth counted by a regular expression again (quadratic on escaped quotes)",
             "pled/shared/boundary.py",
             '    text = raw.replace(b"\\\\\\\\", b"").replace(b\'\\\\"\', b"")\n',
             '    import re\n'
             '    return re.sub(rb\'"[^"\\\\]*(?:\\\\.[^"\\\\]*)*"\', b"", raw, flags=re.DOTALL)'
             '.translate(None, _NOT_MARKS).replace(b\'"\', b"")\n',
             (CALL,)),
    Mutation("the framer searches a trickled message from its start at each byte", "pled/shared/protocol.py",
             'end = self._buf.find(b"\\0", self._searched)', 'end = self._buf.find(b"\\0")',
             (TRICKLE,)),
    Mutation("a shard header's shape multiplied out before its rank and extents are checked",
             "pled/daemon/sources/safetensors_file.py",
             "    problem = shape_problem(shape)  #", "    problem = None  #",
             (SHAPE, NEGATIVE + "[negative extents]")),
    Mutation("a config's dotted keys left to tomllib whatever their length", "pled/shared/config_file.py",
             "            if line.count(\".\") > MAX_DOTS:\n", "            if False:\n",
             (DOTTED,)),
    Mutation("numbers never checked (json.loads builds any integer, and infinity)", "pled/shared/boundary.py",
             'check = _numbers_to_check(data)  #', 'check = False  #',
             (NUMBERS,)),
    Mutation("attach's manifest parsed and checked without its timeout", "pled/client/library.py",
             "        with parse_deadline(conn.deadline):  #", "        if True:  #",
             (TIMEOUT,)),
    Mutation("the metrics' temporary file opened blocking (a FIFO there blocks the writer for good)",
             "pled/daemon/health/metrics_file.py",
             "os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, MODE)", "os.O_NOFOLLOW | os.O_CLOEXEC, MODE)",
             (TMPFILE,)),
    Mutation("the metrics' temporary file written whatever it is (a FIFO with a reader gets the figures)",
             "pled/daemon/health/metrics_file.py",
             "            if not stat.S_ISREG(os.fstat(fd).st_mode):", "            if False:",
             (TMPFILE,)),
    # From the second attack on these fixes.
    Mutation("every call a write brought handled in one turn of the loop", "pled/daemon/serving/server.py",
             "CALLS_PER_TURN = 1 ", "CALLS_PER_TURN = 1_000_000 ",
             ("tests/test_liveness.py::test_pings_are_answered_within_a_second_while_members_flood_the_socket",)),
    Mutation("clip escapes the whole text before cutting it", "pled/shared/boundary.py",
             "    s = printable(raw[:limit + 1])\n", "    s = printable(raw)\n",
             ("tests/test_escapes.py::test_clip_costs_what_it_shows_whatever_the_length_of_the_text",)),
    Mutation("a shard count a name claims listed in full", "pled/daemon/sources/naming.py",
             "            if len(missing) > 5:\n                break\n", "",
             ("tests/test_sidecar.py::test_a_name_that_claims_a_vast_shard_count_is_refused_at_once",)),
    Mutation("a reply's fds kept however many come", "pled/client/connection.py",
             "                if len(fds) > MAX_REPLY_FDS:", "                if False:",
             ("tests/test_client_untrusted.py::test_a_reply_with_more_fds_than_a_reply_carries_is_refused_and_they_are_closed",)),
    Mutation("a table's sources checked anew at every Status call", "pled/daemon/tables.py",
             "time.monotonic() - answer[2] < SOURCES_FRESH:", "time.monotonic() - answer[2] < 0:",
             ("tests/test_hung_sources.py::test_a_flood_of_status_calls_checks_the_sources_at_most_every_half_second",)),
    Mutation("the hugepages overlay names the base's files, outside its directory, again",
             "deploy/kubernetes/hugepages/kustomization.yaml",
             "  - ../base  #",
             "  - ../base/namespace.yaml\n  - ../base/pled-config.yaml\n  - ../base/pled-daemonset.yaml  #",
             (KUSTOMIZE,)),
]

if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
