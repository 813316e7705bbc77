"""Host memory: what this host and its cgroups can give a table, and on which pages and NUMA nodes.

hostmem.py (/proc/meminfo, the ZFS ARC, memory cgroups v1 and v2, rooted at a path), preflight.py (the tables' exact
bytes against what this process may have), pageplan.py (shared memory or reserved huge pages of a size, and the NUMA
policy, for each table, and why), hugetlb.py (huge-page pools, the hugetlb cgroup, hugetlb memfds), numa.py (mbind,
numa_maps).

May import: pled.shared and pled.daemon.config (the settings pageplan resolves); none of the other wings.
"""
