"""Issue 19, finding 4: pled respects the size of systemd's fd store.

systemd closes, silently, any fd sent to a full store; the table behind it is copied again on the next
start. pled counts what it stores against $FDSTORE (systemd 254 and later) or, where systemd does not
pass it (252 here, Debian 12's), the config's fdstore_max; it names the tables that do not fit; and a
reload frees the old generation's entry before it stores the new one. tests/test_systemd_pid1.py shows
what systemd itself does with a small FileDescriptorStoreMax=.
"""
import os
import signal
import time

import pytest

from harness import Daemon, write_config

pytestmark = pytest.mark.daemon


def stored_and_removed(notify_socket) -> list[tuple[str, str]]:
    """('store' | 'remove', FDNAME) in the order pled sent them."""
    out = []
    for _, fields, _ in notify_socket.messages:
        name = next((f[len("FDNAME="):] for f in fields if f.startswith("FDNAME=")), None)
        if "FDSTORE=1" in fields:
            out.append(("store", name))
        elif "FDSTOREREMOVE=1" in fields:
            out.append(("remove", name))
    return out


def three_tables(sidecar, tmp_path, **keys):
    tables = {f"t{i}": sidecar("ples_int4", shards=1 + i, rows=64) for i in range(3)}
    return tables, write_config(tmp_path / "pled.toml", tables, headroom_margin=0, **keys)


def serve_until_ready(cfg, notify_socket, log, **env) -> str:
    """pled serve under a notify socket (and ``env``) until READY=1, then stopped cleanly: its log."""
    proc = Daemon(cfg, env={"NOTIFY_SOCKET": notify_socket.path, **env}, log=log)
    try:
        notify_socket.wait_for("READY=1")
    finally:
        assert proc.stop() == 0
    return log.read_text()


def test_fdstore_from_systemd_is_the_limit(sidecar, tmp_path, notify_socket):
    _, cfg = three_tables(sidecar, tmp_path)
    text = serve_until_ready(cfg, notify_socket, tmp_path / "pled.log", FDSTORE="2")
    assert stored_and_removed(notify_socket) == [("store", "pled.1.t0"), ("store", "pled.1.t1")]
    assert "up to 2 table(s) (FDSTORE from systemd)" in text
    assert "3 table(s) but systemd's fd store holds 2 (FDSTORE from systemd): t2 will not be stored" in text
    assert "table t2 generation 1 (" in text and "not handed to systemd's fd store: it holds 2 of 2" in text


def test_without_fdstore_the_config_says_and_the_log_says_which_it_assumed(sidecar, tmp_path, notify_socket):
    _, cfg = three_tables(sidecar, tmp_path, fdstore_max=1)
    text = serve_until_ready(cfg, notify_socket, tmp_path / "pled.log")
    assert stored_and_removed(notify_socket) == [("store", "pled.1.t0")]
    assert "up to 1 table(s) (fdstore_max in the config; systemd before 254 does not pass FDSTORE)" in text
    assert "t1, t2 will not be stored" in text


def test_a_reload_frees_the_old_generations_entry_before_storing_the_new_one(sidecar, tmp_path, notify_socket):
    tables, cfg = three_tables(sidecar, tmp_path)
    log = tmp_path / "pled.log"
    proc = Daemon(cfg, env={"NOTIFY_SOCKET": notify_socket.path, "FDSTORE": "3"}, log=log)
    try:
        notify_socket.wait_for("READY=1")
        shard = next(tables["t1"].glob("*.safetensors"))
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "reload done" not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
    finally:
        assert proc.stop() == 0
    events = stored_and_removed(notify_socket)
    assert events[:3] == [("store", "pled.1.t0"), ("store", "pled.1.t1"), ("store", "pled.1.t2")]
    assert events[3:] == [("remove", "pled.1.t1"), ("store", "pled.2.t1")], events
    assert "not handed to systemd's fd store" not in log.read_text()
