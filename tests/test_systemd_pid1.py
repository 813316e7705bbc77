"""pled.service under real systemd 252 as PID 1: opt-in (PLED_TEST_SYSTEMD=1), never in the default run.

systemd as PID 1 can damage a host if it reaches the host's mounts (it has wiped a machine's /tmp when
sysinit.target ran), so it runs here fenced in:
- private PID, mount, UTS, IPC, network and cgroup namespaces (unshare), mount propagation private;
- /proc/sys and /sys read-only inside (systemd 252 as PID 1 raises fs.file-max even in a container);
- its own tmpfs on /run, /tmp, /var, /mnt and /dev (with the usual nodes bound in); the test's directory at /mnt/t;
- its own name=systemd cgroup hierarchy, rooted (cgroup namespace) at a child cgroup made for the test;
- SYSTEMD_UNIT_PATH naming only the test's units, so no host unit (sysinit.target, tmpfiles) can load;
  every unit it starts has DefaultDependencies=no; container= is set so PID 1 skips host setup;
- its own copy of /etc, so that systemd-sysusers creates users pled and vllm-test there and not on the host;
- the host directories the services need (this checkout, the Python environment) bound back when a mount above
  would hide them, or a directory on the way is closed to other users (a Python under /root): at their own paths,
  or under /mnt/keep for those a service's own PrivateTmp=/PrivateDevices= would hide (a checkout under /tmp);
  the services run as users pled and vllm-test, as installed;
- no systemd-run; the ExecStartPre= that writes shmem_enabled is replaced in the test's copy by one that only
  records the uid it ran as (the "+" prefix is what is tested; the host's sysfs is never touched);
- systemd-journald from the host's units, started by that PID 1 with its native and stream sockets only (no /dev/log,
  no audit socket), its journal in the namespace's own /run; pled logs to it as under any systemd, and the test reads
  pled's log with journalctl inside.
Afterwards the test checks that a sentinel file in the host's /tmp, the host's sysctls, its THP settings, its
hostname and its user database are unchanged.

The units are the shipped ones, installed as the README says: units/pled.sysusers.conf (user and group pled),
pled.service with its whole sandbox, and the vLLM drop-in on a stand-in vllm.service that runs as an ordinary user,
attaches and holds a table. `systemctl restart pled` and `systemctl stop pled` must leave the stand-in running with
its mapping readable, and the restarted pled must adopt the stored table without copying a byte.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from harness import host_settings, write_config
from pled.daemon.health.journal import MESSAGE_IDS
from pled.generator import make_sidecar

pytestmark = [pytest.mark.skipif(os.environ.get("PLED_TEST_SYSTEMD") != "1",
                                 reason="opt-in: starts systemd as PID 1 in namespaces; set PLED_TEST_SYSTEMD=1"),
              pytest.mark.daemon, pytest.mark.root, pytest.mark.slow]

SYSTEMD = "/lib/systemd/systemd"
HOST_UNITS = Path("/lib/systemd/system")
JOURNALD_SOCKETS = "Sockets=systemd-journald.socket systemd-journald-dev-log.socket systemd-journald-audit.socket\n"
CGROUP_V1 = Path("/sys/fs/cgroup/systemd")
CHECKOUT = Path(__file__).absolute().parent.parent
UNITS = CHECKOUT / "units"
MASKED = ("/tmp", "/run", "/var", "/mnt", "/dev")  # the namespace mounts its own over these
RELOCATED = ("/tmp", "/var/tmp", "/dev")  # and a service's own mounts (PrivateTmp=, PrivateDevices=) hide these


def under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def host_paths() -> tuple[list[str], list[str]]:
    """(kept, covered): the directories the services need that the namespace would hide, and the directories on
    their way that other users may not enter (covered inside by a 0755 tmpfs, the kept ones bound back below)."""
    need = set()
    for p in (CHECKOUT, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent):
        need |= {str(p), os.path.realpath(p)}
    covered = set()
    for p in need:
        parts = Path(p).parts
        for i in range(2, len(parts)):
            d = str(Path(*parts[:i]))
            if not any(under(d, m) for m in MASKED) and not os.stat(d).st_mode & 0o001:
                covered.add(d)
                break
    hidden = [p for p in need if any(under(p, m) for m in (*MASKED, *covered))]
    kept = sorted(p for p in hidden if not any(q != p and under(p, q) for q in hidden))
    return kept, sorted(covered)


def in_namespace(path) -> str:
    """Where a host path the services need is found inside: at its own path, or under /mnt/keep if a service's
    own mounts would hide it there."""
    path = str(path)
    for k in host_paths()[0]:
        if under(path, k) and any(under(k, r) for r in RELOCATED):
            return "/mnt/keep" + path
    return path


STANDIN = """
import hashlib, os, time
from pled import client
t = client.attach("ples_int4")  # PLED_SOCKET comes from the vLLM drop-in
print("attached", os.environ["PLED_SOCKET"], hashlib.sha256(t.buffer).hexdigest(), flush=True)
n = 0
while True:
    time.sleep(0.2)
    n += 1
    print("check", n, hashlib.sha256(t.buffer).hexdigest(), flush=True)
