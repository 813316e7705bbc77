"""Breakages that the tests of tables on reserved huge pages (hugetlb) and of NUMA placement must catch (issue 21;
tools/mutations.py's format).

    python tools/mutations_hugetlb.py            # these alone, through tools/mutations.py's runner
    python tools/mutations_hugetlb.py --list     # and its other options

tools/mutations.py runs these with its own (``every_mutation()``). The tests in tests/test_hugetlb_tables.py need
root (they reserve pages and mount the hugetlb cgroup controller); tests/test_pageplan.py needs nothing.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutations import Mutation  # noqa: E402

PLAN = "tests/test_pageplan.py::"
TABLES = "tests/test_hugetlb_tables.py::"
SERVED = TABLES + "test_a_table_on_2m_pages_is_staged_sealed_served_resident_and_verified"
RELOAD = TABLES + "test_a_reload_stages_a_new_hugetlb_generation_beside_the_old_one_and_the_pool_must_hold_both"

MUTATIONS = [
    # Settings and choices.
    Mutation("a huge_page_size the kernel does not offer accepted", "pled/daemon/memory/pageplan.py",
             "    if size not in offered:\n", "    if False:\n",
             (PLAN + "test_settings_the_host_refuses_name_the_file_and_the_key",)),
    Mutation("a numa node without memory accepted", "pled/daemon/memory/pageplan.py",
             "    if missing:\n", "    if False:\n",
             (PLAN + "test_settings_the_host_refuses_name_the_file_and_the_key",)),
    Mutation("the default huge page size the smallest, not the largest with room", "pled/daemon/memory/pageplan.py",
             "sorted(pools.offered, reverse=True)", "sorted(pools.offered)",
             (PLAN + "test_each_choice_and_its_reason",)),
    Mutation("two hugetlb tables count the same free pages", "pled/daemon/memory/pageplan.py",
             "            pools.take(page_size, need)\n", "",
             (PLAN + "test_each_choice_and_its_reason",)),
    Mutation("prefer-hugetlb without room refused like hugetlb", "pled/daemon/memory/pageplan.py",
             '    if p.mode == "prefer-hugetlb":\n        return PagePlan(p.mode, 0,',
             '    if False:\n        return PagePlan(p.mode, 0,',
             (PLAN + "test_each_choice_and_its_reason",
              TABLES + "test_prefer_hugetlb_without_room_serves_on_shared_memory_and_says_why")),
    # The preflight and the region's size.
    Mutation("a hugetlb table's region not rounded up to whole pages", "pled/shared/region.py",
             "if page_size > ALIGN else self", "if False else self",
             (PLAN + "test_a_plan_rounded_to_whole_pages_changes_only_its_size",)),
    Mutation("hugetlb tables counted against MemAvailable, not their pool", "pled/daemon/memory/preflight.py",
             "_check_memory({n: b for n, b in tables.items() if n not in huge}, margin, root)",
             "_check_memory(dict(tables), margin, root)",
             (PLAN + "test_the_preflight_counts_hugetlb_tables_against_their_pool_not_memory",)),
    Mutation("a short pool passes the preflight (the table fails later, or the pool is overcommitted)",
             "pled/daemon/memory/preflight.py",
             "        return self.available is None or self.needed <= self.available\n", "        return True\n",
             (TABLES + "test_a_short_pool_is_refused_at_once_copying_nothing",)),
    Mutation("the hugetlb cgroup's headroom ignored", "pled/daemon/memory/hugetlb.py",
             "        return room if binding is None else min(room, binding.headroom // self.page_size * self.page_size"
             ")",
             "        return room",
             (TABLES + "test_a_hugetlb_cgroup_limit_below_the_table_is_refused_at_once",)),
    Mutation("pages a served generation holds counted as free for a reload's next one", "pled/daemon/memory/hugetlb.py",
             "        room = self.available_pages * self.page_size\n", "        room = self.total * self.page_size\n",
             (RELOAD,)),
    # Staging, serving, adopting, reloading.
    Mutation("a hugetlb region's header written with pwrite (hugetlbfs has no write path)",
             "pled/daemon/regions/staging.py",
             "    if fill.method in (FAULT, HUGETLB):", "    if fill.method == FAULT:",
             (SERVED,)),
    Mutation("Status reads an adopted region's pages from its staging, not from the memfd",
             "pled/daemon/memory/pageplan.py",
             "    size = page_size_of(fd)\n", "    size = 0\n",
             (TABLES + "test_a_restart_adopts_a_hugetlb_region_only_while_the_config_asks_for_its_pages",)),
    Mutation("a stored region adopted whatever pages the config now asks for", "pled/daemon/systemd/fdstore.py",
             "        why = pages(table, page_size) if pages is not None else \"\"\n", "        why = \"\"\n",
             (TABLES + "test_a_restart_adopts_a_hugetlb_region_only_while_the_config_asks_for_its_pages",)),
    Mutation("a reload keeps a table whose pages the config no longer asks for", "pled/daemon/regions/planning.py",
             "            if not why:\n                unchanged.append(name)",
             "            if True:\n                unchanged.append(name)",
             (RELOAD,)),
    Mutation("a prefer-hugetlb table fails when its pool ran short after planning", "pled/daemon/regions/regionfd.py",
             '            if pages.mode != "prefer-hugetlb":\n', "            if True:\n",
             (PLAN + "test_a_pool_that_ran_short_since_planning_fails_hugetlb_and_falls_back_for_prefer",)),
    Mutation("the tail of a 1 GiB plan fallen back to shared memory left unallocated", "pled/daemon/regions/staging.py",
             "            os.posix_fallocate(fd, tail, manifest.region_bytes - tail)", "            pass",
             (PLAN + "test_a_pool_that_ran_short_since_planning_fails_hugetlb_and_falls_back_for_prefer",)),
    # NUMA placement.
    Mutation("no NUMA policy on a shared-memory region", "pled/daemon/regions/regionfd.py",
             "            place(fd, size, policy.mode, policy.nodes)\n", "            pass\n",
             (PLAN + "test_a_shared_memory_region_gets_its_numa_policy_before_its_first_page",
              TABLES + "test_numa_policies_show_in_a_clients_numa_maps_for_shmem_and_in_pleds_status_for_hugetlb")),
    Mutation("a hugetlb region allocated without its NUMA policy", "pled/daemon/regions/regionfd.py",
             "            with numa.thread_policy(policy.mode, policy.nodes) if policy else contextlib.nullcontext():",
             "            with contextlib.nullcontext():",
             (PLAN + "test_a_hugetlb_region_is_allocated_under_its_plans_numa_policy",)),
]

if __name__ == "__main__":
    import mutations

    sys.exit(mutations.main(MUTATIONS))
