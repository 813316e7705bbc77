"""Breakages that the tests of pled's journal entries must catch (tests/test_journal.py): the MESSAGE_IDs and the
PLED_* fields of each kind of event, the native format, the stderr lines that take over when the journal's socket
does not take a record, the choice of the journal where stderr is the journal, and the catalog's ids
(tools/mutations.py's format and runner).

    python tools/mutations_journal.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_journal.py --list     # and its other options (-k, --timeout)

Each ``old`` is a short piece of one line (or a few), so that re-wrapping the code around it does not lose it;
tools/mutations.py's runner refuses one that does not occur exactly once. tools/mutations.py runs these with its own
(``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

T = "tests/test_journal.py::"
SERVE = T + "test_ready_clients_and_reloads_reach_the_journal_with_their_fields"
REFUSED = T + "test_a_refusal_at_start_is_one_refused_entry"
FALLBACK = T + "test_a_socket_full_or_gone_sends_each_record_to_stderr_at_once"
SETUP = T + "test_setup_writes_to_the_journal_only_where_stderr_is_the_journal"
VERIFY = T + "test_pled_verify_under_journald_records_a_table_that_differs"
BIG = T + "test_an_entry_too_big_for_a_datagram_goes_in_a_sealed_memfd"

MUTATIONS = [
    # The fields of each kind of event.
    Mutation("a client's attach without its MESSAGE_ID", "pled/daemon/handlers.py",
             'journal.fields("client_attached", table=name,', "journal.fields(table=name,", (SERVE,)),
    Mutation("the ready entry without its tables", "pled/daemon/lifecycle.py",
             'journal.fields("ready", table=[t.name for t in tables])', 'journal.fields("ready")', (SERVE,)),
    Mutation("a reload's entry leaves out the tables it changed", "pled/daemon/reload.py",
             'names = reply["changed"] + reply["added"] + reply["removed"]',
             'names = reply["added"] + reply["removed"]', (SERVE,)),
    Mutation("a failed reload's entry leaves out the table whose files were refused", "pled/daemon/reload.py",
             "tables = [table] if table else list(self.registry.next)", "tables = list(self.registry.next)", (SERVE,)),
    Mutation("a dropped client's entry leaves out the client", "pled/daemon/serving/server.py",
             'clip(reason),\n                           extra=journal.fields("client_dropped", peer=conn.peer))',
             'clip(reason),\n                           extra=journal.fields("client_dropped"))', (SERVE,)),
    Mutation("a client refused by the access policy is not a client_refused entry", "pled/daemon/serving/server.py",
             'extra=journal.fields("client_refused", peer=conn.peer))\n            self.send(conn, Reply(',
             "extra={})\n            self.send(conn, Reply(", (T + "test_a_refused_client_is_a_client_refused_entry",)),
    Mutation("the refusal pled exits 78 with is not tagged refused", "pled/cli.py",
             'log.error("%s", err, extra=journal.refusal_fields(err))', 'log.error("%s", err)', (REFUSED,)),
    Mutation("a preflight refusal logged twice (startup and the command)", "pled/daemon/startup.py",
             '    if verdict.ok:\n        log.info("%s", verdict.message)\n    else:\n',
             '    (log.info if verdict.ok else log.error)("%s", verdict.message)\n    if not verdict.ok:\n',
             (REFUSED,)),
    Mutation("pled verify under journald records nothing", "pled/verify.py",
             "if bad and logs.journal_socket() is not None:", "if False:", (VERIFY,)),
    Mutation("a catalogued MESSAGE_ID changed in the code", "pled/daemon/health/journal.py",
             '"verify_differs": "2b056be33c5e416b9e9571a1ccb313bc"',
             '"verify_differs": "2b056be33c5e416b9e9571a1ccb313bd"',
             (T + "test_the_catalog_is_accepted_and_lists_exactly_the_ids_pled_emits",)),
    # The format.
    Mutation("a value's newline left as it is (not escaped)", "pled/daemon/health/journal.py",
             "items += [(key, printable(v)) for v in", "items += [(key, str(v)) for v in",
             (T + "test_no_value_can_end_its_field_and_start_another",)),
    Mutation("a value with a newline sent as KEY=value (no binary length form)", "pled/daemon/health/journal.py",
             '    if b"\\n" in data:\n        return key.encode() + b"\\n"',
             '    if False:\n        return key.encode() + b"\\n"',
             (T + "test_no_value_can_end_its_field_and_start_another",)),
    Mutation("an entry too big for a datagram falls back instead of going in a memfd", "pled/daemon/health/journal.py",
             "                raise\n            self._send_memfd(data)\n",
             "                raise\n            raise\n", (BIG,)),
    Mutation("the memfd of a big entry not sealed", "pled/daemon/health/journal.py",
             "            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)\n", "", (BIG,)),
    # Never block, never lose a line.
    Mutation("a record the journal's socket refused is lost", "pled/daemon/health/journal.py",
             "            self.fallback.handle(record)\n", "",
             (FALLBACK, T + "test_a_journal_socket_that_is_full_or_gone_leaves_pled_serving_and_the_lines_on_stderr")),
    Mutation("a send waits while the journal is full (no MSG_DONTWAIT)", "pled/daemon/health/journal.py",
             "self._sock.sendto(data, socket.MSG_DONTWAIT, self.path)", "self._sock.sendto(data, 0, self.path)",
             (FALLBACK,)),
    Mutation("the note that the journal refuses records repeated for every record", "pled/daemon/health/journal.py",
             "if self._noted is None or now - self._noted >= NOTE_EVERY:", "if True:", (FALLBACK,)),
    # Where stderr is the journal, and only there.
    Mutation("the journal used wherever its socket is, JOURNAL_STREAM or not", "pled/daemon/health/logs.py",
             "    if not stderr_is_journal(env):\n        return None\n", "",
             (VERIFY,)),
    Mutation("journald's form (native, <N> lines) used whatever stderr is", "pled/daemon/health/logs.py",
             "    if stderr_is_journal():\n", "    if True:\n", (SETUP,)),
    Mutation("the journal used where stderr is the journal but its socket is not there", "pled/daemon/health/logs.py",
             "return path if stat.S_ISSOCK(os.stat(path).st_mode) else None", "return path", (SETUP,)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