"""


def write_test_units(units: Path, testdir: str, private_users: bool = False) -> None:
    """The shipped units as the README installs them; only what a test must change is changed."""
    units.mkdir()
    if private_users:  # the drop-in README offers where group pled is the only way in
        (units / "pled.service.d").mkdir()
        (units / "pled.service.d" / "private-users.conf").write_text("[Service]\nPrivateUsers=yes\n")
    run_from_checkout = f"Environment=PYTHONPATH={in_namespace(CHECKOUT)}\n"
    text = (UNITS / "pled.service").read_text()
    python = in_namespace(sys.executable)
    assert "/usr/lib/pled/bin/pled serve" in text and re.search(r"^ExecStartPre=-\+", text, flags=re.M)
    text = text.replace("/usr/lib/pled/bin/pled serve", f"{python} -m pled serve -c {testdir}/pled.toml")
    text = text.replace("/usr/lib/pled/bin/pled reload", f"{python} -m pled reload -c {testdir}/pled.toml")
    # Never touch the host's sysfs from the test: the privileged line only records who it ran as.
    text = re.sub(r"^ExecStartPre=-\+.*\n", "ExecStartPre=-+/bin/sh -c 'id -u > /run/pled-prestart-uid'\n", text,
                  flags=re.M)
    text = text.replace("[Unit]\n", "[Unit]\nDefaultDependencies=no\n", 1)
    # Its output goes to the journal, as the shipped unit's does (JOURNAL_STREAM: pled writes its native entries).
    text = text.replace("[Service]\n", f"[Service]\nSlice=-.slice\n{run_from_checkout}", 1)
    (units / "pled.service").write_text(text)
    # systemd-journald as the host runs it, with only its native and stream sockets.
    shutil.copy(HOST_UNITS / "systemd-journald.socket", units / "systemd-journald.socket")
    journald = (HOST_UNITS / "systemd-journald.service").read_text()
    assert JOURNALD_SOCKETS in journald
    journald = journald.replace(JOURNALD_SOCKETS, "Sockets=systemd-journald.socket\n")
    (units / "systemd-journald.service").write_text(re.sub(r"^After=.*\n", "After=systemd-journald.socket\n", journald,
                                                           flags=re.M))
    (units / "vllm.service").write_text(
        "[Unit]\nDescription=stand-in vLLM\nDefaultDependencies=no\n"
        f"[Service]\nUser=vllm-test\nExecStart={python} {testdir}/standin.py\n{run_from_checkout}"
        f"StandardOutput=append:{testdir}/vllm.log\nStandardError=append:{testdir}/vllm.log\nSlice=-.slice\n")
    shutil.copytree(UNITS / "vllm.service.d", units / "vllm.service.d")  # the shipped drop-in, unchanged
    # Only vLLM is wanted: its drop-in must pull pled in.
    (units / "pled-test.target").write_text("[Unit]\nDescription=pled test\nDefaultDependencies=no\n"
                                            "Wants=systemd-journald.socket systemd-journald.service vllm.service\n")
    sysusers = units.parent / "sysusers"
    sysusers.mkdir()
    shutil.copy(UNITS / "pled.sysusers.conf", sysusers / "pled.conf")
    (sysusers / "vllm-test.conf").write_text('u vllm-test - "stand-in vLLM" - -\n')
    (units.parent / "standin.py").write_text(STANDIN)


BOOT = r"""
set -euo pipefail
echo $$ > "$CGROUP/cgroup.procs"
exec unshare --pid --fork --mount --uts --ipc --net --cgroup --propagation private --mount-proc bash -c '
  set -euo pipefail
  # Host directories the services need that the mounts below hide: held open here, bound back later ("host|inside").
  keep_fds=(); keep_paths=()
  while IFS="|" read -r p at; do
    [ -n "$p" ] || continue
    exec {fd}<"$p"
    keep_fds+=("$fd"); keep_paths+=("$at")
  done <<< "$KEEP"
  # Nothing in here may change a kernel setting: systemd 252 as PID 1 raises fs.file-max even in a container.
  mount --bind /proc/sys /proc/sys
  mount -o remount,bind,ro /proc/sys
  mount --bind /sys /sys
  mount -o remount,bind,ro /sys
  mount -t tmpfs -o mode=755 pled-test /mnt
  mkdir /mnt/t
  mount --bind "$TESTDIR" /mnt/t
  for d in /run /tmp /var; do mount -t tmpfs -o mode=755 pled-test "$d"; done
  chmod 1777 /tmp
  mkdir -m 1777 /var/tmp
  mkdir /var/lib /var/log
  test -f /mnt/t/units/pled.service
  # A private /dev with only the usual nodes: the host devtmpfs is shared, this one is not.
  mkdir /run/hostdev
  mount --bind /dev /run/hostdev
  mount -t tmpfs -o mode=755 pled-test /dev
  for n in null zero full random urandom tty ptmx; do touch /dev/$n; mount --bind /run/hostdev/$n /dev/$n; done
  umount -l /run/hostdev
  rmdir /run/hostdev
  mkdir /dev/pts /dev/shm /dev/mqueue
  mount -t tmpfs -o mode=1777 pled-test /dev/shm
  ln -s /proc/self/fd /dev/fd
  ln -s /proc/self/fd/0 /dev/stdin
  ln -s /proc/self/fd/1 /dev/stdout
  ln -s /proc/self/fd/2 /dev/stderr
  # Its own /etc: the users created below exist only in here.
  mkdir /mnt/etc
  cp -a /etc/. /mnt/etc/
  mount --bind /mnt/etc /etc
  for d in $COVER; do mount -t tmpfs -o mode=755 pled-test "$d"; done
  for i in "${!keep_paths[@]}"; do
    mkdir -p "${keep_paths[$i]}"
    mount --no-canonicalize --bind "/proc/self/fd/${keep_fds[$i]}" "${keep_paths[$i]}"
    eval "exec ${keep_fds[$i]}<&-"
  done
  # Installed as the README says: the sysusers file creates user and group pled; the sidecar made readable to it.
  systemd-sysusers /mnt/t/sysusers/pled.conf /mnt/t/sysusers/vllm-test.conf
  chgrp -R pled /mnt/t/sc
  chmod -R g+rX /mnt/t/sc
  mount -t tmpfs -o mode=755 pled-test /sys/fs/cgroup
  mkdir /sys/fs/cgroup/systemd
  mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd
  exec env -i container=pled-test SYSTEMD_UNIT_PATH=/mnt/t/units PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    /lib/systemd/systemd --unit=pled-test.target --log-target=console --show-status=no
