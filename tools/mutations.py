"""Break pled on purpose, one way at a time, and show that a test notices, quickly.

    python tools/mutations.py            # every mutation, here and in tools/mutations_*.py (make mutations)
    python tools/mutations.py -k groups  # those whose name contains "groups"
    python tools/mutations.py --list
    python tools/mutations.py --check    # only that each mutation's text is still in its file (make lint)

Each mutation replaces one exact piece of source text (found exactly once, or the script stops) and runs only the
tests meant to catch it, with the worktree's pled first on the path. Before any mutation those tests run unbroken and
must pass. A mutation counts as caught when its tests fail without a pytest timeout being the reason. Every file is
restored afterwards, whatever happens. Exit status 0 when every mutation is caught.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMED_OUT = "Failed: Timeout"  # pytest-timeout's failure, and ours when the whole run overstays


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation("per-chunk POSIX_FADV_DONTNEED removed (only the per-shard one kept)", "pled/daemon/regions/staging.py",
             "        behind.read(at, at + got)\n", "",
             ("tests/test_staging_contracts.py::test_each_chunk_leaves_the_page_cache_as_soon_as_it_is_copied",)),
    Mutation("supplementary groups ignored in the access policy", "pled/daemon/serving/access.py",
             "or bool(peer.groups & self.allow_gids)", "or peer.gid in self.allow_gids",
             ("tests/test_access_groups.py",)),
    Mutation("cgroup v1 reclaimable counted as total_cache (shmem included)", "pled/daemon/memory/hostmem.py",
             '("total_active_file", "total_inactive_file")', '("total_cache",)',
             ("tests/test_cgroup_reclaimable.py",)),
    Mutation("cgroup v2 reclaimable counted as file (shmem included)", "pled/daemon/memory/hostmem.py",
             '2: ("memory.max", "memory.current", ("active_file", "inactive_file"))',
             '2: ("memory.max", "memory.current", ("file",))',
             ("tests/test_cgroup_reclaimable.py",)),
    Mutation("nibble order flipped in the numpy reference dequant.py", "pled/shared/dequant.py",
             "        nibbles[:, 0::2] = packed & 0x0F  # low nibble first\n        nibbles[:, 1::2] = packed >> 4\n",
             "        nibbles[:, 0::2] = packed >> 4\n        nibbles[:, 1::2] = packed & 0x0F\n",
             ("tests/test_dequant_reference.py",)),
    Mutation("identity() ignoring dev/ino", "pled/shared/region.py",
             "replace(s, digest=d) for s, d in zip(self.shards",
             "replace(s, digest=d, dev=0, ino=0) for s, d in zip(self.shards",
             ("tests/test_adoption.py",)),
    Mutation("seal check skipped when adopting a stored fd", "pled/daemon/systemd/fdstore.py",
             "            region.check_sealed_memfd(item.fd)  #", "            pass  #",
             ("tests/test_adoption.py",)),
    Mutation("wrong hasher for blake3 sums", "pled/shared/digests.py",
             "        return blake3.blake3(max_threads=1)", "        return hashlib.sha256()",
             ("tests/test_staging_contracts.py::test_correct_shipped_sums_pass_and_a_wrong_one_is_refused",)),
    Mutation("residency (the kernel's measure) returning a constant", "pled/shared/pagecache.py",
             "    if found is not None:\n        return found\n"
             "    return hugetlb_bytes(fd) if is_hugetlb(fd) else _mincore(fd, os.fstat(fd).st_size)",
             "    return os.fstat(fd).st_size",
             ("tests/test_staging_contracts.py",)),
    Mutation("a client's residency() returning a constant", "pled/client/mapped_table.py",
             "        return min(1.0, cached_bytes_fd(self._fd) / self.manifest.region_bytes)", "        return 1.0",
             ("tests/test_staging_contracts.py::test_a_client_table_partly_in_memory_says_so_and_populate_brings_it_in",)),
    Mutation("populate() doing nothing", "pled/client/mapped_table.py",
             "        start = time.perf_counter()\n        try:\n            self.buffer.madvise(MADV_POPULATE_READ)",
             "        return 0.0\n"
             "        start = time.perf_counter()\n        try:\n            self.buffer.madvise(MADV_POPULATE_READ)",
             ("tests/test_staging_contracts.py::test_a_client_table_partly_in_memory_says_so_and_populate_brings_it_in",)),
    Mutation("MADV_POPULATE_READ failures of any kind swallowed", "pled/client/mapped_table.py",
             "            if err.errno != errno.EINVAL:", "            if False:",
             ("tests/test_errors.py::test_a_populate_that_fails_is_an_error_not_a_crash",)),
    Mutation("stage() leaking the memfd on cancel", "pled/daemon/regions/staging.py",
             "        os.close(fd)  # a half-built region frees its memory with its last fd\n", "",
             ("tests/test_staging_contracts.py::test_cancel_after_the_first_chunk_closes_the_half_built_region",)),
    Mutation("a shipped-digest mismatch ignored", "pled/daemon/regions/staging.py",
             "    if expected is None:\n        return\n", "    if True:\n        return\n",
             ("tests/test_staging_contracts.py::test_a_shard_that_does_not_match_its_shipped_digest_is_refused_at_once",
              "tests/test_faults.py::test_a_corrupt_shard_is_refused_by_its_digest_and_found_by_verify")),
    Mutation("EACCES on the THP sysfs taken for a kernel without THP", "pled/shared/hugepages.py",
             "    except FileNotFoundError:\n        return None\n    except OSError as err:\n",
             "    except OSError:\n        return None\n    except ValueError as err:\n",
             ("tests/test_errors.py::test_an_unreadable_huge_page_setting_is_reported_as_such",)),
    Mutation("replies out of call order behind a waiting Attach", "pled/daemon/serving/server.py",
             "        return bool(conn.inbox) and not conn.out and not conn.pending and self._live(conn)\n",
             "        return bool(conn.inbox) and not conn.out and self._live(conn)\n",
             ("tests/test_reply_order.py",)),
    Mutation("the daemon imports torch", "pled/daemon/regions/staging.py",
             "from pled.shared import hugepages, region\n",
             "from pled.shared import hugepages, region\nimport torch  # noqa\n",
             ("tests/test_layering.py",)),
    Mutation("a client imports daemon code", "pled/client/library.py",
             "from pled.shared import protocol, region\n",
             "from pled.shared import protocol, region\nfrom pled.daemon import config  # noqa\n",
             ("tests/test_layering.py",)),
    Mutation("warm-up stops after one gather", "pled/client/gather.py",
             "        while len(times) < max_gathers and not settled(times):\n", "        while not times:\n",
             ("tests/test_gather_scratch.py::test_warm_stops_where_the_gathers_settle",)),
    Mutation("warm-up goes on after its gathers have settled", "pled/client/gather.py",
             "        while len(times) < max_gathers and not settled(times):\n",
             "        while len(times) < max_gathers:\n",
             ("tests/test_gather_scratch.py::test_warm_stops_where_the_gathers_settle",)),
    Mutation("a queued reply holds the region's own fd number, not an fd of its own (the stale fd of issue 19)",
             "pled/daemon/serving/session.py",
             "                fds.append(readonly_duplicate(r.fd))\n",
             "                fds.append(r.fd)\n",
             tuple(f"tests/test_fd_ownership.py::{t}" for t in (
                 "test_a_waiting_attach_reply_sends_the_original_region",
                 "test_a_waiting_attach_with_wait_sends_the_original_region",
                 "test_a_reply_kept_after_etoomanyrefs_sends_the_original_region"))),
    Mutation("an adopted region keeps the writable mode an older pled stored it with", "pled/daemon/systemd/fdstore.py",
             "            if os.fstat(item.fd).st_mode & 0o222:", "            if False:",
             ("tests/test_adoption.py::test_a_stored_region_left_writable_by_mode_is_adopted_read_only_by_mode",)),
    Mutation("a dropped connection's unread table fds forgotten (they stay in flight, counted by the kernel)",
             "pled/daemon/serving/session.py", "        n = conn.fds_in_flight()\n", "        n = 0\n",
             ("tests/test_fds_in_flight.py::test_fds_unread_on_connections_pled_dropped_still_count_against_their_uid",)),
    Mutation("a dropped connection kept without reading what its peer sent (a socket it sent itself keeps it alive)",
             "pled/daemon/serving/session.py", "                _drain(conn.sock)\n", "",
             ("tests/test_fds_in_flight.py::test_a_peer_held_only_by_its_own_socket_in_pleds_queue_is_let_go",)),
    Mutation("no bound on the table fds in flight over all peers together", "pled/daemon/serving/session.py",
             "    cap = budget.total - (0 if conn.peer.uid in operators else budget.reserve)\n",
             "    cap = 1 << 30\n",
             ("tests/test_fds_in_flight.py::test_many_uids_together_cannot_take_what_is_kept_for_root",)),
    Mutation("one uid's attach and detach lines without a budget (a fork loop floods the journal)",
             "pled/daemon/health/throttle.py", "        if left < 1:\n", "        if False:\n",
             ("tests/test_attack_clients.py::test_the_attach_and_detach_lines_of_one_uid_are_a_budget_not_a_flood",)),
    Mutation("a dropped connection drained of a fixed number of messages, not to its end",
             "pled/daemon/serving/session.py",
             "    while True:  # to the end", "    for _ in range(4096):  # to the end",
             ("tests/test_fds_in_flight.py::test_a_peer_held_behind_thousands_of_fd_messages_is_let_go_too",)),
    Mutation("refused reloads logged without a budget", "pled/daemon/handlers.py",
             'self._lines.log(("reload", conn.peer.uid), log.warning, ', "log.warning(",
             ("tests/test_attack_clients.py::test_refused_reloads_of_one_uid_are_a_budget_not_a_flood",)),
    Mutation("an attach recorded when its reply is queued, not once the kernel took the fd",
             "pled/daemon/serving/session.py",
             "        return cls(data, fds, reply.on_sent)\n",
             "        reply.on_sent and reply.on_sent()\n        return cls(data, fds, None)\n",
             ("tests/test_fd_ownership.py::test_an_attach_reply_never_read_is_not_logged_as_attached",)),
    Mutation("nothing escaped before a log line, STATUS= or pled status", "pled/shared/boundary.py",
             "    if s.isprintable():\n        return s\n", "    if True:\n        return s\n",
             ("tests/test_escapes.py",)),
    Mutation("the fd store's limit ignored", "pled/daemon/systemd/fdstore.py",
             "        if len(self.names) >= self.limit:\n", "        if False:\n",
             ("tests/test_fdstore_limit.py::test_fdstore_from_systemd_is_the_limit",)),
    Mutation("the file-size limit not checked by the preflight", "pled/daemon/memory/preflight.py",
             "    if largest <= limit:\n", "    if True:\n",
             ("tests/test_fsize.py",)),
    Mutation("Status stats the source files on the loop thread", "pled/daemon/tables.py",
             "        return self.source_check.result(self.manifest.shards)\n",
             "        return check_sources(self.manifest.shards)\n",
             ("tests/test_hung_sources.py::test_status_attach_and_sigterm_answer_while_the_sidecars_file_system_hangs",)),
    Mutation("a stop waits for every staging thread without a bound", "pled/daemon/stager.py",
             "            worker.join(max(0.0, deadline - time.monotonic()))\n", "            worker.join()\n",
             ("tests/test_hung_sources.py::test_sigterm_while_a_staging_read_hangs_refuses_clients_and_names_the_table",)),
    Mutation("SIGQUIT left to its default action", "pled/daemon/lifecycle.py",
             '"SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP"', '"SIGTERM", "SIGINT", "SIGHUP"',
             ("tests/test_signals.py::test_sigquit_stops_pled_as_sigterm_does",)),
    Mutation("a client maps whatever fd it is sent (no memfd or seal check)", "pled/client/library.py",
             "            region.check_sealed_memfd(fd)  #", "            pass  #",
             ("tests/test_client_untrusted.py::test_a_regular_file_instead_of_a_memfd_is_refused",)),
    Mutation("a client takes a manifest's offsets on trust", "pled/shared/region.py",
             "        _check_geometry(manifest)\n        return manifest\n", "        return manifest\n",
             ("tests/test_client_untrusted.py::test_a_tensor_beyond_the_region_is_refused",)),
    Mutation("a reply carries a writable (O_RDWR) duplicate of the region", "pled/daemon/serving/session.py",
             "                fds.append(readonly_duplicate(r.fd))\n", "                fds.append(os.dup(r.fd))\n",
             ("tests/test_serving.py::test_writes_through_a_client_mapping_fail",)),
    Mutation("a failed first staging exits 0", "pled/daemon/startup.py",
             '        self.exit_status = getattr(error, "exit_status", 1) or 1\n', "        pass\n",
             ("tests/test_faults.py::test_a_shard_that_shrinks_while_it_is_copied_fails_the_start_clearly",)),
    Mutation("a replaced generation left in systemd's fd store", "pled/daemon/registry.py",
             "        self._fdstore.remove(old.name, old.generation)\n", "",
             ("tests/test_fdstore_limit.py::test_a_reload_frees_the_old_generations_entry_before_storing_the_new_one",)),
    Mutation("a reload's generation handed to the fd store before it is served", "pled/daemon/registry.py",
             "                if self._served.get(t.name) is t:  #", "                if True:  #",
             ("tests/test_reload.py::test_reload_switches_generations_while_a_client_reads_the_old_one",)),
    Mutation("Status measures every table's residency at each call (a walk of all its pages)", "pled/daemon/tables.py",
             "                resident_bytes=self.last_residency(),", "                resident_bytes=self.measure(),",
             ("tests/test_serving.py::test_status_command",)),
    Mutation("gather scratch made anew for every request", "pled/client/gather.py",
             "        if self.scratch is None or self.scratch.rows < rows:\n", "        if True:\n",
             ("tests/test_gather_scratch.py::test_a_second_gather_of_the_same_size_allocates_nothing",)),
]


def pytest(tests: tuple[str, ...], timeout: float) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout)
    return r.returncode, time.monotonic() - start, r.stdout + r.stderr


def every_mutation() -> list[Mutation]:
    """This file's list and those of the test areas that keep their own: every tools/mutations_*.py, in name order
    (imported here, not at the top: they import this module's Mutation, and this module runs as ``__main__``)."""
    import importlib

    found = [*MUTATIONS]
    for path in sorted(Path(__file__).resolve().parent.glob("mutations_*.py")):
        found += importlib.import_module(path.stem).MUTATIONS
    return found


def main(mutations: list[Mutation] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", default="", help="only mutations whose name contains this")
    p.add_argument("--list", action="store_true")
    p.add_argument("--check", action="store_true", help="only check that each mutation's text occurs once in its file")
    p.add_argument("--timeout", type=float, default=600, help="seconds for one pytest run")
    a = p.parse_args()
    chosen = [m for m in (every_mutation() if mutations is None else mutations) if a.k.lower() in m.name.lower()]
    if a.list:
        for m in chosen:
            print(f"{m.name}: {m.path} -> {' '.join(m.tests)}")
        return 0
    stale = [(m, (ROOT / m.path).read_text().count(m.old)) for m in chosen]
    for m, count in stale:
        if count != 1:
            print(f"cannot apply '{m.name}': its text occurs {count} times in {m.path}; update tools/mutations.py")
    if any(count != 1 for _, count in stale):
        return 2
    if a.check:
        print(f"{len(chosen)} mutations: each text occurs once in its file")
        return 0
    if not chosen:  # else pytest, named no test, would run the whole suite as "the unbroken tests"
        print(f"no mutation's name contains {a.k!r}; --list names them")
        return 2
    tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
    rc, seconds, out = pytest(tests, a.timeout)
    if rc != 0:
        print(f"the tests fail without any mutation ({seconds:.0f} s); fix them first:\n{out[-3000:]}")
        return 2
    print(f"unbroken: {len(tests)} test targets pass ({seconds:.1f} s)")
    missed = []
    for m in chosen:
        path = ROOT / m.path
        original = path.read_text()
        try:
            path.write_text(original.replace(m.old, m.new))
            rc, seconds, out = pytest(m.tests, a.timeout)
        except subprocess.TimeoutExpired:
            rc, seconds, out = -1, a.timeout, TIMED_OUT
        finally:
            path.write_text(original)
        failed = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
        # pytest-timeout's own words, not any "Timeout" (a client's TimeoutError is a test failing as it should)
        caught = rc not in (0, 5) and TIMED_OUT not in out and "+ Timeout +" not in out
        print(f"{'caught' if caught else 'MISSED'} in {seconds:5.1f} s: {m.name}"
              + (f"  <- {failed[0].split(' - ')[0]}" if caught and failed else ""))
        if not caught:
            missed.append(m.name)
    print(f"{len(chosen) - len(missed)} of {len(chosen)} mutations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
