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
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
