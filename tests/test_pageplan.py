"""Which pages each table gets (pled/daemon/memory/pageplan.py) and how the preflight counts reserved huge pages
(pled/daemon/memory/preflight.py), over fixture trees of /sys and /proc: no root, no pool. tests/test_hugetlb_tables.py
does the same against the real kernel with a real pled."""
import contextlib
import dataclasses
import json
import os

import pytest

from fakehost import Host
from pled.daemon import config
from pled.daemon.memory import hugetlb, numa, pageplan, preflight
from pled.daemon.memory.hostmem import UNLIMITED
from pled.daemon.regions import regionfd
from pled.shared.errors import ConfigError

MiB, MiB2, GiB = 1024**2, 2 * 1024**2, 1024**3


def host(tmp_path, pools=None, nodes="0", available=16 * GiB):
    """A fixture host: MemAvailable, nodes with memory, and pools {page size: (nr, free, resv)}."""
    h = Host(tmp_path)
    h.meminfo(32 * GiB, available, available)
    h.file("/sys/devices/system/node/has_memory", nodes + "\n")
    for size, (nr, free, resv) in (pools or {}).items():
        d = f"/sys/kernel/mm/hugepages/hugepages-{size // 1024}kB"
        for name, value in (("nr_hugepages", nr), ("free_hugepages", free), ("resv_hugepages", resv),
                            ("surplus_hugepages", 0), ("nr_overcommit_hugepages", 0)):
            h.file(f"{d}/{name}", f"{value}\n")
    return h


def cfg(text, tables=('[[table]]\nname = "t"\npath = "/x"\n',)):
    return config.parse(text + "\n" + "".join(tables), "/etc/pled/pled.toml")


def plans(tmp_path, text, sizes, tables=None):
    c = cfg(text, tables or [f'[[table]]\nname = "{n}"\npath = "/x/{n}"\n' for n in sizes])
    return pageplan.decide(pageplan.resolve(c, str(tmp_path)), sizes, str(tmp_path))


def test_settings_the_host_refuses_name_the_file_and_the_key(tmp_path):
    host(tmp_path, {MiB2: (8, 8, 0), GiB: (0, 0, 0)}, nodes="0-1")
    root = str(tmp_path)
    with pytest.raises(ConfigError) as err:
        pageplan.resolve(cfg('huge_page_size = "64K"'), root)
    assert str(err.value) == ('/etc/pled/pled.toml: key huge_page_size: "64K" is not a huge page size this kernel '
                              'offers; it offers "2M", "1G"')
    with pytest.raises(ConfigError, match=r"key table\[1\].numa: node 3 has no memory on this host \(nodes with "
                                          r"memory: 0-1\)"):
        pageplan.resolve(cfg("", ['[[table]]\nname = "a"\npath = "/a"\n',
                                  '[[table]]\nname = "b"\npath = "/b"\nnuma = [1, 3]\n']), root)
    bare = tmp_path / "bare"  # a kernel without hugetlb
    host(bare)
    with pytest.raises(ConfigError, match=r'key table\[0\].huge_pages: "hugetlb" for table t, but this kernel has '
                                          r"no huge page pools"):
        pageplan.resolve(cfg("", ['[[table]]\nname = "t"\npath = "/x"\nhuge_pages = "hugetlb"\n']), str(bare))
    with pytest.raises(ConfigError, match=r'key huge_page_size: "2M" is not .* it offers none'):
        pageplan.resolve(cfg('huge_page_size = "2M"'), str(bare))
    placed = pageplan.resolve(cfg('huge_pages = "prefer-hugetlb"'), str(bare))  # prefer: no pool, no refusal
    assert placed["t"].mode == "prefer-hugetlb"