'
"""


class Pid1:
    def __init__(self, testdir: Path, cgroup: Path):
        self.log = open(testdir / "systemd.log", "w")
        kept, covered = host_paths()
        env = {**os.environ, "CGROUP": str(cgroup), "TESTDIR": str(testdir), "COVER": " ".join(covered),
               "KEEP": "\n".join(f"{p}|{in_namespace(p)}" for p in kept)}
        self.proc = subprocess.Popen(["bash", "-c", BOOT], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self._init_pid()

    def _init_pid(self) -> int:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
                for child in children:
                    if Path(f"/proc/{child}/exe").resolve() == Path(SYSTEMD).resolve():
                        return int(child)
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise AssertionError(f"the namespace did not start: {Path(self.log.name).read_text()}")
            time.sleep(0.1)
        raise AssertionError("systemd did not start in the namespace")

    def inside(self, *argv: str) -> str:
        r = subprocess.run(["nsenter", "-t", str(self.pid), "-m", "-p", *argv], capture_output=True, text=True,
                           timeout=60)
        return r.stdout

    def systemctl(self, *args: str) -> str:
        return self.inside("systemctl", *args)

    def journalctl(self, *args: str) -> str:
        return self.inside("journalctl", "--no-pager", *args)

    def show(self, *props: str, unit: str = "pled.service") -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_active(self, since_pid: str | None = None, timeout: float = 90,
                    unit: str = "pled.service") -> dict[str, str]:
        deadline = time.monotonic() + timeout
        state = {}
        while time.monotonic() < deadline:
            state = self.show("ActiveState", "SubState", "StatusText", "NFileDescriptorStore", "MainPID", unit=unit)
            if state.get("ActiveState") == "active" and state.get("MainPID") not in (None, "0", since_pid):
                return state
            if state.get("ActiveState") == "failed":
                break
            time.sleep(0.2)
        raise AssertionError(f"{unit} never became active: {state}\n{self.systemctl('status', unit)}")

    def stop(self) -> None:
        try:
            os.kill(self.pid, 9)  # the namespace's init: every process in it goes with it
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.log.close()


def wait_line(path: Path, prefix: str, after: int = 0, timeout: float = 60) -> str:
    """The first line starting with ``prefix`` among the lines after the first ``after``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        found = [line for line in lines[after:] if line.startswith(prefix)]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no line {prefix!r} in {path}: {path.read_text() if path.exists() else 'missing'}")


