"""The writable route (issue 45), with real processes: pled runs as its own user, a writer uid and a non-writer uid
(both in pled's group) attach the same table with gpu_access = "writable".

The writer gets one read-write shared mapping that it can turn read-only (``Table.protect``); the non-writer gets a
read-only fd that pled reopened for it, and every way of writing the table through it is refused (one test per
route); both read the same bytes. A byte the writer changes is found by the scheduled verify within its period, shown
in `pled status` (exit 1), the metrics and the journal, and `pled verify --repair` gives new attaches a clean
generation. No GPU is involved: what a GPU registration would do with the writable mapping is the gpu helper's.
"""
import ctypes
import encodings.ascii  # noqa: F401 (a forked child that dropped root cannot import from root's Python any more)
import errno
import fcntl
import mmap
import os
import re
import time
from pathlib import Path

import pytest

import harness
from forked import become, in_child
from harness import JournalSocket, run_pled
from pled import client
from pled.daemon.health import journal
from pled.generator import make_sidecar

pytestmark = [pytest.mark.root, pytest.mark.daemon]

PLED = harness.unused_gid(4300)  # pled's uid and gid (its group): as pled.service runs it
WRITER, OTHER = PLED + 1, PLED + 2  # both in pled's group; only WRITER is named in writers = [...]
SEAL_WRITE = fcntl.F_SEAL_WRITE


def as_uid(uid: int, action) -> str:
    """``action()`` in a forked child that is ``uid`` with pled's group as its supplementary group."""
    return in_child(action, before=lambda: become(uid, [PLED]))


def start_pled(open_dir: str, pleds: list, name: str, *, env=None, log=None, wait: str | None = "ready:",
               **table) -> str:
    """pled as its own user serving table t (gpu_access = "writable", writers = [WRITER]); its socket path."""
    root = Path(open_dir)
    sc = root / f"sc-{name}"
    if not sc.exists():
        make_sidecar(str(sc), "ples_int4", shards=2, rows=64)
    run = root / name
    run.mkdir(mode=0o750)
    os.chown(run, PLED, PLED)  # RuntimeDirectory=pled: its group may traverse
    sock = str(run / "pled.sock")
    keys = {"path": str(sc), "gpu_access": "writable", "writers": [WRITER], "verify_interval": 3600} | table
    pled = harness.start(root, {"t": keys}, name=name, socket=sock, verify_cpu_share=1.0, env=env, wait=wait,
                         **({"log": log} if log else {}),
                         prefix=["setpriv", f"--reuid={PLED}", f"--regid={PLED}", "--clear-groups"])
    pleds.append(pled)
    return sock


@pytest.fixture
def served(open_dir, pleds):
    sock = start_pled(open_dir, pleds, "w")
    client.attach("t", socket=sock).close()  # every module an attach needs, imported before a child drops root
    return sock


def offset_of(t: client.Table) -> int:
    """A byte of shard 1's data, where a writer's change is easy to find."""
    return t.manifest.shards[1].offset + 100