def test_a_tables_keys_override_the_global_ones_and_numa_defaults_to_every_node(tmp_path):
    host(tmp_path, {MiB2: (8, 8, 0), GiB: (2, 2, 0)}, nodes="0-1")
    c = cfg('huge_pages = "hugetlb"\nhuge_page_size = "1G"', [
        '[[table]]\nname = "a"\npath = "/a"\n',
        '[[table]]\nname = "b"\npath = "/b"\nhuge_pages = "off"\nnuma = "local"\n',
        '[[table]]\nname = "c"\npath = "/c"\nhuge_page_size = "2M"\nnuma = [1]\n'])
    p = pageplan.resolve(c, str(tmp_path))
    assert [(x.mode, x.mode_key, x.page_size, x.numa.label) for x in p.values()] == [
        ("hugetlb", "huge_pages", GiB, "interleave:0-1"), ("off", "table[1].huge_pages", GiB, "local"),
        ("hugetlb", "huge_pages", MiB2, "bind:1")]
    assert p["a"].numa.describe() == "NUMA interleave:0-1"
    one = tmp_path / "one"
    host(one, nodes="0")
    (policy,) = {x.numa for x in pageplan.resolve(cfg(""), str(one)).values()}
    assert (policy.mode, policy.nodes, policy.label) == (numa.MPOL_INTERLEAVE, (0,), "interleave:0")
    assert policy.describe() == "NUMA interleave:0 (one node with memory here: applied, but placement changes nothing)"


def test_each_choice_and_its_reason(tmp_path):
    host(tmp_path, {MiB2: (40, 30, 6), GiB: (1, 1, 0)})
    got = plans(tmp_path, "", {"t": 10 * MiB})
    assert (got["t"].page_size, got["t"].reason) == (0, '4 KiB/THP pages as shmem_enabled allows (huge_pages = "auto")')
    assert plans(tmp_path, 'huge_pages = "off"', {"t": 10 * MiB})["t"].reason == '4 KiB pages (huge_pages = "off")'
    # hugetlb, no size: the largest with room (1 GiB pages: the table rounds up, and the line says so)
    t = plans(tmp_path, 'huge_pages = "hugetlb"', {"t": 10 * MiB})["t"]
    assert t.page_size == GiB and t.reason == ('hugetlb 1 GiB pages (huge_pages = "hugetlb", pool has 1 free, needs 1; '
                                               '10.0 MiB rounded up to 1.0 GiB, whole pages)')
    # two tables share one pool: the second finds what the first left (24 free 2 MiB pages: 20 + 4 left)
    two = plans(tmp_path, 'huge_pages = "prefer-hugetlb"\nhuge_page_size = "2M"', {"a": 40 * MiB, "b": 10 * MiB})
    assert [two["a"].page_size, two["b"].page_size] == [MiB2, 0]
    assert two["a"].reason == 'hugetlb 2 MiB pages (huge_pages = "prefer-hugetlb", pool has 24 free, needs 20)'
    assert two["b"].reason == ('4 KiB/THP pages as "auto": the 2 MiB pool has 4 free after the tables before it (20 '
                               'taken), needs 5 '
                               '(huge_pages = "prefer-hugetlb")')
    assert two["b"].shmem_mode == "auto" and two["a"].numa.label == "interleave:0"
    # "hugetlb" without room is still hugetlb: the preflight refuses it with the figures
    short = plans(tmp_path, 'huge_pages = "hugetlb"\nhuge_page_size = "2M"', {"t": 100 * MiB})["t"]
    assert short.page_size == MiB2 and "the 2 MiB pool has 24 free, needs 50" in short.reason


def test_what_a_kept_region_must_be_on(tmp_path):
    host(tmp_path, {MiB2: (8, 8, 0), GiB: (0, 0, 0)})
    root = str(tmp_path)
    auto, huge, huge1g, prefer = (pageplan.resolve(cfg(t), root)["t"] for t in (
        "", 'huge_pages = "hugetlb"', 'huge_pages = "hugetlb"\nhuge_page_size = "1G"', 'huge_pages = "prefer-hugetlb"'))
    assert pageplan.mismatch(auto, 0, 4 * MiB, root) == ""
    assert pageplan.mismatch(auto, MiB2, 4 * MiB, root) == ('it is on hugetlb 2 MiB pages, huge_pages = "auto" asks '
                                                            'for shared memory')
    assert pageplan.mismatch(huge, MiB2, 4 * MiB, root) == ""
    assert pageplan.mismatch(huge1g, MiB2, 4 * MiB, root) == "it is on 2 MiB pages, huge_page_size asks for 1 GiB"
    assert "asks for reserved huge pages" in pageplan.mismatch(huge, 0, 4 * MiB, root)
    assert pageplan.mismatch(prefer, MiB2, 4 * MiB, root) == ""
    # prefer-hugetlb keeps a shared-memory region only while the pool has no room for it
    assert pageplan.mismatch(prefer, 0, 64 * MiB, root) == ""
    assert "the pool has room now" in pageplan.mismatch(prefer, 0, 4 * MiB, root)