def next_check(path: Path) -> str:
    """The stand-in's next digest of its mapping, read after this call."""
    return wait_line(path, "check ", after=len(path.read_text().splitlines())).split()[2]


def pled_log(pid1: Pid1, until: str = "ready:", count: int = 1, timeout: float = 30) -> str:
    """pled's log as the namespace's journald holds it (`journalctl -u pled -o cat`), once ``until`` is in it
    ``count`` times: journald takes each entry in its own time."""
    deadline = time.monotonic() + timeout
    while True:
        log = pid1.journalctl("-u", "pled.service", "-o", "cat")
        if log.count(until) >= count:
            return log
        if time.monotonic() > deadline:
            raise AssertionError(f"{until!r} (x{count}) not in pled's journal:\n{log[-3000:]}")
        time.sleep(0.2)


def journal_entries(pid1: Pid1, *matches: str) -> list[dict]:
    """`journalctl -o json` with ``matches`` inside: one dict per entry (a field that repeats: a list)."""
    return [json.loads(line) for line in pid1.journalctl(*matches, "-o", "json").splitlines()]


def proc_status(pid1: Pid1, pid: str) -> dict[str, str]:
    lines = pid1.inside("cat", f"/proc/{pid}/status").splitlines()
    return dict((k, v.strip()) for k, _, v in (line.partition(":") for line in lines))


def _remove_cgroups(root: Path) -> None:
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        d.rmdir()
    root.rmdir()


class Fence:
    """What one PID 1 test runs in: root, systemd, unshare and nsenter (else a skip), a cgroup of its own, its
    directory; ``start()`` boots systemd there. Afterwards systemd is ended, the cgroups removed, and the host's
    /tmp (a sentinel file) and settings (``snapshot``) are checked unchanged."""

    def __init__(self, tmp_path: Path, name: str):
        if (os.geteuid() != 0 or not Path(SYSTEMD).exists() or not shutil.which("unshare")
                or not shutil.which("nsenter")):
            pytest.skip("needs root, systemd, unshare and nsenter")
        if not (CGROUP_V1 / "cgroup.procs").exists():
            pytest.skip("this recipe needs the cgroup v1 name=systemd hierarchy (a cgroup v2 host needs a delegated "
                        "subtree)")
        self.sentinel, self.secret = Path(f"/tmp/pled-sentinel-{uuid.uuid4().hex}"), uuid.uuid4().hex
        self.sentinel.write_text(self.secret)
        self.before = host_settings()
        self.cgroup = CGROUP_V1 / f"pled-pid1-{name}-{os.getpid()}"
        self.cgroup.mkdir()
        self.testdir = tmp_path / "t"
        self.testdir.mkdir()
        self.testdir.chmod(0o755)
        self.pid1: Pid1 | None = None

    def start(self) -> "Pid1":
        self.pid1 = Pid1(self.testdir, self.cgroup)
        return self.pid1

    def close(self) -> None:
        if self.pid1 is not None:
            self.pid1.stop()
        _remove_cgroups(self.cgroup)
        assert self.sentinel.read_text() == self.secret, "the host's /tmp was touched"
        self.sentinel.unlink()
        assert host_settings() == self.before, "a host setting changed"


@pytest.fixture
def fence(tmp_path, request):
    f = Fence(tmp_path, request.node.name.split("[")[0].removeprefix("test_")[:24])
    yield f
    f.close()


