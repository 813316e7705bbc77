"""The writable route's parts without a daemon (issue 45): its config keys and their refusals, the memfd it is
staged into (seals, mode), the client's checks of an Attach reply, the fd store's refusal to adopt a writable
region, and the scheduled verify (what it finds, the range it names, its throttle). Real memfds, real staging."""
import fcntl
import logging
import os

import pytest

from pled.client import library
from pled.client.connection import ProtocolError
from pled.daemon import config
from pled.daemon.regions import integrity, staging
from pled.daemon.sources.sidecar import open_table
from pled.daemon.systemd import fdstore
from pled.daemon.systemd.fdstore import StoredFd
from pled.daemon.systemd.notify import Notifier
from pled.shared import region
from pled.shared.errors import EX_CONFIG, ConfigError, RegionError

TABLE = '[[table]]\nname = "t"\npath = "/srv/t"\n'


def parse(text):
    return config.parse(text, "/etc/pled/pled.toml")


# -- config ----------------------------------------------------------------------------------------------------------

def test_writable_keys_parse_and_default_to_read_only():
    t = parse(TABLE).tables[0]
    assert (t.gpu_access, t.writers, t.gpu_routes, t.writer_uids, t.verify_seconds) == \
        ("read-only", (), ("read-only", "pageable", "writable"), frozenset(), None)
    c = parse('verify_cpu_share = 0.25\nverify_bandwidth = "200MB/s"\n' + TABLE +
              'gpu_access = "writable"\nwriters = ["root", 4321]\ngpu_routes = ["writable", "read-only"]\n')
    t = c.tables[0]
    assert (t.writable, t.writer_uids, t.gpu_routes, t.verify_seconds) == \
        (True, frozenset({0, 4321}), ("writable", "read-only"), config.DEFAULT_VERIFY_INTERVAL)
    assert (c.verify_cpu_share, c.verify_bandwidth, c.table("t") is t, c.table("u")) == (0.25, 200_000_000, True, None)
    assert parse(TABLE + 'gpu_access = "writable"\nwriters = [1]\nverify_interval = 2.5\n').tables[0].verify_seconds \
        == 2.5


@pytest.mark.parametrize("text, key, words", [
    (TABLE + 'gpu_access = "rw"', "table[0].gpu_access", "'read-only' or 'writable'"),
    (TABLE + 'gpu_access = "writable"', "table[0]", "needs writers = [...]"),
    (TABLE + 'writers = [1]', "table[0]", "writers is only for a table with gpu_access = \"writable\""),
    (TABLE + 'verify_interval = 5', "table[0]", "verify_interval is only for a table with gpu_access"),
    (TABLE + 'gpu_access = "writable"\nwriters = ["no-such-user-pled"]', "table[0].writers", "no user named"),
    (TABLE + 'gpu_access = "writable"\nwriters = [1, 1]', "table[0].writers", "names a writer twice"),
    (TABLE + 'gpu_access = "writable"\nwriters = [-1]', "table[0].writers", "-1 is not a uid"),
    (TABLE + 'gpu_routes = []', "table[0].gpu_routes", "an empty list"),
    (TABLE + 'gpu_routes = ["pageable", "pageable"]', "table[0].gpu_routes", "names a route twice"),
    (TABLE + 'gpu_routes = ["gpu"]', "table[0].gpu_routes[0]", "'read-only', 'pageable' or 'writable'"),
    (TABLE + 'gpu_access = "writable"\nwriters = [1]\nverify_interval = 0', "table[0].verify_interval", "0.1 to"),
    (TABLE + 'gpu_access = "writable"\nwriters = [1]\nverify_interval = true', "table[0].verify_interval", "seconds"),
    ("verify_cpu_share = 0\n", "verify_cpu_share", "greater than 0"),
    ("verify_cpu_share = 1.5\n", "verify_cpu_share", "less than or equal to 1"),
    ("verify_cpu_share = '10%'\n", "verify_cpu_share", "a share of one core"),
    ("verify_bandwidth = 0\n", "verify_bandwidth", "must be positive"),
])
def test_bad_writable_keys_are_refused_naming_the_key(text, key, words):
    with pytest.raises(ConfigError) as err:
        parse(text)
    assert err.value.exit_status == EX_CONFIG
    assert f"key {key}: " in str(err.value) and words in str(err.value), str(err.value)


# -- the memfd -------------------------------------------------------------------------------------------------------

@pytest.fixture
def pair(sidecar):
    """The same sidecar staged read-only and writable."""
    d = sidecar("ples_int4", shards=2, rows=300)
    ro, rw = staging.stage("t", open_table(str(d))), staging.stage("t", open_table(str(d)), writable=True)
    yield d, ro, rw
    ro.close()
    rw.close()


