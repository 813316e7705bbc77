"""vLLM's side in a container, pled on the host: a client in its own user, mount, PID and network namespaces.

Which container: one made with unshare(2) by tests/nscontainer.py, not a container runtime.
Debian's podman would run here without pulling an image (`--rootfs`), but it is not
installed on this project's machines and adds nothing the kernel does not already show: a
runtime makes exactly these namespaces. The mapping is a rootless runtime's (container root =
host uid BASE, 65536 ids), the socket directory is bind-mounted read-only at /run/pled, and
the container keeps one supplementary group across the user namespace (podman's
`--group-add keep-groups`), standing in for pled's socket group.

What crosses the namespace boundary: SO_PEERCRED is translated into the namespaces of the
process that reads it. pled, on the host, sees the container's root as host uid BASE and its
PID 1 as a host pid, and logs and lists those; the container sees pled as uid 65534 (unmapped)
and pid 0 (not in its PID namespace).
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import run_pled, unused_gid
from pled import client

ALLOWED, REFUSED = 100_000, 200_000  # the host uids of two containers' root
ROWS = [0, 1, 999, 2500, 3999]
NSCONTAINER = Path(__file__).with_name("nscontainer.py")


class Container:
    """One run of nscontainer.py: its JSON lines, one at a time."""

    def __init__(self, uid_base: int, groups: list[int], socket_dir: str, table: str):
        self.proc = subprocess.Popen(
            [sys.executable, str(NSCONTAINER), "--uid-base", str(uid_base), "--groups", ",".join(map(str, groups)),
             "--socket-dir", socket_dir, "--table", table, "--rows", ",".join(map(str, ROWS))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.facts: dict = {}

    def until(self, key: str) -> dict:
        while key not in self.facts:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(timeout=30)
                raise AssertionError(f"the container ended ({self.proc.returncode}) before saying {key!r}: "
                                     f"{self.facts}\n{self.proc.stderr.read()[-3000:]}")
            self.facts.update(json.loads(line))
            if "error" in self.facts:
                if "unshare" in self.facts["error"] or "id maps" in self.facts["error"]:
                    self.finish()
                    pytest.skip(f"cannot make a container here: {self.facts['error']}")
                raise AssertionError(f"the container failed: {self.facts['error']}\n{self.proc.stderr.read()[-3000:]}")
        return self.facts[key]

    def finish(self) -> int:
        if self.proc.poll() is None:
            self.proc.stdin.write("done\n")
            self.proc.stdin.close()
        return self.proc.wait(timeout=30)


@pytest.fixture
def containers():
    made = []

    def make(*args) -> Container:
        c = Container(*args)
        made.append(c)
        return c

    yield make
    for c in made:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()


@pytest.mark.slow
@pytest.mark.root  # a user namespace with another uid's mapping (newuidmap's job elsewhere)
def test_a_client_in_a_container_attaches_through_a_read_only_socket_mount(sidecar, daemon, containers, tmp_path):
    group = unused_gid()
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    os.chown(run, -1, group)  # as pled.service's RuntimeDirectory: 0750, the socket's group
    pled = daemon({"t": sidecar("ples_int4", shards=2, rows=2000)}, socket=str(run / "pled.sock"),
                  allow_uids=[ALLOWED])
    os.chown(pled.socket, -1, group)  # the socket 0660 in that group (pled.service: Group=pled)

    # A container whose root is host uid 100000, in allow_uids.
    ok = containers(ALLOWED, [group], str(run), "t")
    inside = ok.until("container")
    assert inside["pid"] == 1 and inside["processes"] == [1]  # its own PID namespace, its own /proc
    assert inside["uid"] == 0 and inside["uid_map"] == f"0 {ALLOWED} 65536"  # root inside, 100000 outside
    assert inside["interfaces"] == ["lo"]  # its own network namespace: a Unix socket path needs no network
    assert inside["groups"] == [65534]  # the kept group, unmapped inside
    assert inside["socket_dir_write"] == "EROFS"  # /run/pled is mounted read-only, and connecting still works
    attached = ok.until("attached")
    host_pid = ok.until("host_pid")
    assert attached["residency"] == 1.0
    with client.attach("t", socket=pled.socket) as t:  # the same rows gathered on the host
        expected = hashlib.sha256(t.gather(torch.tensor(ROWS)).float().numpy().tobytes()).hexdigest()
    assert attached["gathered"] == expected
    # From inside, pled is nobody: its uid 0 is not mapped there, its pid not in that PID namespace.
    assert attached["daemon_seen_as"] == {"pid": 0, "uid": 65534, "gid": 65534}

    # pled sees and lists the container's process by its host pid and host uid.
    nspid = next(line for line in Path(f"/proc/{host_pid}/status").read_text().splitlines()
                 if line.startswith("NSpid:"))
    assert nspid.split()[1:] == [str(host_pid), "1"]
    st = run_pled("status", "--json", "--socket", pled.socket)
    assert st.returncode == 0, st.stdout + st.stderr
    listed = [c for c in json.loads(st.stdout)["clients"] if c["pid"] == host_pid]
    assert len(listed) == 1 and listed[0]["uid"] == ALLOWED and listed[0]["tables"] == ["t"], st.stdout
    text = run_pled("status", "--socket", pled.socket).stdout
    assert f"pid {host_pid:<8} uid {ALLOWED:<6} t" in text, text
    assert f"client attached: table t generation 1 to pid {host_pid} uid {ALLOWED}" in pled.log()
    assert ok.finish() == 0

    # A container whose root is host uid 200000: the same group gets it through the socket's permissions,
    # and pled itself refuses it, naming its host uid.
    no = containers(REFUSED, [group], str(run), "t")
    assert no.until("container")["uid_map"] == f"0 {REFUSED} 65536"
    refused = no.until("refused")
    assert f"refused uid {REFUSED}" in refused and "allow_uids" in refused
    assert no.finish() == 0
    log = pled.wait_for(f"uid {REFUSED}")
    assert "WARNING refused pid" in log and f"uid {REFUSED} (" in log
