"""Breakages of what a new operator was told, found by trying the Debian package (issue 47, Must show; helper
"optrial"): a checkpoint's or a glob's files counted as shards, a changed source not noted by `pled status`, a
permission refusal exiting 1 like a difference or an unready table, allow_uids working without the socket's ACL
(tests/test_operator_words.py; tools/mutations.py's format and runner).

    python tools/mutations_optrial.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_optrial.py --list     # and its other options (-k, --timeout)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

T = "tests/test_operator_words.py::"
WORDS = T + "test_the_staging_line_names_shards_files_and_checkpoint_files_and_status_notes_changed_sources"
PERM = T + "test_status_verify_and_reload_exit_77_where_this_user_may_not"
ACL = T + "test_allow_uids_admits_a_uid_only_with_the_acl_entries_of_the_docs_drop_in"

OWNER = T + "test_a_socket_directory_of_another_user_is_named_with_both_uids"
RATE = T + "test_a_small_files_rate_is_in_mb_s_not_zero_gb_s"

MUTATIONS = [
    Mutation("a socket directory of another user is no longer warned about", "pled/daemon/serving/listener.py",
             "    if st.st_uid not in (0, me):\n", "    if st.st_uid not in (0, me) and False:\n", (OWNER,)),
    Mutation("a small file's rate is '0.00 GB/s' again", "pled/shared/sizes.py", "if per_second >= 1e8 else",
             "if per_second >= 0 else", (RATE,)),
    Mutation("the staging line counts a checkpoint's files as shards again (issue 47.8 as seen)",
             "pled/daemon/regions/staging.py", '("checkpoint file" if m.form == "arrays" else',
             '("shard" if m.form == "arrays" else', (WORDS,)),
    Mutation("the staging line counts a glob's generic files as shards",
             "pled/daemon/regions/staging.py", '"shard" if m.layout in LAYOUTS else "file")',
             '"shard")', (WORDS,)),
    Mutation("pled status says nothing of source files that changed since staging (only its JSON did)",
             "pled/cli.py", 'if t.get("sources") not in (None, "unchanged"):',
             'if t.get("sources") not in (None, "unchanged") and False:', (WORDS,)),
    Mutation("pled status, reload and verify exit 1 where this user may not reach pled",
             "pled/cli.py", "EX_NOPERM if isinstance(err, client.PermissionDenied) else 1)", "1)", (PERM,)),
    Mutation("pled verify exits 1, 'a difference found', where this user may not reach pled",
             "pled/verify.py", "        return EX_NOPERM\n", "        return 1\n", (PERM,)),
    Mutation("pled verify counts pled's refusal of one table as that table's difference",
             "pled/verify.py", "except (client.DaemonUnavailable, client.PermissionDenied):",
             "except client.DaemonUnavailable:", (PERM,)),
    Mutation("pled admits a uid the ACL lets through but allow_uids no longer names (its own gate gone)",
             "pled/daemon/serving/access.py", "            or peer.uid in self.allow_uids\n",
             "            or True\n", (ACL,)),
]

if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