def test_the_preflight_counts_hugetlb_tables_against_their_pool_not_memory(tmp_path):
    h = host(tmp_path, {MiB2: (64, 64, 4), GiB: (1, 1, 0)}, available=512 * MiB)
    root = str(tmp_path)
    # 100 MiB on 2 MiB pages with 1 GiB of MemAvailable and 60 free pages: passes, memory not counted for it
    v = preflight.check({"t": 100 * MiB, "s": 200 * MiB}, 0, root, None, huge={"t": (MiB2, 100 * MiB)})
    assert v.ok and v.needed == 200 * MiB and v.hugetlb[0].needed == 100 * MiB
    assert "; hugetlb: 100.0 MiB for table t on 2 MiB huge pages (50 pages), 120.0 MiB available " \
           "(the 2 MiB pool: 60 of 64 pages free and not reserved)" in v.message
    # A table over MemAvailable on huge pages passes (and the same on shared memory does not); over its pool it
    # is refused, naming both figures
    assert preflight.check({"t": GiB}, 0, root, None, huge={"t": (GiB, 900 * MiB)}).ok
    assert not preflight.check({"t": GiB}, 0, root, None).ok
    v = preflight.check({"t": 200 * MiB}, 0, root, None, huge={"t": (MiB2, 200 * MiB)})
    assert not v.ok and v.message == (
        "pled needs 200.0 MiB for table t on 2 MiB huge pages (100 pages) but only 120.0 MiB (60 pages) is "
        "available to this service (the 2 MiB pool: 60 of 64 pages free and not reserved); reserve 40 more: echo 104 "
        "> /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages "
        "(/usr/share/doc/pled/operations.md, Huge pages), or set "
        'huge_pages = "prefer-hugetlb" to fall back to shared memory')
    with pytest.raises(preflight.PreflightRefused) as err:
        v.raise_if_refused()
    assert (err.value.needed, err.value.available, err.value.exit_status) == (200 * MiB, 120 * MiB, 78)
    # 1 GiB pages: the rounding is named
    v = preflight.check({"t": GiB}, 0, root, None, huge={"t": (GiB, 300 * MiB)})
    assert v.ok and "table t on 1 GiB huge pages (1 pages; t's 300.0 MiB rounded up to 1.0 GiB: whole pages)" in \
        v.message
    # A hugetlb cgroup limit below the pool: the cgroup's figures, and its fix
    h.file("/proc/self/cgroup", "12:hugetlb:/pled\n0::/\n")
    h.file("/proc/self/mountinfo", "44 31 0:40 / /sys/fs/cgroup/hugetlb rw - cgroup cgroup rw,hugetlb\n")
    h.file("/sys/fs/cgroup/hugetlb/pled/hugetlb.2MB.limit_in_bytes", f"{8 * MiB}\n")
    h.file("/sys/fs/cgroup/hugetlb/pled/hugetlb.2MB.usage_in_bytes", "0\n")
    h.file("/sys/fs/cgroup/hugetlb/hugetlb.2MB.limit_in_bytes", f"{UNLIMITED}\n")
    h.file("/sys/fs/cgroup/hugetlb/hugetlb.2MB.usage_in_bytes", "0\n")
    v = preflight.check({"t": 20 * MiB}, 0, root, None, huge={"t": (MiB2, 20 * MiB)})
    assert not v.ok and "but only 8.0 MiB (4 pages) is available" in v.message
    assert "hugetlb cgroup /pled allows 8.0 MiB more (limit 8.0 MiB, 0.0 KiB used)" in v.message
    assert "raise the hugetlb cgroup's limit (hugetlb.2MB.limit_in_bytes" in v.message
    assert v.as_dict()["hugetlb"][0]["cgroup"]["headroom_bytes"] == 8 * MiB


