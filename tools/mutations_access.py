"""Breakages that the tests of who may attach (uid not gid, pled's group as a primary or a supplementary group, and
`pled status` naming each client), of regions missing one seal or a reply with another fingerprint, of access
narrowed and widened by a reload, and of the bound on one uid's unread replies must catch (tools/mutations.py's
format and runner).

    python tools/mutations_access.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_access.py --list     # and its other options (-k, --timeout)

Each ``old`` is a short piece of one line (or a few short lines), so that re-wrapping the code around it does not
lose it; tools/mutations.py's runner refuses one that does not occur exactly once. tools/mutations.py runs
these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

PEERS = "tests/test_peers_admitted_refused_dropped.py::"
REGIONS = "tests/test_client_refuses_bad_regions.py::"
BY_UID = PEERS + "test_allow_uids_admits_a_client_by_its_uid_never_by_its_gid"
GROUPS = PEERS + "test_pleds_group_and_allow_groups_admit_a_primary_or_supplementary_member"
NARROWED = PEERS + "test_a_reload_that_narrows_access_refuses_the_next_connect_and_widening_admits_again"
UNREAD = PEERS + "test_connections_that_leave_their_replies_unread_are_dropped_by_size_well_before_the_call_timeout"
MISSING_SEAL = REGIONS + "test_a_region_missing_one_seal_is_refused_with_no_fd_left"
FINGERPRINT = REGIONS + "test_a_reply_whose_fingerprint_is_not_the_regions_is_refused_with_no_fd_left"


def _seal_ignored(seal: str) -> Mutation:
    return Mutation(f"a client takes a region without {seal} for sealed", "pled/shared/memfd.py",
                    "    if have & SEALS != SEALS:\n",
                    f"    if have & (SEALS & ~fcntl.{seal}) != SEALS & ~fcntl.{seal}:\n",
                    (f"{MISSING_SEAL}[{seal}]",))


MUTATIONS = [
    # Who a peer is: uid is not gid, the primary gid is a group too, pled's group as either.
    Mutation("SO_PEERCRED's uid and gid read the other way round", "pled/daemon/serving/access.py",
             "    pid, uid, gid = _UCRED.unpack(", "    pid, gid, uid = _UCRED.unpack(",
             (BY_UID,)),
    Mutation("a peer's primary gid left out of its groups (SO_PEERGROUPS alone counted)",
             "pled/daemon/serving/access.py",
             "frozenset(peer_groups(sock) | {gid})", "frozenset(peer_groups(sock))",
             (f"{GROUPS}[primary_is_pleds_group]", f"{GROUPS}[primary_in_allow_groups]")),
    Mutation("pled's own group met only as a peer's primary gid", "pled/daemon/serving/access.py",
             "            or self.own_gid in peer.groups\n", "            or self.own_gid == peer.gid\n",
             (f"{GROUPS}[supplementary_is_pleds_group]",)),
    Mutation("Status lists a client's gid as its uid", "pled/daemon/tables.py",
             '{"pid": c.peer.pid, "uid": c.peer.uid,', '{"pid": c.peer.pid, "uid": c.peer.gid,',
             (BY_UID,)),
    Mutation("a refused client is told its gid as the uid pled refused", "pled/daemon/serving/server.py",
             "protocol.error(protocol.PERMISSION_DENIED, uid=conn.peer.uid)",
             "protocol.error(protocol.PERMISSION_DENIED, uid=conn.peer.gid)",
             (BY_UID, f"{GROUPS}[neither]")),
    # A region with only some of its seals, offered to attach.
    *(_seal_ignored(seal) for seal in ("F_SEAL_SEAL", "F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_WRITE")),
    Mutation("a region the client refuses for its seals keeps its fd open", "pled/client/library.py",
             "        except RegionError as err:\n            os.close(fd)\n", "        except RegionError as err:\n",
             (f"{MISSING_SEAL}[F_SEAL_GROW]",)),
    # The reply's fingerprint against the region's header.
    Mutation("the client does not compare the reply's fingerprint with the region's", "pled/client/library.py",
             't.manifest.fingerprint != params.get("fingerprint") or ', "",
             (FINGERPRINT,)),
    Mutation("a region refused for its fingerprint stays mapped, its fd and connection open", "pled/client/library.py",
             "    except BaseException:\n        t.close()\n        raise\n",
             "    except BaseException:\n        raise\n",
             (FINGERPRINT,)),
    # allow_uids / allow_groups narrowed and widened by a reload.
    Mutation("a reload leaves the access policy as it was at start", "pled/daemon/lifecycle.py",
             "            self.server.policy = Policy.for_this_process(", "            Policy.for_this_process(",
             (f"{NARROWED}[allow_uids]", f"{NARROWED}[allow_groups]")),
    Mutation("a reload takes allow_uids from the new config but keeps the old allow_groups", "pled/daemon/lifecycle.py",
             "Policy.for_this_process(config.allow_uids, config.allow_gids)\n",
             "Policy.for_this_process(config.allow_uids, self.server.policy.allow_gids)\n",
             (f"{NARROWED}[allow_groups]",)),
    # The bound on one uid's unread replies.
    Mutation("no bound on the replies one uid's connections leave unread", "pled/daemon/serving/session.py",
             "for c, total in _uid_share_drops(conn, connections, unread, MAX_UNREAD_PER_UID)]",
             "for c, total in []]",
             (UNREAD,)),
    Mutation("the connection whose reply passes the uid's bound dropped, not the one holding the most",
             "pled/daemon/serving/session.py", "        greedy = max(same, key=load)", "        greedy = conn",
             (UNREAD,)),
    Mutation("a connection dropped for its unread replies is dropped unlogged", "pled/daemon/serving/server.py",
             "len(data)):\n                self._drop(victim, why, ",
             "len(data)):\n                self._drop(victim, None, ",
             (UNREAD,)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
