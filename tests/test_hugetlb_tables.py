"""Tables on reserved huge pages (issue 21) with a real pled, real clients and the real kernel's pools: each test
reserves a small pool (tests/hugepool.py puts nr_hugepages back whatever happens), stages into it, serves, adopts,
reloads, verifies, and is refused where the pool or the hugetlb cgroup is short; the host's huge-page settings are
checked unchanged at the end, as the PID 1 test checks its own. NUMA: the policy pled applies, read back from
numa_maps (one node here: interleave:0 and bind:0, which change nothing but show)."""
import json
import os
import time

import pytest

from harness import Daemon, NotifySocket, run_pled, wait_until, write_config
from hugepool import (
    GiB1,
    MiB2,
    host_unchanged,  # noqa: F401 (an autouse fixture: the host as it was, checked)
    hugetlb_cgroup_v1,
    reserve,
)
from pled import client
from pled.daemon.memory import hugetlb, numa
from pled.generator import make_sidecar
from pled.shared.sizes import gib

pytestmark = [pytest.mark.root, pytest.mark.daemon]
NODES = numa.nodes_with_memory()


def free2m() -> int:
    return hugetlb.pool(MiB2).available_pages


def status(pled) -> dict:
    done = run_pled("status", "-c", pled.config, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def same_bytes(table) -> bool:
    for s in table.shards:
        with open(s.path, "rb") as f:
            if table.buffer[s.offset:s.offset + s.size] != f.read():
                return False
    return True


def region_maps(name: str):
    """This process's numa_maps lines for a mapped region (a memfd named pled:<table>)."""
    return numa.memfd_mappings(f"pled:{name}")


@pytest.fixture
def table_dir(tmp_path):
    d = tmp_path / "sc"
    make_sidecar(str(d), "ples_int4", shards=3, rows=3000)  # 3 shards of 293 KiB: a region of 4 pages of 2 MiB
    return d


def test_a_table_on_2m_pages_is_staged_sealed_served_resident_and_verified(tmp_path, table_dir, daemon):
    with reserve(16) as given:
        if given < 8:
            pytest.skip(f"this host gave {given} of 16 pages of 2 MiB asked")
        before = free2m()
        pled = daemon({"t": table_dir}, huge_pages="hugetlb", huge_page_size="2M")
        log = pled.log()
        assert f'table t: hugetlb 2 MiB pages (huge_pages = "hugetlb", pool has {before} free, needs 4)' in log
        assert "huge pages 100% (hugetlb 2 MiB), sealed, NUMA interleave:" in log
        assert "on 2 MiB huge pages (4 pages)" in log  # the preflight's line
        (t,) = status(pled)["tables"]
        region = t["region_bytes"]
        assert region == 4 * MiB2 and free2m() == before - 4
        assert (t["page_size"], t["page_size_bytes"], t["huge_page_bytes"], t["huge_page_policy"],
                t["resident_share"], t["sealed"]) == ("2 MiB", MiB2, region, "hugetlb", 1.0, True)
        assert t["numa"] == {"policy": f"interleave:{numa.format_nodelist(NODES)}",
                             "bytes_per_node": {str(n): b for n, b in t["numa"]["bytes_per_node"].items()},
                             "measured": "every page", "not_placed": None}
        assert sum(t["numa"]["bytes_per_node"].values()) == region
        with client.attach("t", socket=pled.socket) as table:
            assert table.page_size == MiB2 and table.residency() == 1.0 and same_bytes(table)
            print(f"populate of a 2 MiB-page table: {table.populate_seconds * 1e3 / (region / GiB1):.2f} ms/GiB")
            (mapped,) = region_maps("t")  # a client's own mapping: every page, huge, on the nodes with memory
            assert mapped.huge and sum(mapped.pages.values()) == 4 and set(mapped.pages) <= set(NODES)
        done = run_pled("verify", "-c", pled.config)
        assert done.returncode == 0 and "table t: all shards identical" in done.stdout, done.stdout + done.stderr
        assert pled.stop() == 0
        wait_until(lambda: free2m() == before, 5, "the pool did not get its pages back")


def test_a_short_pool_is_refused_at_once_copying_nothing(tmp_path, table_dir):
    with reserve(2) as given:
        before = hugetlb.pool(MiB2)
        cfg = write_config(tmp_path / "pled.toml", {"t": table_dir}, huge_pages="hugetlb", headroom_margin=0)
        started = time.monotonic()
        done = run_pled("serve", "-c", cfg)
        took = time.monotonic() - started
        assert done.returncode == 78, (took, done.stderr)  # at once: before any copy (no timing threshold here)
        assert (f"pled needs 8.0 MiB for table t on 2 MiB huge pages (4 pages) but only {gib(given * MiB2)} "
                f"({given} pages) is available to this service (the 2 MiB pool: {given} of {given} pages free") \
            in done.stderr
        assert "shard 1/3" not in done.stderr and not (tmp_path / "run" / "pled.sock").exists()
        assert hugetlb.pool(MiB2) == before  # nothing taken, nothing reserved
        print(f"refused with 78 in {took:.2f} s (the whole process, Python's start included)")


def test_a_hugetlb_cgroup_limit_below_the_table_is_refused_at_once(tmp_path, table_dir):
    with reserve(8) as given, hugetlb_cgroup_v1(tmp_path) as cg:
        if given < 4:
            pytest.skip(f"this host gave {given} of 8 pages of 2 MiB asked")
        child = cg.child("pled", {MiB2: 2 * MiB2})
        cfg = write_config(tmp_path / "pled.toml", {"t": table_dir}, huge_pages="hugetlb", headroom_margin=0)
        before = hugetlb.pool(MiB2)
        pled = Daemon(cfg, cgroup=child)
        started = time.monotonic()
        try:
            assert pled.wait(30) == 78
        finally:
            pled.stop()  # a pled that was not refused gives its pages back before the pool shrinks
        took = time.monotonic() - started
        log = pled.log()
        assert "but only 4.0 MiB (2 pages) is available" in log, (took, log)
        assert "hugetlb cgroup /pled allows 4.0 MiB more (limit 4.0 MiB, 0.0 KiB used)" in log
        assert "raise the hugetlb cgroup's limit" in log and "shard 1/3" not in log
        assert cg.usage(child) == 0 and hugetlb.pool(MiB2) == before
        print(f"refused with 78 in {took:.2f} s (the whole process, Python's start included)")


def test_a_hugetlb_limit_on_a_parent_cgroup_is_honoured_by_the_preflight(tmp_path, table_dir):
    """A pod's (or a slice's) hugetlb limit binds every cgroup under it: pled in a child cgroup with no limit of its
    own, under a parent allowed 2 pages, is refused at once with 78, the parent named with its figures, before
    any page is taken; without that check the allocation itself would fail, and pled exit 1 into a restart loop."""
    with reserve(8) as given, hugetlb_cgroup_v1(tmp_path) as cg:
        if given < 4:
            pytest.skip(f"this host gave {given} of 8 pages of 2 MiB asked")
        pod = cg.child("pod", {MiB2: 2 * MiB2})
        leaf = cg.child("pod/pled", {})
        assert int((leaf / "hugetlb.2MB.limit_in_bytes").read_text()) > given * MiB2  # the leaf: no limit of its own
        cfg = write_config(tmp_path / "pled.toml", {"t": table_dir}, huge_pages="hugetlb", headroom_margin=0)
        before = hugetlb.pool(MiB2)
        pled = Daemon(cfg, cgroup=leaf)
        try:
            assert pled.wait(30) == 78, pled.log()
        finally:
            pled.stop()  # a pled that was not refused gives its pages back before the pool shrinks
        log = pled.log()
        assert "but only 4.0 MiB (2 pages) is available" in log, log
        assert "hugetlb cgroup /pod allows 4.0 MiB more (limit 4.0 MiB, 0.0 KiB used)" in log, log
        assert "raise the hugetlb cgroup's limit" in log and "shard 1/3" not in log
        assert cg.usage(pod) == 0 and cg.usage(leaf) == 0 and hugetlb.pool(MiB2) == before


def test_prefer_hugetlb_without_room_serves_on_shared_memory_and_says_why(tmp_path, table_dir, daemon):
    with reserve(1):
        before = hugetlb.pool(MiB2)
        pled = daemon({"t": table_dir}, huge_pages="prefer-hugetlb", numa=[NODES[0]])
        why = 'table t: 4 KiB/THP pages as "auto": '
        log = pled.log()
        assert why in log and "the 2 MiB pool has 1 free, needs 4 (huge_pages = \"prefer-hugetlb\")" in log
        (t,) = status(pled)["tables"]
        assert t["page_size"] in ("4 KiB", "2 MiB") and t["huge_page_policy"] != "hugetlb"  # THP where allowed
        assert "the 2 MiB pool has 1 free, needs 4" in t["huge_page_note"]
        assert t["numa"]["policy"] == f"bind:{NODES[0]}" and sum(t["numa"]["bytes_per_node"].values()) > 0
        assert hugetlb.pool(MiB2) == before
        with client.attach("t", socket=pled.socket) as table:
            assert same_bytes(table)
            (mapped,) = region_maps("t")
            assert mapped.policy == f"bind:{NODES[0]}" and not mapped.huge  # the memfd's own policy, seen here


def test_numa_policies_show_in_a_clients_numa_maps_for_shmem_and_in_pleds_status_for_hugetlb(tmp_path, daemon):
    """One node here: the policy is applied and visible all the same. A shmem memfd carries its policy (any
    process's numa_maps shows it); a hugetlb memfd has none of its own (a client's mapping shows the client's
    policy), so its pages' nodes show, and pled's Status gives the policy they were placed by."""
    for name in ("s", "h", "l"):
        make_sidecar(str(tmp_path / name), "ples_int4", shards=2, rows=1000, seed=len(name) + ord(name))
    tables = {"s": {"path": str(tmp_path / "s"), "huge_pages": "off", "numa": [NODES[0]]},
              "h": {"path": str(tmp_path / "h"), "huge_pages": "hugetlb"},
              "l": {"path": str(tmp_path / "l"), "huge_pages": "off", "numa": "local"}}
    with reserve(8) as given:
        if given < 3:
            pytest.skip(f"this host gave {given} of 8 pages of 2 MiB asked")
        pled = daemon(tables, huge_page_size="2M")
        assert "table h: hugetlb 2 MiB pages" in pled.log()
        if len(NODES) == 1:
            assert "(one node with memory here: applied, but placement changes nothing)" in pled.log()
        got = {t["table"]: t["numa"] for t in status(pled)["tables"]}
        interleave = f"interleave:{numa.format_nodelist(NODES)}"
        assert [got[n]["policy"] for n in "shl"] == [f"bind:{NODES[0]}", interleave, "local"]
        with client.attach("s", socket=pled.socket) as s, client.attach("h", socket=pled.socket) as h, \
                client.attach("l", socket=pled.socket) as loc:
            assert (s.page_size, h.page_size) == (4096, MiB2) and same_bytes(h) and same_bytes(loc)
            (ms,), (mh,), (ml,) = region_maps("s"), region_maps("h"), region_maps("l")
            assert (ms.policy, ml.policy) == (f"bind:{NODES[0]}", "local")
            assert ms.pages == {NODES[0]: len(s.buffer) // 4096}  # every page where bind put it
            assert mh.huge and mh.policy == "default" and set(mh.pages) <= set(NODES)
            assert sum(mh.pages.values()) * MiB2 == len(h.buffer)
        assert pled.stop() == 0  # its pages back before the pool shrinks


def test_a_restart_adopts_a_hugetlb_region_only_while_the_config_asks_for_its_pages(tmp_path, table_dir):
    with reserve(12) as given:
        if given < 8:
            pytest.skip(f"this host gave {given} of 12 pages of 2 MiB asked")
        before = free2m()
        cfg = write_config(tmp_path / "pled.toml", {"t": table_dir}, huge_pages="hugetlb", headroom_margin=0)
        sock = str(tmp_path / "run" / "pled.sock")
        n = NotifySocket(tmp_path / "notify.sock")
        started = []

        def start(**kw):
            started.append(Daemon(cfg, env={"NOTIFY_SOCKET": n.path}, **kw))
            return started[-1]

        try:
            first = start()
            n.wait_for("READY=1")
            assert first.stop() == 0
            ((name, stored),) = n.stored()
            assert name == "pled.1.t" and free2m() == before - 4  # systemd's copy (here: ours) holds the pages
            second = start(fds=[(stored, name)])
            second.wait_ready()
            (t,) = client.call("io.pled.Status", socket=sock)["tables"]
            assert (t["origin"], t["page_size"], t["huge_page_bytes"], t["resident_share"]) == \
                ("adopted", "2 MiB", 4 * MiB2, 1.0)
            assert t["numa"]["policy"] is None and sum(t["numa"]["bytes_per_node"].values()) == 4 * MiB2
            assert free2m() == before - 4  # adopted: not a page more
            with client.attach("t", socket=sock) as table:
                assert table.page_size == MiB2 and same_bytes(table)
            assert second.stop() == 0
            # The config now asks for shared memory: the stored region is not adopted, it is staged anew
            write_config(cfg, {"t": table_dir}, huge_pages="auto", headroom_margin=0)
            third = start(fds=[(stored, name)])
            third.wait_ready()
            log = third.log()
            assert ('removing pled.1.t from the fd store: table t generation 1: it is on hugetlb 2 MiB pages, '
                    'huge_pages = "auto" asks for shared memory; staging it anew') in log
            (t,) = client.call("io.pled.Status", socket=sock)["tables"]
            assert (t["origin"], t["generation"]) == ("staged", 2) and t["huge_page_policy"] != "hugetlb"
            assert third.stop() == 0
        finally:
            for d in started:
                d.stop()
            n.close()  # closes every fd it received: the pages go back
        wait_until(lambda: free2m() == before, 5, "the pool did not get its pages back")


def test_a_reload_stages_a_new_hugetlb_generation_beside_the_old_one_and_the_pool_must_hold_both(
        tmp_path, table_dir, daemon):
    with reserve(10) as given:
        if given < 10:
            pytest.skip(f"this host gave {given} of 10 pages of 2 MiB asked")
        before = free2m()
        pled = daemon({"t": table_dir}, huge_pages="hugetlb", huge_page_size="2M")
        assert free2m() == before - 4
        with client.attach("t", socket=pled.socket) as old:
            make_sidecar(str(table_dir), "ples_int4", shards=3, rows=3000, seed=7)  # new bytes, same sizes
            assert pled.reload() == "reload done"
            assert "reload: table t: hugetlb 2 MiB pages" in pled.log()
            (t,) = status(pled)["tables"]
            assert (t["generation"], t["page_size"], t["huge_page_bytes"]) == (2, "2 MiB", 4 * MiB2)
            assert free2m() == before - 8  # the old generation still mapped by this client, the new one served
            with client.attach("t", socket=pled.socket) as new:
                assert new.generation == 2 and same_bytes(new) and not same_bytes(old)
        wait_until(lambda: free2m() == before - 4, 5, "generation 1's pages not freed with its last client")
        # The same files, other pages asked for: staged anew on shared memory, the pool's pages given back
        write_config(pled.config, {"t": table_dir}, socket=pled.socket, headroom_margin=0, huge_pages="auto")
        assert pled.reload() == "reload done"
        assert ('reload: table t is staged anew: it is on hugetlb 2 MiB pages, huge_pages = "auto" asks for shared '
                'memory') in pled.log()
        (t,) = status(pled)["tables"]
        assert t["generation"] == 3 and t["huge_page_policy"] != "hugetlb" and free2m() == before
        write_config(pled.config, {"t": table_dir}, socket=pled.socket, headroom_margin=0, huge_pages="hugetlb")
        assert pled.reload() == "reload done" and status(pled)["tables"][0]["generation"] == 4
        assert free2m() == before - 4
        # Only 2 pages beside the served generation's 4: a reload cannot stage its next one, and changes nothing
        hog = hugetlb.create("hog", (free2m() - 2) * MiB2, MiB2)
        try:
            make_sidecar(str(table_dir), "ples_int4", shards=3, rows=3000, seed=8)
            assert pled.reload() == "reload failed"
            assert "reload failed, nothing changed: pled needs 8.0 MiB for table t on 2 MiB huge pages (4 pages) " \
                   "but only 4.0 MiB (2 pages) is available" in pled.log()
            (t,) = status(pled)["tables"]
            assert t["generation"] == 4 and free2m() == 2
        finally:
            os.close(hog)
        assert pled.stop() == 0
        wait_until(lambda: free2m() == before, 5, "the pool did not get its pages back")


def test_a_client_whose_hugetlb_limit_is_0_maps_and_reads_a_table_pled_holds(tmp_path, table_dir, daemon):
    """A Kubernetes pod that requests no huge pages, on a host whose pool is full: pled's pages are pled's, the
    client's mapping (pre-faulted with MADV_POPULATE_READ) reserves and is charged none."""
    with reserve(8) as given, hugetlb_cgroup_v1(tmp_path) as cg:
        if given < 4:
            pytest.skip(f"this host gave {given} of 8 pages of 2 MiB asked")
        pled = daemon({"t": table_dir}, huge_pages="hugetlb")
        pod = cg.child("pod", {MiB2: 0})
        before = hugetlb.pool(MiB2)

        def attach_and_read():
            with client.attach("t", socket=pled.socket) as table:  # populate=True: MADV_POPULATE_READ on every page
                limit = hugetlb.pool(MiB2).cgroup.binding.limit
                return json.dumps([table.page_size, table.residency(), same_bytes(table), limit])

        hog = hugetlb.create("hog", free2m() * MiB2, MiB2)  # and the pool full: not a page left to reserve
        try:
            assert free2m() == 0
            assert json.loads(cg.run_in(pod, attach_and_read)) == [MiB2, 1.0, True, 0]
        finally:
            os.close(hog)
        assert cg.usage(pod) == 0 and hugetlb.pool(MiB2) == before
        assert pled.stop() == 0


@pytest.mark.slow
def test_a_table_on_a_1g_page(tmp_path, table_dir, daemon):
    if hugetlb.pool(GiB1) is None:
        pytest.skip("this kernel offers no 1 GiB pages")
    with reserve(1, GiB1):
        pled = daemon({"t": table_dir}, huge_pages="hugetlb", huge_page_size="1G", wait=None)
        pled.wait_ready(60)
        log = pled.log()
        assert "table t: hugetlb 1 GiB pages (huge_pages = \"hugetlb\", pool has 1 free, needs 1; 8.0 MiB rounded " \
               "up to 1.0 GiB, whole pages)" in log
        assert "t's 8.0 MiB rounded up to 1.0 GiB: whole pages" in log  # the preflight names the rounding
        (t,) = status(pled)["tables"]
        assert (t["region_bytes"], t["page_size"], t["huge_page_bytes"], t["resident_share"]) == \
            (GiB1, "1 GiB", GiB1, 1.0)
        assert hugetlb.pool(GiB1).available_pages == 0
        with client.attach("t", socket=pled.socket) as table:
            assert table.page_size == GiB1 and len(table.buffer) == GiB1 and same_bytes(table)
            print(f"populate of a 1 GiB-page table: {table.populate_seconds * 1e3:.2f} ms/GiB")
        assert run_pled("verify", "-c", pled.config).returncode == 0
        assert pled.stop() == 0
        wait_until(lambda: hugetlb.pool(GiB1).available_pages == 1, 5, "the 1 GiB page did not come back")