def test_a_writable_table_is_sealed_against_all_but_writing_and_its_inode_is_0440(pair):
    _, ro, rw = pair
    assert (region.seals(ro.fd), os.fstat(ro.fd).st_mode & 0o777) == (region.SEALS, 0o444)
    assert (region.seals(rw.fd), os.fstat(rw.fd).st_mode & 0o777) == (region.WRITABLE_SEALS, 0o440)
    assert not region.is_sealed(rw.fd)
    region.check_sealed_memfd(rw.fd, writable=True)
    with pytest.raises(RegionError, match="not sealed"):
        region.check_sealed_memfd(rw.fd)  # a client told "read-only" refuses a region that can change
    with pytest.raises(OSError):
        os.ftruncate(rw.fd, 0)
    with pytest.raises(OSError):
        fcntl.fcntl(rw.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # F_SEAL_SEAL: no one seals it read-only under pled
    assert staging.describe_ready(rw).count("NOT against writing") == 1
    assert "NOT against writing" not in staging.describe_ready(ro)


def test_the_fd_store_never_adopts_a_writable_region_nor_a_sealed_one_for_a_writable_table(pair, caplog):
    d, ro, rw = pair
    caplog.set_level(logging.INFO, logger="pled.daemon.systemd.fdstore")
    planned = {"t": region.plan("t", open_table(str(d)))}
    store = fdstore.FdStore(Notifier({}), {})
    out = fdstore.adopt_stored([StoredFd(os.dup(rw.fd), "pled.2.t")], planned, store)
    assert not out.adopted and "was writable" in caplog.text and "staging it anew" in caplog.text
    out = fdstore.adopt_stored([StoredFd(os.dup(ro.fd), "pled.2.t")], planned, store, writable=frozenset({"t"}))
    assert not out.adopted and "is now gpu_access = \"writable\"" in caplog.text
    out = fdstore.adopt_stored([StoredFd(os.dup(ro.fd), "pled.2.t")], planned, store)
    assert "t" in out.adopted
    out.adopted["t"][0].close()


# -- the client's checks of the Attach reply ---------------------------------------------------------------------------

def reopened(fd: int, flags: int) -> int:
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)


def test_the_client_takes_the_gpu_side_of_the_reply_and_checks_the_fds_mode(pair):
    _, ro, rw = pair
    rdonly = reopened(ro.fd, os.O_RDONLY)
    rwdup = os.dup(rw.fd)
    try:
        assert library._gpu_side({}, "s", "t", rdonly) == ("read-only", ("read-only", "pageable"), False)
        reply = {"gpu_access": "writable", "gpu_routes": ["writable"], "writer": True}
        assert library._gpu_side(reply, "s", "t", rwdup) == ("writable", ("writable",), True)
        for bad in ({"gpu_access": "rw"}, {"writer": 1}, {"writer": True}, {"gpu_routes": []},
                    {"gpu_routes": ["x"]}, {"gpu_routes": ["pageable", "pageable"]}, {"gpu_routes": "pageable"}):
            with pytest.raises(ProtocolError):
                library._gpu_side(bad, "s", "t", rdonly)
        with pytest.raises(ProtocolError, match="open read-only to a writer"):
            library._gpu_side(reply, "s", "t", rdonly)
        with pytest.raises(ProtocolError, match="open read-write to a client that is not a writer"):
            library._gpu_side(reply | {"writer": False}, "s", "t", rwdup)
    finally:
        os.close(rdonly)
        os.close(rwdup)


# -- the scheduled verify --------------------------------------------------------------------------------------------

def fast() -> integrity.Throttle:
    return integrity.Throttle(1.0, 1 << 60)


def test_an_untouched_writable_region_verifies_clean_and_reads_every_piece_and_the_header(pair):
    _, _, rw = pair
    header = os.pread(rw.fd, rw.manifest.data_offset, 0)
    out = integrity.verify(rw.fd, rw.manifest, header, fast())
    assert out.differences == ()
    assert out.bytes_read == len(header) + sum(p.nbytes for p in rw.manifest.pieces())


@pytest.mark.parametrize("where", ["first", "last", "middle", "header", "two"])
def test_a_changed_byte_is_found_and_named_by_its_exact_range(pair, where):
    _, _, rw = pair
    header = os.pread(rw.fd, rw.manifest.data_offset, 0)
    shard = rw.manifest.shards[1]
    at = {"first": [shard.offset], "last": [shard.offset + shard.size - 1], "middle": [shard.offset + shard.size // 2],
          "header": [100], "two": [shard.offset + 7, shard.offset + shard.size - 3]}[where]
    for a in at:
        os.pwrite(rw.fd, bytes([os.pread(rw.fd, 1, a)[0] ^ 0xFF]), a)
    (d,) = integrity.verify(rw.fd, rw.manifest, header, fast()).differences
    assert (d.start, d.end) == (at[0], at[-1] + 1)
    assert d.what == ("header" if where == "header" else os.path.basename(shard.path))


def test_a_changed_piece_whose_source_changed_too_is_named_whole(pair):
    d, _, rw = pair
    header = os.pread(rw.fd, rw.manifest.data_offset, 0)
    shard = rw.manifest.shards[0]
    os.pwrite(rw.fd, b"\x01", shard.offset + 5)
    os.utime(shard.path, ns=(shard.mtime_ns + 10**9, shard.mtime_ns + 10**9))  # not the file pled staged any more
    (diff,) = integrity.verify(rw.fd, rw.manifest, header, fast()).differences
    assert (diff.start, diff.end) == (shard.offset, shard.offset + shard.size)


def test_the_throttle_keeps_the_cpu_share_and_the_bandwidth():
    """With clocks of the test's own: the pause asked for is what keeps each figure under its bound."""
    now = {"wall": 0.0, "cpu": 0.0}
    slept = []

    def sleep(s):
        slept.append(s)
        now["wall"] += s

    t = integrity.Throttle(0.1, 1000, sleep=sleep, clock=lambda: now["wall"], cpu_clock=lambda: now["cpu"])
    now["wall"] += 0.5
    now["cpu"] += 0.5  # half a second of work, all of it CPU
    t.account(10)  # 10 bytes: the bandwidth asks nothing, the share 5 s in all
    assert slept == [pytest.approx(4.5)]
    now["wall"] += 0.01
    t.account(9990)  # 10 kB at 1 kB/s: 10 s in all
    assert slept[-1] == pytest.approx(10 - 5.01)
    assert now["cpu"] / now["wall"] <= 0.1 and t.done / now["wall"] <= 1000
    stopping = integrity.Throttle(1.0, 1 << 40, should_stop=lambda: True)
    with pytest.raises(integrity.Stopped):
        stopping.account(1)
