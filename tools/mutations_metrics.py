"""Breakages that the tests of the metrics file (tests/test_metrics.py) must catch: its mode, its atomic rename, the
writes a change triggers, the writer off the loop thread and its bounded stop, one warning for a path that
cannot be written, the counts and figures it carries, and where a relative metrics_file is (tools/mutations.py's
format and runner).

    python tools/mutations_metrics.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_metrics.py --list     # and its other options (-k, --timeout)

tools/mutations.py runs these with its own (``every_mutation()``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

T = "tests/test_metrics.py::"
EXPORTER = T + "test_node_exporter_serves_pleds_metrics_while_it_stages_serves_refuses_and_reloads"
FIGURES = T + "test_the_figures_agree_with_pled_status_and_the_kernel"
HALF = T + "test_a_reader_never_sees_half_a_file_over_fifty_rewrites"
FULL = T + "test_a_full_file_system_keeps_the_previous_file_and_is_one_warning"
ABSENT = T + "test_a_metrics_directory_that_is_not_there_is_one_warning_and_serving_goes_on"
HUNG = T + "test_a_metrics_write_that_never_returns_stalls_neither_serving_nor_a_stop"

MUTATIONS = [
    # The file: its mode, written whole, rewritten on each change.
    Mutation("the metrics file left at the umask's mode (0600 under the unit's UMask=0077)",
             "pled/daemon/health/metrics_file.py", "            os.fchmod(fd, MODE)  #", "            pass  #",
             (T + "test_the_file_is_world_readable_whatever_the_umask", EXPORTER)),
    Mutation("the metrics file rewritten in place, not replaced by a rename", "pled/daemon/health/metrics_file.py",
             '    tmp = os.path.join(directory, f".{name}.tmp")  #', "    tmp = path  #",
             (HALF,)),
    Mutation("a change waits for the interval before the metrics file shows it", "pled/daemon/health/metrics_file.py",
             "        if since < self.interval and not (fresh and since >= MIN_GAP):\n",
             "        if since < self.interval:\n",
             (T + "test_a_change_is_in_the_file_at_once_not_at_the_next_interval",)),
    # The writer: off the loop thread, and a stop that does not wait for it for ever.
    Mutation("the metrics file written in the loop thread", "pled/daemon/health/metrics_file.py",
             "            job = (self.path, self._snapshot())\n",
             "            job = (self.path, self._snapshot())\n            self._write(*job)\n",
             (HUNG,)),
    Mutation("a stop writes no last figures (a reload that fails at stop is never counted in the file)",
             "pled/daemon/health/metrics_file.py",
             "        self._hand()\n        with self._cond:\n", "        with self._cond:\n",
             (T + "test_a_stop_writes_the_last_figures",)),
    Mutation("a stop waits for a hung metrics write without a bound", "pled/daemon/health/metrics_file.py",
             "        self._thread.join(timeout)\n", "        self._thread.join()\n",
             (HUNG,)),
    Mutation("a metrics path that cannot be written warned about at every write", "pled/daemon/health/metrics_file.py",
             '            if self._failing != (path, why):  # said once',
             '            if True:  # said once',
             (FULL, ABSENT)),
    # What it counts and measures.
    Mutation("attaches not counted", "pled/daemon/handlers.py", "        self.counters.attached()\n", "",
             (FIGURES,)),
    Mutation("a client refused by the access policy not counted", "pled/daemon/serving/server.py",
             '            self.counters.refuse("access")\n', "",
             (EXPORTER,)),
    Mutation("an Attach of a table not ready yet not counted as refused", "pled/daemon/handlers.py",
             '            self.counters.refuse("not_ready")\n', "",
             (EXPORTER,)),
    Mutation("a failed reload not counted", "pled/daemon/reload.py",
             '        self.counters.reload_ended("failed")\n', "",
             (EXPORTER,)),
    Mutation("a connection dropped for an invalid message not counted", "pled/daemon/serving/server.py",
             '        self.counters.drop("invalid_message")  #', "        pass  #",
             (FIGURES,)),
    Mutation("pled's fd count includes the fd that counts them", "pled/daemon/serving/fdlimit.py",
             "        return len(os.listdir(proc)) - 1  #", "        return len(os.listdir(proc))  #",
             (FIGURES,)),
    Mutation("a table's clients counted over every connection", "pled/daemon/tables.py",
             '{"clients": sum(1 for c in connections if t.name in c.attached)}', '{"clients": len(connections)}',
             (FIGURES,)),
    # Where the file is.
    Mutation("a relative metrics_file taken from the working directory, not the config's", "pled/daemon/config.py",
             'data["metrics_file"] = str(base / os.path.expanduser(data["metrics_file"]))',
             'data["metrics_file"] = os.path.abspath(data["metrics_file"])',
             (T + "test_metrics_file_is_taken_from_the_configs_directory_and_checked",)),
]


if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
