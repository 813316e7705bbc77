"""Breakages from an outside audit of serving (issue 33) that the suite missed, and the tests that now catch each:
whose budget the connections and fds pled dropped but keeps open count in (a uid's share), pled's own user among
the operators, the operators' last 8 connections, a log budget's refill capped at its burst, refusal lines per uid
whatever the pids, an idle loop after signals, the client against a server whose fds the kernel cut short or that
sends one too many, a dropped connection drained to its end, and each term of a uid's share of fds in flight
(tools/mutations.py's format and runner).

    python tools/mutations_audit_serving.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_audit_serving.py --list     # and its other options (-k, --timeout)

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

FDS = "tests/test_fds_in_flight.py::"
PEERS = "tests/test_peers_admitted_refused_dropped.py::"
CLIENT = "tests/test_client_untrusted.py::"
SHARES = "tests/test_fd_shares.py::"
SLEEPS = "tests/test_signals.py::test_pled_sleeps_when_idle_after_every_signal_it_handles"

MUTATIONS = [
    # 1. Whose budget: what pled dropped but keeps open still counts against the uid.
    Mutation("connections pled dropped but keeps open (fds unread) left out of their uid's share of the connections",
             "pled/daemon/serving/admission.py",
             "        uids = [c.peer.uid for c in self.connections.values()] + self.lingering.uids()\n",
             "        uids = [c.peer.uid for c in self.connections.values()]\n",
             (FDS + "test_connections_pled_dropped_with_fds_unread_count_in_their_uids_share_of_connections",)),
    Mutation("fds unread on a uid's connections pled dropped left out of its share of the fds in flight",
             "pled/daemon/serving/session.py",
             "    closed = lingering.fds(conn.peer.uid)\n", "    closed = 0\n",
             (FDS + "test_fds_unread_on_connections_pled_dropped_still_count_against_their_uid",)),
    Mutation("the fds a connection already sent counted as freed when pled drops it to make room for its uid",
             "pled/daemon/serving/session.py",
             "                                         extra=n + closed + sent)]",
             "                                         extra=n + closed)]",
             (FDS + "test_a_uid_gets_no_table_fd_past_its_share_by_having_pled_drop_its_connections",)),
    # 1b. Each term of the sum, found by cosmic-ray (make mutants): in the kernel plus queued, once, own uid only.
    Mutation("a connection's fds in flight taken as those in the kernel or those queued, not both",
             "pled/daemon/serving/session.py",
             "        return self.fds_sent + self.fds_queued()\n", "        return self.fds_sent | self.fds_queued()\n",
             (SHARES + "test_a_connections_fds_in_flight_are_those_in_the_kernel_plus_those_queued_in_pled",)),
    Mutation("the fds a connection has queued in pled counted twice in its uid's share (once as sent)",
             "pled/daemon/serving/session.py",
             "    sent = sum(c.fds_in_flight() - c.fds_queued() for",
             "    sent = sum(c.fds_in_flight() + c.fds_queued() for",
             (SHARES + "test_a_uids_share_counts_fds_in_the_kernel_once_and_drops_only_what_frees_room",)),
    Mutation("fds in flight to a lower uid counted in a higher uid's share",
             "pled/daemon/serving/session.py",
             "for c in connections if c.peer.uid == conn.peer.uid)",
             "for c in connections if c.peer.uid <= conn.peer.uid)",
             (SHARES + "test_fds_in_flight_to_other_uids_count_in_no_share_but_their_own",)),
    Mutation("the client receives a table's fd without close-on-exec (a child it execs holds the table)",
             "pled/client/connection.py",
             "                                             socket_mod.MSG_CMSG_CLOEXEC)\n",
             "                                             0)\n",
             ("tests/test_fd_ownership.py::test_a_tables_fd_is_close_on_exec_in_the_client_from_the_moment_it_arrives",)),
    # 2. pled's own user is an operator, as root is: no uid's share holds it.
    Mutation("pled's own user held to one uid's share of the connections (root alone an operator)",
             "pled/daemon/serving/admission.py",
             "fdlimit.over_share(peer.uid, (0, self.policy.own_uid), ", "fdlimit.over_share(peer.uid, (0,), ",
             (PEERS + "test_pleds_own_user_is_not_held_to_a_uids_share_of_the_connections",)),
    Mutation("the operators' last 8 connections open to any uid within its share (four uids fill the cap)",
             "pled/daemon/serving/fdlimit.py",
             "    if open_total >= cap - OPERATOR_RESERVE:\n", "    if open_total >= cap:\n",
             (PEERS + "test_four_uids_filling_the_connections_leave_the_last_8_to_root_and_pleds_own_user",)),
    Mutation("a refusal by the operators' reserve at the full cap counted as the cap (metrics say: raise the limit)",
             "pled/daemon/serving/admission.py",
             "            self.counters.refuse(reason)\n",
             "            self.counters.refuse(\"connection_cap\" if len(uids) >= self.max_connections else reason)\n",
             (PEERS + "test_four_uids_filling_the_connections_leave_the_last_8_to_root_and_pleds_own_user",)),
    Mutation("a refusal at the cap with every connection attached counted as a uid's share",
             "pled/daemon/serving/admission.py",
             "            reason = \"connection_cap\"\n", "",
             (PEERS + "test_at_the_cap_with_every_connection_attached_even_root_is_refused_and_counted_as_the_cap",)),
    # 3. A log budget refills to its burst, no further, however long the quiet.
    Mutation("a log budget refilled past its burst by a long quiet", "pled/daemon/health/throttle.py",
             "        left = min(self.burst, left + (now - then) * self.rate)\n",
             "        left = left + (now - then) * self.rate\n",
             ("tests/test_attack_clients.py::test_a_budget_quiet_for_a_day_writes_its_burst_again_not_a_days_worth_of_lines",)),
    # 4. Refusal lines are a budget per uid: a new pid is no new budget.
    Mutation("access refusal lines budgeted per pid, not per uid (a uid forking a process per call floods the log)",
             "pled/daemon/serving/server.py",
             "self._refusals.log(conn.peer.uid, ", "self._refusals.log(conn.peer.pid, ",
             (PEERS + "test_a_refused_uid_forking_a_process_per_call_gets_the_log_lines_of_one_process",)),
    # 5. The loop sleeps when idle: every wakeup pipe read empty.
    Mutation("the signal wakeup pipe left unread (the loop spins after the first signal)", "pled/daemon/lifecycle.py",
             "        drain(wake_r)\n", "",
             (SLEEPS,)),
    Mutation("the workers' event pipe left unread (the loop spins after the first staging or reload)",
             "pled/daemon/stager.py",
             "        drain(self.event_fd)\n", "",
             (SLEEPS,)),
    # 6. The client against the server: fds cut short by the kernel, or one too many.
    Mutation("the client ignores MSG_CTRUNC (fds the kernel cut short)", "pled/client/connection.py",
             "                if flags & socket_mod.MSG_CTRUNC:  #", "                if False:  #",
             (CLIENT + "test_a_client_at_its_open_file_limit_is_told_the_fd_was_cut_short_and_keeps_none",
              CLIENT + "test_a_reply_with_more_fds_than_the_client_takes_at_once_is_refused_as_cut_short")),
    Mutation("the client keeps a reply's first fd and forgets the others (neither refused nor closed)",
             "pled/client/connection.py",
             "            fds.extend(got)\n", "            fds.extend(got[:1])\n",
             (CLIENT + "test_an_attach_reply_with_a_second_fd_is_refused_and_both_are_closed",)),
    # 7. A dropped connection is drained to its end: behind the calls pled never read, its peer's own socket.
    Mutation("a dropped connection drained by one read, not to its end", "pled/daemon/serving/session.py",
             "    while True:  # to the end", "    for _ in range(1):  # to the end",
             (FDS + "test_a_peer_held_only_by_its_own_socket_in_pleds_queue_is_let_go",)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