def memfd_maps() -> list[str]:
    """This process's mappings of a memfd (/proc/self/maps), with their permissions."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "/memfd:" in line]


# -- the non-writer: every write route refused ---------------------------------------------------------------------

def as_other(sock: str, attempt) -> str:
    """As OTHER: attach, check the fd is read-only, try ``attempt(table)``; "refused <ERRNO>" or what happened."""
    def action():
        t = client.attach("t", socket=sock)
        assert (t.writer, t.gpu_access, fcntl.fcntl(t.fd, fcntl.F_GETFL) & os.O_ACCMODE) == \
            (False, "writable", os.O_RDONLY)
        try:
            result = attempt(t)
        except OSError as err:
            return f"refused {errno.errorcode[err.errno]}"
        return f"done: {result}"
    return as_uid(OTHER, action)


def reopen_rdwr(t):
    return os.open(f"/proc/self/fd/{t.fd}", os.O_RDWR)


def do_fchmod(t):
    os.fchmod(t.fd, 0o666)


def mmap_shared_writable(t):
    return mmap.mmap(t.fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def mprotect_writable(t):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.mprotect(t.address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")


def do_write(t):
    return os.write(t.fd, b"x")


def do_pwrite(t):
    return os.pwrite(t.fd, b"x", offset_of(t))


def do_fallocate(t):
    os.posix_fallocate(t.fd, 0, os.fstat(t.fd).st_size + mmap.PAGESIZE)


def do_ftruncate(t):
    os.ftruncate(t.fd, mmap.PAGESIZE)


def add_seals(t):
    fcntl.fcntl(t.fd, fcntl.F_ADD_SEALS, SEAL_WRITE)


ROUTES = {"reopen-O_RDWR": (reopen_rdwr, "EACCES"), "fchmod": (do_fchmod, "EPERM"),
          "mmap-PROT_WRITE-MAP_SHARED": (mmap_shared_writable, "EACCES"), "mprotect": (mprotect_writable, "EACCES"),
          "write": (do_write, "EBADF"), "pwrite": (do_pwrite, "EBADF"), "fallocate": (do_fallocate, "EBADF"),
          "ftruncate": (do_ftruncate, "EINVAL"), "F_ADD_SEALS": (add_seals, "EPERM")}


@pytest.mark.parametrize("route", ROUTES)
def test_a_non_writer_in_pleds_group_cannot_write_the_table_by_any_route(served, route):
    attempt, expected = ROUTES[route]
    before = client.attach("t", socket=served, populate=False)  # root: not a writer either, a read-only fd
    data = bytes(before.buffer)
    said = as_other(served, attempt)
    assert said == f"refused {expected}", said
    after = client.attach("t", socket=served, populate=False)
    assert bytes(after.buffer) == data and os.fstat(after.fd).st_size == len(data)
    assert os.fstat(after.fd).st_mode & 0o777 == 0o440 and os.fstat(after.fd).st_uid == PLED
    before.close(), after.close()


def test_a_non_writer_is_told_not_writable_and_maps_read_only(served):
    def action():
        t = client.attach("t", socket=served)
        maps = memfd_maps()
        try:
            t.require_writer("register it writable")
        except client.NotWritable as err:
            return f"{err} | {[m.split()[1] for m in maps]}"
        return "not refused"
    said = as_uid(OTHER, action)
    assert "cannot register it writable: table t: uid" in said and f"uid {OTHER} is not one of its writers" in said
    assert said.endswith("| ['r--s']"), said


# -- the writer ----------------------------------------------------------------------------------------------------

def test_the_writer_gets_one_read_write_mapping_it_can_turn_read_only(served):
    def action():
        t = client.attach("t", socket=served)
        out = [t.writer, t.protected, fcntl.fcntl(t.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR,
               [m.split()[1] for m in memfd_maps()]]
        t.protect()
        t.protect()  # idempotent
        out += [t.protected, [m.split()[1] for m in memfd_maps()]]
        try:
            t.require_writer()
        except client.NotWritable as err:
            out.append("made read-only" in str(err))
        return repr(out)
    assert as_uid(WRITER, action) == repr([True, False, True, ["rw-s"], True, ["r--s"], True])


def test_a_write_through_the_protected_mapping_faults(served):
    def action():
        t = client.attach("t", socket=served)
        t.protect()
        t.buffer[offset_of(t)] = 1  # SIGSEGV: the mapping is read-only now
        return "written"
    assert as_uid(WRITER, action) == "killed by SIGSEGV"


def test_writer_and_non_writer_see_the_same_bytes_and_the_writers_change(served):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer, attached for the whole test: changes one byte, then waits
        code = 1
        try:
            os.close(r)
            become(WRITER, [PLED])
            t = client.attach("t", socket=served)
            at = offset_of(t)
            t.buffer[at] = (t.buffer[at] + 1) % 256
            os.write(w, bytes([t.buffer[at]]))
            time.sleep(30)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        written = os.read(r, 1)
        assert written, "the writer did not write"

        def read_it():
            t = client.attach("t", socket=served)
            return f"{t.buffer[offset_of(t)]} {len(t.buffer)}"
        value, size = as_uid(OTHER, read_it).split()
        assert int(value) == written[0], (value, written)
        mine = client.attach("t", socket=served, populate=False)
        assert (mine.buffer[offset_of(mine)], len(mine.buffer)) == (written[0], int(size))
        mine.close()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)


# -- the scheduled verify ------------------------------------------------------------------------------------------

def test_a_byte_the_writer_changed_is_found_within_the_period_shown_everywhere_and_repaired(open_dir, pleds, tmp_path):
    js = JournalSocket(Path(open_dir) / "j.sock")
    os.chmod(js.path, 0o666)
    log = Path(open_dir) / "pled.log"
    log.touch()
    st = log.stat()
    env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}", journal.ENV_SOCKET: js.path}
    period = 1.0
    sock = start_pled(open_dir, pleds, "v", env=env, log=log, wait=None, verify_interval=period)
    pled = pleds[-1]
    js.wait_for(journal.MESSAGE_IDS["ready"], timeout=60)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            become(WRITER, [PLED])
            t = client.attach("t", socket=sock)
            at = offset_of(t)
            t.buffer[at] = (t.buffer[at] + 1) % 256
            os.write(w, f"{at} {t.buffer[at]}".encode())
            time.sleep(60)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        at, value = map(int, os.read(r, 32).split())
        changed = time.monotonic()
        entry = js.wait_for(journal.MESSAGE_IDS["table_modified"], timeout=30)
        found = time.monotonic() - changed
        # within its period: one interval, the loop's one-second tick, and the verify itself (a few ms here)
        assert found < period + 1.0 + 5.0, found
        assert entry["PRIORITY"] == ["2"] and entry["PLED_TABLE"] == ["t"] and entry["PLED_GENERATION"] == ["1"]
        assert f"bytes [{at}, {at + 1})" in entry["MESSAGE"][0] and f"writers attached: pid {pid}" in \
            entry["MESSAGE"][0], entry["MESSAGE"]
        status = run_pled("status", "--socket", sock)
        assert status.returncode == 1, status.stdout
        assert re.search(rf"t: MODIFIED: bytes \[{at}, {at + 1}\) \(shard_1.safetensors\).*pid {pid}", status.stdout)
        prom = run_pled("status", "--socket", sock, "--format", "prometheus")
        assert 'pled_table_modified{table="t"} 1.0' in prom.stdout
        repair = run_pled("verify", "--repair", "--socket", sock)
        assert repair.returncode == 0 and "changed: t (generation 2)" in repair.stdout, repair.stdout + repair.stderr
        fresh = client.attach("t", socket=sock, populate=False)
        assert (fresh.generation, fresh.writer) == (2, False) and fresh.buffer[at] != value
        clean = run_pled("verify", "--socket", sock)
        assert clean.returncode == 0, clean.stdout
        status = run_pled("status", "--socket", sock)
        assert status.returncode == 0 and "MODIFIED" not in status.stdout, status.stdout
        prom = run_pled("status", "--socket", sock, "--format", "prometheus")
        assert 'pled_table_modified{table="t"} 0.0' in prom.stdout
        fresh.close()
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)
        js.close()
    assert pled.poll() is None


def test_an_unchanged_writable_table_is_verified_on_schedule_and_stays_healthy(open_dir, pleds):
    sock = start_pled(open_dir, pleds, "q", verify_interval=0.2)

    def verifies():
        t = next(t for t in client.call("io.pled.Status", socket=sock)["tables"] if t["table"] == "t")
        return t["verify"]["verifies"], t["modified"], t["gpu_access"]
    harness.wait_until(lambda: verifies()[0] >= 2, 30, "two scheduled verifies")
    assert verifies()[1:] == (False, "writable")
    assert run_pled("status", "--socket", sock).returncode == 0