def test_tables_on_2m_and_1g_pages_at_once_each_count_against_their_own_pool_only(tmp_path, sidecar):
    """Two page sizes in one config: a table on 2 MiB pages, one on a 1 GiB page, and a third that prefers 2 MiB
    pages. Each takes from its own pool and is counted against that pool alone, as the kernel allocates them: the
    1 GiB page leaves the 2 MiB pool's room to the third table, and the verdict has one line per pool. A fixture
    tree stands in for /sys (this host may not give a 1 GiB page); the tables are real sidecars, planned by pled."""
    from pled.daemon.regions import planning

    h = host(tmp_path, {MiB2: (8, 6, 0), GiB: (2, 1, 0)}, available=512 * MiB)  # 12 MiB and 1 GiB free
    root = str(tmp_path)
    paths = {"a": sidecar(shards=3, rows=3000), "b": sidecar(shards=1, rows=300), "c": sidecar(shards=1, rows=200)}
    c = cfg('huge_pages = "hugetlb"\nheadroom_margin = 0', [
        f'[[table]]\nname = "a"\npath = "{paths["a"]}"\nhuge_page_size = "2M"\n',  # 4 pages of 2 MiB
        f'[[table]]\nname = "b"\npath = "{paths["b"]}"\nhuge_page_size = "1G"\n',  # 4 MiB: 1 page of 1 GiB
        f'[[table]]\nname = "c"\npath = "{paths["c"]}"\nhuge_pages = "prefer-hugetlb"\nhuge_page_size = "2M"\n'])
    manifests = planning.plan_tables(planning.open_tables(c))
    assert [manifests[n].region_bytes for n in "abc"] == [8 * MiB, 4 * MiB, 4 * MiB]
    pages = planning.plan_pages(c, manifests, root)
    assert [pages[n].page_size for n in "abc"] == [MiB2, GiB, MiB2]
    assert pages["c"].reason == ('hugetlb 2 MiB pages (huge_pages = "prefer-hugetlb", pool has 2 free after the '
                                 'tables before it (4 taken), needs 2)')
    v = planning.run_preflight(c, manifests, root, pages)
    assert v.ok, v.message
    assert [(x.page_size, x.tables, x.available) for x in v.hugetlb] == [
        (MiB2, {"a": 8 * MiB, "c": 4 * MiB}, 12 * MiB), (GiB, {"b": GiB}, GiB)]
    assert v.message == (
        "preflight passed: hugetlb: 12.0 MiB for tables a (8.0 MiB), c (4.0 MiB) on 2 MiB huge pages (6 pages), "
        "12.0 MiB available (the 2 MiB pool: 6 of 8 pages free and not reserved); hugetlb: 1.0 GiB for table b on "
        "1 GiB huge pages (1 pages; b's 4.0 MiB rounded up to 1.0 GiB: whole pages), 1.0 GiB available (the 1 GiB "
        "pool: 1 of 2 pages free and not reserved)")
    # One pool short: refused naming that pool alone; the other one's tables are not in its figures.
    h.file("/sys/kernel/mm/hugepages/hugepages-1048576kB/free_hugepages", "0\n")
    v = planning.run_preflight(c, manifests, root, pages)
    assert not v.ok and [x.ok for x in v.hugetlb] == [True, False]
    assert v.message.startswith("pled needs 1.0 GiB for table b on 1 GiB huge pages (1 pages; b's 4.0 MiB rounded up "
                                "to 1.0 GiB: whole pages) but only 0.0 KiB (0 pages) is available"), v.message
    assert "2 MiB" not in v.message


def test_a_plan_rounded_to_whole_pages_changes_only_its_size(sidecar):
    from pled.daemon.sources.sidecar import open_table
    from pled.shared import region

    m = region.plan("t", open_table(str(sidecar(shards=2, rows=500))))
    assert m.paged(4096) == m and m.paged(MiB2) == m and m.region_bytes % MiB2 == 0
    big = m.paged(GiB)
    assert big.region_bytes == GiB and big.identity() != m.identity()
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}  # the record's fields (not what it caches)
    assert big == type(m)(**{**fields, "region_bytes": GiB})
    assert len(region.encode_header(big)) <= big.data_offset  # the header still fits before the data
    assert region.Manifest.from_json(big.to_json()) == big