@pytest.mark.parametrize("private_users", [False, True], ids=["shipped", "private-users"])
def test_pled_service_under_systemd_pid1(fence, private_users):
    testdir = fence.testdir
    make_sidecar(str(testdir / "sc"), "ples_int4", shards=4, rows=20_000)
    for f in (testdir / "sc").iterdir():
        f.chmod(0o640)
    (testdir / "sc").chmod(0o750)  # not world-readable: user pled reads it through group pled, as the README says
    write_config(testdir / "pled.toml", {"ples_int4": "/mnt/t/sc"}, socket="/run/pled/pled.sock", headroom_margin=0)
    write_test_units(testdir / "units", "/mnt/t", private_users)
    pid1 = fence.start()
    vllm = pid1.wait_active(unit="vllm.service")
    first = pid1.wait_active()  # pulled in by the drop-in's Wants=
    assert first["SubState"] == "running"
    assert first["StatusText"].startswith("serving 1 table(s)") and "100% resident" in first["StatusText"]
    assert first["NFileDescriptorStore"] == "1"
    # After=: vLLM started only once pled was ready (Type=notify).
    pled_ready = int(pid1.show("ActiveEnterTimestampMonotonic")["ActiveEnterTimestampMonotonic"])
    vllm_started = int(pid1.show("ExecMainStartTimestampMonotonic",
                                 unit="vllm.service")["ExecMainStartTimestampMonotonic"])
    assert 0 < pled_ready <= vllm_started
    attached = wait_line(testdir / "vllm.log", "attached ")
    assert attached.split()[1] == "/run/pled/pled.sock"
    digest = attached.split()[2]

    # The sandbox is in force in the running process, and pled still serves.
    ids = {f[0]: f[2]
           for f in (line.split(":") for line in pid1.inside("getent", "passwd", "pled", "vllm-test").splitlines())}
    status = proc_status(pid1, first["MainPID"])
    assert status["Uid"].split()[:2] == [ids["pled"]] * 2 and status["Umask"] == "0077"
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2" and int(status["CapBnd"], 16) == 0
    assert pid1.inside("cat", "/run/pled-prestart-uid").strip() == "0"  # ExecStartPre=+ kept its privilege
    sock = pid1.inside("stat", "-c", "%A %U %G", "/run/pled/pled.sock", "/run/pled").split("\n")
    assert sock[:2] == ["srw-rw---- pled pled", "drwxr-x--- pled pled"]
    # ProtectProc=invisible: pled cannot see vLLM's process; the kernel's credentials still admit it. In a
    # user namespace of its own (PrivateUsers=yes) vLLM's uid shows as 65534, and group pled still admits it.
    client_uid = str(65534 if private_users else ids["vllm-test"])
    log = pled_log(pid1, f"uid {client_uid} (?)")
    assert "refused" not in log
    # pled's native entries, as journald keeps them: `journalctl -u pled PLED_TABLE=ples_int4` tells the table's story.
    entries = journal_entries(pid1, "-u", "pled", "PLED_TABLE=ples_int4")
    by_id = {e["MESSAGE_ID"]: e for e in entries if "MESSAGE_ID" in e}
    ready, attached = by_id[MESSAGE_IDS["ready"]], by_id[MESSAGE_IDS["client_attached"]]
    assert ready["MESSAGE"].startswith("ready: 1 table(s)") and ready["PRIORITY"] == "6", ready
    assert (ready["_SYSTEMD_UNIT"], ready["SYSLOG_IDENTIFIER"], ready["_PID"]) == ("pled.service", "pled",
                                                                                first["MainPID"]), ready
    assert {k: attached.get(k) for k in ("PLED_TABLE", "PLED_GENERATION", "PLED_CLIENT_PID", "PLED_CLIENT_UID")} == {
        "PLED_TABLE": "ples_int4", "PLED_GENERATION": "1", "PLED_CLIENT_PID": vllm["MainPID"],
        "PLED_CLIENT_UID": client_uid}, attached
    assert sum(e["MESSAGE"].startswith("table ples_int4: shard ") for e in entries) == 4  # its staging, shard by shard
    # NUMA placement under the unit's system-call filter (mbind let through): the policy pled gave the region is
    # the memfd's own, so the client's mapping shows it (one node with memory here: interleave over node 0).
    assert "NUMA not placed" not in log, log
    numa_maps = pid1.inside("cat", f"/proc/{vllm['MainPID']}/numa_maps")
    region = [line for line in numa_maps.splitlines() if "memfd:pled:ples_int4" in line]
    assert region and all(line.split()[1] == "interleave:0" for line in region), numa_maps
    uid_map = pid1.inside("cat", f"/proc/{first['MainPID']}/uid_map").split()
    assert (uid_map == ["0", "0", "1", ids["pled"], ids["pled"], "1"]) if private_users else uid_map[2] == "4294967295"

    pid1.systemctl("restart", "pled.service")
    second = pid1.wait_active(since_pid=first["MainPID"])
    assert second["MainPID"] != first["MainPID"]
    assert second["NFileDescriptorStore"] == "1"  # adopted, not stored twice
    assert second["StatusText"].startswith("serving 1 table(s)")
    log = pled_log(pid1, "ready:", count=2)
    assert log.count("table ples_int4 adopted from systemd's fd store: generation 1") == 1
    assert "(1 adopted, 0.0 KiB copied)" in log
    assert log.count("shard 4/4") == 1  # staged once, by the first start only
    # Wants=, not Requires=: vLLM was not restarted, and its mapping still reads the same bytes.
    assert pid1.show("ActiveState", "MainPID", unit="vllm.service") == {"ActiveState": "active",
                                                                       "MainPID": vllm["MainPID"]}
    assert next_check(testdir / "vllm.log") == digest

    pid1.systemctl("reload", "pled.service")  # ExecReload=pled reload: nothing changed, nothing restaged
    third = pid1.show("ActiveState", "MainPID", "NFileDescriptorStore")
    assert third == {"ActiveState": "active", "MainPID": second["MainPID"], "NFileDescriptorStore": "1"}
    pled_log(pid1, "reload done")
    (done,) = journal_entries(pid1, "-u", "pled", f"MESSAGE_ID={MESSAGE_IDS['reload_done']}")
    assert done["_PID"] == second["MainPID"] and done["MESSAGE"].endswith(": unchanged ples_int4"), done
    assert "PLED_TABLE" not in done  # a reload that changed no table names none

    pid1.systemctl("stop", "pled.service")
    assert pid1.show("ActiveState")["ActiveState"] == "inactive"
    assert pid1.show("ActiveState", "MainPID", unit="vllm.service") == {"ActiveState": "active",
                                                                       "MainPID": vllm["MainPID"]}
    assert next_check(testdir / "vllm.log") == digest


