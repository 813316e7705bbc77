"""pled.service under real systemd 252 as PID 1: opt-in (PLED_TEST_SYSTEMD=1), never in the default run.

systemd as PID 1 can damage a host if it reaches the host's mounts (it has wiped a machine's /tmp when
sysinit.target ran), so it runs here fenced in:
- private PID, mount, UTS, IPC, network and cgroup namespaces (unshare), mount propagation private;
- /proc/sys and /sys read-only inside (systemd 252 as PID 1 raises fs.file-max even in a container);
- its own tmpfs on /run, /tmp, /var, /mnt and /dev (with the usual nodes bound in); the test's directory at /mnt/t;
- its own name=systemd cgroup hierarchy, rooted (cgroup namespace) at a child cgroup made for the test;
- SYSTEMD_UNIT_PATH naming only the test's units, so no host unit (sysinit.target, tmpfiles) can load;
  every unit it starts has DefaultDependencies=no; container= is set so PID 1 skips host setup;
- no systemd-run; the ExecStartPre= that writes shmem_enabled is dropped from the test's copy.
Afterwards the test checks that a sentinel file in the host's /tmp, the host's sysctls, its THP settings and
its hostname are unchanged.
"""
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pled.generator import make_sidecar

pytestmark = pytest.mark.skipif(os.environ.get("PLED_TEST_SYSTEMD") != "1",
                                reason="opt-in: starts systemd as PID 1 in namespaces; set PLED_TEST_SYSTEMD=1")

SYSTEMD = "/lib/systemd/systemd"
CGROUP_V1 = Path("/sys/fs/cgroup/systemd")
UNITS = Path(__file__).parent.parent / "units"
WATCHED = [
    "/proc/sys/kernel/hostname", "/proc/sys/kernel/domainname", "/proc/sys/kernel/pid_max",
    "/proc/sys/kernel/core_pattern", "/proc/sys/kernel/sysrq", "/proc/sys/kernel/printk", "/proc/sys/kernel/panic",
    "/proc/sys/kernel/ctrl-alt-del", "/proc/sys/fs/nr_open", "/proc/sys/fs/file-max",
    "/proc/sys/fs/inotify/max_user_instances", "/proc/sys/fs/inotify/max_user_watches", "/proc/sys/fs/protected_regular",
    "/proc/sys/fs/protected_symlinks", "/proc/sys/fs/suid_dumpable", "/proc/sys/vm/overcommit_memory",
    "/proc/sys/vm/swappiness", "/proc/sys/vm/max_map_count", "/proc/sys/net/core/somaxconn",
    "/proc/sys/net/ipv4/ip_forward", "/sys/kernel/mm/transparent_hugepage/enabled",
    "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
]


def snapshot() -> dict[str, str]:
    out = {}
    for path in WATCHED:
        try:
            out[path] = Path(path).read_text()
        except OSError:
            pass
    return out


def write_test_units(units: Path, testdir: str) -> None:
    units.mkdir()
    text = (UNITS / "pled.service").read_text()
    pled = Path(sys.executable).parent / "pled"
    text = text.replace("/opt/pled/bin/pled serve", f"{pled} serve -c {testdir}/pled.toml")
    text = text.replace("/opt/pled/bin/pled reload", f"{pled} reload -c {testdir}/pled.toml")
    text = re.sub(r"^ExecStartPre=.*\n", "", text, flags=re.M)  # never touch the host's sysfs from the test
    text = re.sub(r"^Group=pled\n", "", text, flags=re.M)  # no such group on a test machine
    text = text.replace("[Unit]\n", "[Unit]\nDefaultDependencies=no\n", 1)
    text = text.replace("[Service]\n", f"[Service]\nStandardOutput=append:{testdir}/pled.log\n"
                                       f"StandardError=append:{testdir}/pled.log\nSlice=-.slice\n", 1)
    (units / "pled.service").write_text(text)
    (units / "pled-test.target").write_text("[Unit]\nDescription=pled test\nDefaultDependencies=no\nWants=pled.service\n")