def test_a_shared_memory_region_gets_its_numa_policy_before_its_first_page(tmp_path):
    """The policy is the memfd's own: a mapping made later (a client's) shows it, and its pages follow it."""
    node = numa.nodes_with_memory()[0]
    plan = pageplan.PagePlan("off", 0, "test", pageplan.NumaPolicy(numa.MPOL_BIND, (node,), (node,)))
    fd, got = regionfd.create("numa-shmem", 4 * MiB, plan)
    try:
        assert got == plan and os.fstat(fd).st_blocks == 0  # no page yet
        os.pwrite(fd, b"x" * (4 * MiB), 0)  # as sendfile allocates them
        seen = numa.survey(fd, 4 * MiB)
        assert (seen.policy, seen.bytes_per_node) == (f"bind:{node}", {node: 4 * MiB})
    finally:
        os.close(fd)


def test_a_hugetlb_region_is_allocated_under_its_plans_numa_policy(monkeypatch):
    """hugetlb.create allocates by the calling thread's policy: regionfd makes the plan's policy the thread's for that
    call, and puts the old one back (one node cannot show where pages land; the policy of the call can)."""
    node = numa.nodes_with_memory()[0]
    seen = []

    def create(name, size, page_size):
        seen.append(numa.get_mempolicy())
        return os.memfd_create(name)

    monkeypatch.setattr(hugetlb, "create", create)
    plan = pageplan.PagePlan("hugetlb", MiB2, "test", pageplan.NumaPolicy(numa.MPOL_BIND, (node,), (node,)))
    fd, _ = regionfd.create("numa-huge", MiB2, plan)
    os.close(fd)
    assert seen == [(numa.MPOL_BIND, [node])] and numa.get_mempolicy() == (numa.MPOL_DEFAULT, [])


def test_a_pool_that_ran_short_since_planning_fails_hugetlb_and_falls_back_for_prefer(monkeypatch, sidecar):
    """Another program took the pages between the plan and the staging: "hugetlb" fails naming the pool, "prefer-
    hugetlb" is staged on shared memory as "auto" would be, the whole region allocated (a plan rounded up to a
    huge page (here 64 MiB) included: residency is then 100%, as on huge pages), and says why."""
    from pled.daemon.regions import staging
    from pled.daemon.sources.sidecar import open_table
    from pled.shared import region
    from pled.shared.errors import StagingError
    from pled.shared.pagecache import cached_bytes_fd

    def short(name, size, page_size):
        raise hugetlb.NoHugePages(12, f"no room for {size // page_size} pages of {hugetlb.size_name(page_size)}")

    monkeypatch.setattr(hugetlb, "create", short)
    node = numa.nodes_with_memory()[0]
    policy = pageplan.NumaPolicy(numa.MPOL_INTERLEAVE, (node,), (node,))
    s = open_table(str(sidecar(shards=2, rows=500)))
    page = 64 * MiB  # hugetlb.create is stood in for: any size past 2 MiB rounds the plan up
    planned = region.plan("t", s).paged(page)
    with pytest.raises(StagingError, match="no room for 1 pages of 64MB; nothing was copied"):
        staging.stage("t", s, planned=planned, pages=pageplan.PagePlan("hugetlb", page, "planned", policy))
    with staging.stage("t", s, planned=planned, pages=pageplan.PagePlan("prefer-hugetlb", page, "", policy)) as r:
        assert r.stats.page_size == 0 and r.stats.fill.method != staging.HUGETLB
        assert r.stats.pages.reason == '4 KiB/THP pages as "auto": when staging, no room for 1 pages of 64MB'
        assert os.fstat(r.fd).st_size == page and cached_bytes_fd(r.fd) == page
        fields = pageplan.status_fields(r.fd, page, r.stats, None)
        assert fields["huge_page_note"].startswith('4 KiB/THP pages as "auto": when staging, no room')
        assert fields["numa"]["policy"] == f"interleave:{node}"