def test_a_small_fd_store_under_systemd_pid1(fence):
    """FileDescriptorStoreMax=1 and two tables. systemd 252 passes no $FDSTORE: with fdstore_max left at 2 pled
    sends both, and systemd keeps one and closes the other (what a full store does); the restart adopts one and
    copies the other again. With fdstore_max = 1, as the config says to set it, pled names the table left out."""
    testdir = fence.testdir
    sc = testdir / "sc"
    sc.mkdir()
    for name in ("ples_int4", "t2"):
        make_sidecar(str(sc / name), "ples_int4", shards=2, rows=2_000)

    def config(fdstore_max: int) -> None:
        write_config(testdir / "pled.toml", {"ples_int4": "/mnt/t/sc/ples_int4", "t2": "/mnt/t/sc/t2"},
                     socket="/run/pled/pled.sock", headroom_margin=0, fdstore_max=fdstore_max)

    config(2)
    write_test_units(testdir / "units", "/mnt/t")
    (testdir / "units" / "pled.service.d").mkdir()
    (testdir / "units" / "pled.service.d" / "store.conf").write_text("[Service]\nFileDescriptorStoreMax=1\n")
    pid1 = fence.start()
    first = pid1.wait_active()
    log = pled_log(pid1)
    assert "up to 2 table(s) (fdstore_max in the config; systemd before 254 does not pass FDSTORE)" in log
    assert log.count("handed to systemd's fd store") == 2  # pled believed the config
    assert first["NFileDescriptorStore"] == "1"  # systemd kept one and closed the other

    pid1.systemctl("restart", "pled.service")
    second = pid1.wait_active(since_pid=first["MainPID"])
    log = pled_log(pid1, count=2)
    assert log.count("adopted from systemd's fd store") == 1 and log.count("shard 2/2") == 3  # one copied again
    assert second["NFileDescriptorStore"] == "1"

    config(1)  # as the unit says
    pid1.systemctl("restart", "pled.service")
    third = pid1.wait_active(since_pid=second["MainPID"])
    log = pled_log(pid1, count=3)
    assert "up to 1 table(s) (fdstore_max in the config" in log
    assert re.search(r"2 table\(s\) but systemd's fd store holds 1 .*: (ples_int4|t2) will not be stored", log), \
        log[-3000:]
    assert third["NFileDescriptorStore"] == "1"
