"""sd_notify from the standard library: UTF-8 text, abstract socket addresses, fds on the same socket,
and failures that are logged once and never stop pled. The notify socket is bound by the test, as
systemd binds its own (no systemd runs here)."""
import logging
import os
import uuid

import pytest

from harness import Daemon, NotifySocket, write_config
from pled.daemon.systemd import notify
from pled.shared import region


@pytest.mark.daemon
def test_a_table_path_outside_latin1_stages_and_status_carries_it(sidecar, tmp_path, notify_socket):
    d = tmp_path / "模型" / "ples_int4"
    d.parent.mkdir()
    sidecar("ples_int4", shards=4, rows=40_000).rename(d)  # 16 MB, staged at 8 MB/s: STATUS= shows progress
    cfg = write_config(tmp_path / "pled.toml", {"t": d}, headroom_margin=0, staging_bandwidth="8MB/s")
    proc = Daemon(cfg, env={"NOTIFY_SOCKET": notify_socket.path}, log=tmp_path / "pled.log")
    try:
        notify_socket.wait_for("READY=1")
    finally:
        assert proc.stop() == 0
    # NotifySocket decodes each datagram as UTF-8 (strictly): the path arrives as written.
    staging = [line for line in notify_socket.lines() if line.startswith("STATUS=staging t from ")]
    assert staging and all(line.startswith(f"STATUS=staging t from {d}: shard ") for line in staging), staging
    assert "模型" in staging[0]
    assert "Failed to send" not in (tmp_path / "pled.log").read_text()


@pytest.mark.daemon
def test_an_abstract_notify_socket(sidecar, tmp_path):
    name = f"pled-test-{uuid.uuid4().hex}"
    n = NotifySocket("\0" + name)  # what NOTIFY_SOCKET=@name means
    cfg = write_config(tmp_path / "pled.toml", {"t": sidecar(shards=2, rows=100)}, headroom_margin=0)
    proc = Daemon(cfg, env={"NOTIFY_SOCKET": "@" + name})
    try:
        n.wait_for("READY=1")
    finally:
        proc.stop()
        n.wait_for("STOPPING=1")
    # FDSTORE=1 went over the same socket with its fd: the sealed region.
    (fd_name, fd), = n.stored()
    assert fd_name == "pled.1.t" and region.is_sealed(fd) and region.read_manifest(fd).table == "t"
    n.close()


def test_failures_are_logged_once_and_never_raised(caplog, tmp_path):
    n = notify.Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    assert n.enabled
    r, w = os.pipe()
    with caplog.at_level(logging.INFO, logger="pled.daemon.systemd.notify"):
        assert not n.send("STATUS=one")
        assert not n.send("STATUS=two")
        assert not n.store_fd(r, "pled.1.t")
        assert not n.send("FDSTORE=1", fds=(w,) * (notify.SCM_MAX_FD + 1))  # too many fds: refused, not raised
    warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "nobody-listens.sock" in warnings[0].getMessage()
    # Once the socket is there, messages go through and the recovery is noted.
    listener = NotifySocket(tmp_path / "nobody-listens.sock")
    with caplog.at_level(logging.INFO, logger="pled.daemon.systemd.notify"):
        assert n.send("STATUS=three")
        listener.wait_for("STATUS=three")
    assert "reachable again" in caplog.text
    listener.close()
    n.close()
    os.close(r)
    os.close(w)


def test_notify_socket_addresses():
    assert notify.socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify.socket_address("@abstract/name") == "\0abstract/name"
    n = notify.Notifier({"NOTIFY_SOCKET": "vsock:2:1234"})  # not an AF_UNIX address: no notifications, no crash
    assert not n.enabled and not n.send("READY=1")