@pytest.mark.daemon
def test_pled_refuses_a_bad_setting_in_one_line_naming_the_file_and_the_key(tmp_path, sidecar):
    from harness import run_pled, write_config

    offered = ", ".join(f'"{pageplan.config_text(s)}"' for s in hugetlb.page_sizes()) or "none"
    node = max(numa.nodes_with_memory()) + 1
    for keys, words in (({"numa": [node]}, f"key numa: node {node} has no memory on this host"),
                        ({"huge_page_size": "64K"}, "key huge_page_size: \"64K\" is not a huge page size this kernel "
                                                    f"offers; it offers {offered}")):
        cfg = write_config(tmp_path / "pled.toml", {"t": sidecar(shards=1, rows=10)}, headroom_margin=0, **keys)
        done = run_pled("serve", "-c", cfg)
        refusal = [line for line in done.stderr.splitlines() if "ERROR" in line]
        assert done.returncode == 78 and len(refusal) == 1, done.stderr
        assert f"{cfg}: {words}" in refusal[0], refusal


@pytest.mark.daemon
@pytest.mark.parametrize("pages", ["shared memory", pytest.param("hugetlb", marks=pytest.mark.root)])
def test_where_the_kernel_refuses_mbind_and_set_mempolicy_tables_are_staged_unplaced_and_the_log_says_why(
        tmp_path, sidecar, pages):
    """pled under a system-call filter that answers EPERM to mbind and set_mempolicy (a unit's SystemCallFilter=
    without pled's exception for them, a container runtime's seccomp profile without CAP_SYS_NICE), a real one
    (tests/syscall_filter.py): a table on shared memory (mbind) or on reserved huge pages (set_mempolicy) is staged
    and served unplaced, and the log and `pled status` (its note, Status's numa.not_placed) say so and why; a numa
    key set in the config, a placement asked for and impossible here, is refused (78) naming the key."""
    import syscall_filter
    from harness import Daemon, run_pled, start, write_config
    from hugepool import reserve
    from pled import client
    from pled.shared import protocol

    try:
        prefix = syscall_filter.prefix(["mbind", "set_mempolicy"])
    except syscall_filter.Unsupported as err:
        pytest.skip(str(err))
    keys = {"huge_pages": "hugetlb", "huge_page_size": "2M"} if pages == "hugetlb" else {}
    d = sidecar(shards=3, rows=3000)
    with reserve(8) if pages == "hugetlb" else contextlib.nullcontext():
        pled = start(tmp_path, {"t": d}, name="filtered", prefix=prefix, **keys)
        try:
            log = pled.log()
            assert "; NUMA not placed: the kernel refuses mbind/set_mempolicy here (Operation not permitted)" in log
            assert "table t staged:" in log and "sealed, NUMA" not in log  # staged, and no policy claimed
            done = run_pled("status", "--json", "--socket", pled.socket)
            (t,) = json.loads(done.stdout)["tables"]
            # No policy: shared memory's own is the default one; reserved pages keep none, and none was applied.
            unplaced = None if pages == "hugetlb" else "default"
            assert (done.returncode, t["state"], t["numa"]["policy"]) == (0, "ready", unplaced), done.stdout
            why = "the kernel refuses mbind/set_mempolicy here (Operation not permitted)"
            assert t["numa"]["not_placed"] == why, t["numa"]  # Status says why, not the log alone
            shown = run_pled("status", "--socket", pled.socket)
            assert f"  note: t: NUMA not placed: {why}\n" in shown.stdout, shown.stdout
            assert t["huge_page_policy"] == ("hugetlb" if pages == "hugetlb" else t["huge_page_policy"])
            with client.attach("t", socket=pled.socket) as table:
                for s in table.shards:
                    with open(s.path, "rb") as f:
                        assert table.buffer[s.offset:s.offset + s.size] == f.read()
            assert client.call(protocol.PING, socket=pled.socket) == {}
        finally:
            assert pled.stop() == 0
        cfg = write_config(tmp_path / "numa.toml", {"t": d}, headroom_margin=0, numa="interleave", **keys)
        refused = Daemon(cfg, prefix=prefix)
        assert refused.wait(30) == 78
        assert ("key numa: NUMA placement is asked for, but the kernel refuses mbind/set_mempolicy here (Operation "
                "not permitted); allow mbind and set_mempolicy (the unit's SystemCallFilter=), or leave numa out"
                ) in refused.log(), refused.log()