BOOT = r"""
set -euo pipefail
echo $$ > "$CGROUP/cgroup.procs"
exec unshare --pid --fork --mount --uts --ipc --net --cgroup --propagation private --mount-proc bash -c '
  set -euo pipefail
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
        self.proc = subprocess.Popen(["bash", "-c", BOOT], env={**os.environ, "CGROUP": str(cgroup), "TESTDIR": str(testdir)},
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

    def systemctl(self, *args: str) -> str:
        r = subprocess.run(["nsenter", "-t", str(self.pid), "-m", "-p", "systemctl", *args],
                           capture_output=True, text=True, timeout=60)
        return r.stdout

    def show(self, *props: str) -> dict[str, str]:
        out = self.systemctl("show", "pled.service", *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_active(self, since_pid: str | None = None, timeout: float = 90) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        state = {}
        while time.monotonic() < deadline:
            state = self.show("ActiveState", "SubState", "StatusText", "NFileDescriptorStore", "MainPID")
            if state.get("ActiveState") == "active" and state.get("MainPID") not in (None, "0", since_pid):
                return state
            if state.get("ActiveState") == "failed":
                break
            time.sleep(0.2)
        raise AssertionError(f"pled.service never became active: {state}")

    def stop(self) -> None:
        try:
            os.kill(self.pid, 9)  # the namespace's init: every process in it goes with it
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.log.close()


def _remove_cgroups(root: Path) -> None:
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        d.rmdir()
    root.rmdir()


def test_pled_service_under_systemd_pid1(tmp_path):
    if os.geteuid() != 0 or not Path(SYSTEMD).exists() or not shutil.which("unshare") or not shutil.which("nsenter"):
        pytest.skip("needs root, systemd, unshare and nsenter")
    if not (CGROUP_V1 / "cgroup.procs").exists():
        pytest.skip("this recipe needs the cgroup v1 name=systemd hierarchy (a cgroup v2 host needs a delegated subtree)")
    sentinel = Path(f"/tmp/pled-sentinel-{uuid.uuid4().hex}")
    secret = uuid.uuid4().hex
    sentinel.write_text(secret)
    before = snapshot()
    cgroup = CGROUP_V1 / f"pled-pid1-test-{os.getpid()}"
    cgroup.mkdir()
    testdir = tmp_path / "t"
    testdir.mkdir()
    testdir.chmod(0o755)
    make_sidecar(str(testdir / "sc"), "ples_int4", shards=4, rows=20_000)
    (testdir / "pled.toml").write_text('socket = "/run/pled/pled.sock"\nheadroom_margin = 0\n'
                                       '[[table]]\nname = "ples_int4"\npath = "/mnt/t/sc"\n')
    write_test_units(testdir / "units", "/mnt/t")
    pid1 = None
    try:
        pid1 = Pid1(testdir, cgroup)
        first = pid1.wait_active()
        assert first["SubState"] == "running"
        assert first["StatusText"].startswith("serving 1 table(s)") and "100% resident" in first["StatusText"]
        assert first["NFileDescriptorStore"] == "1"
        pid1.systemctl("restart", "pled.service")
        second = pid1.wait_active(since_pid=first["MainPID"])
        assert second["MainPID"] != first["MainPID"]
        assert second["NFileDescriptorStore"] == "1"  # adopted, not stored twice
        assert second["StatusText"].startswith("serving 1 table(s)")
        log = (testdir / "pled.log").read_text()
        assert log.count("table ples_int4 adopted from systemd's fd store: generation 1") == 1
        assert "(1 adopted, 0.0 KiB copied)" in log
        assert log.count("shard 4/4") == 1  # staged once, by the first start only
        pid1.systemctl("reload", "pled.service")  # ExecReload=pled reload: nothing changed, nothing restaged
        third = pid1.show("ActiveState", "MainPID", "NFileDescriptorStore")
        assert third == {"ActiveState": "active", "MainPID": second["MainPID"], "NFileDescriptorStore": "1"}
        assert "reload done" in (testdir / "pled.log").read_text()
    finally:
        if pid1 is not None:
            pid1.stop()
        _remove_cgroups(cgroup)
        assert sentinel.read_text() == secret, "the host's /tmp was touched"
        sentinel.unlink()
        assert snapshot() == before, "a host setting changed"
