"""A sidecar on a file system that stops answering (an NFS or FUSE mount whose server hangs), against a real
`pled serve`: Status, Attach and SIGTERM go on working while it hangs, after staging (the Status check of the
sources runs in a worker, one at a time) and during staging (SIGTERM closes the listener first and waits a
few seconds at most for the staging thread, then names the table it abandons)."""
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from harness import Daemon, blocked_calls, wait_until, write_config
from pled import client
from pled.daemon import tables
from pled.shared import protocol

pytestmark = [pytest.mark.daemon, pytest.mark.root]  # root: the FUSE mounts


def timed(fn, *args, **kw):
    start = time.monotonic()
    result = fn(*args, **kw)
    return result, time.monotonic() - start


def stop_within(pled: Daemon, seconds: float) -> tuple[int, float]:
    start = time.monotonic()
    pled.proc.send_signal(signal.SIGTERM)
    try:
        rc = pled.proc.wait(timeout=seconds + 5)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"pled did not exit within {seconds + 5} s of SIGTERM:\n{pled.log()}") from None
    return rc, time.monotonic() - start


def test_status_attach_and_sigterm_answer_while_the_sidecars_file_system_hangs(tmp_path, sidecar, blockfs):
    d = sidecar("ples_int4", shards=3, rows=2000)
    point, flag = blockfs(d)
    pled = Daemon(write_config(tmp_path / "pled.toml", {"t": point}, headroom_margin=0))
    try:
        pled.wait_for("ready:")
        st = client.call(protocol.STATUS, socket=pled.socket, timeout=5)
        assert st["tables"][0]["sources"] == "unchanged"
        flag.touch()  # the file system hangs from now on
        time.sleep(tables.SOURCES_FRESH)  # the answer above is no longer fresh: this Status starts a check
        st, took = timed(client.call, protocol.STATUS, socket=pled.socket, timeout=3)
        assert took < 1, f"Status took {took:.2f} s"
        assert blocked_calls(flag)[0].startswith("getattr /shard_")  # the check this Status began is held there
        sources = st["tables"][0]["sources"]
        assert sources.startswith("unchanged (checked ") and "waiting 0 s for the file system" in sources, sources
        def quick_status() -> dict:
            st, took = timed(client.call, protocol.STATUS, socket=pled.socket, timeout=3)
            assert took < 1, f"Status took {took:.2f} s"
            return st["tables"][0]

        def waited_seconds() -> int:
            waited = re.search(r"the check has been waiting (\d+) s for the file system", quick_status()["sources"])
            assert waited, quick_status()
            return int(waited[1])

        wait_until(lambda: waited_seconds() >= 1, 10, interval=0.1, message="Status never counted a second waited")
        for _ in range(5):
            quick_status()
        for _ in range(10):
            start = time.monotonic()
            with client.attach("t", socket=pled.socket, timeout=3) as t:
                assert t.generation == 1
            assert time.monotonic() - start < 1
        assert len(blocked_calls(flag)) == 1  # one check in flight, however many Status calls: no pile of threads
        rc, took = stop_within(pled, 1.5)
        assert rc == 0 and took < 1.5, (rc, took)
        log = pled.log()
        assert "SIGTERM: stopping" in log and "stopped: released 1 table(s)" in log
    finally:
        flag.unlink(missing_ok=True)
        pled.stop()


def test_sigterm_while_a_staging_read_hangs_refuses_clients_and_names_the_table(tmp_path, sidecar, blockfs):
    d = sidecar("ples_int4", shards=4, rows=80_000)  # 4 shards of 8 MB, staged at 16 MB/s
    point, flag = blockfs(d)
    cfg = write_config(tmp_path / "pled.toml", {"t": point}, headroom_margin=0, staging_bandwidth="16MB/s")
    pled = Daemon(cfg)
    try:
        pled.wait_for("shard 1/4")
        flag.touch()
        assert any(c.startswith(("read /shard_", "open /shard_", "getattr /shard_")) for c in blocked_calls(flag))
        st, took = timed(client.call, protocol.STATUS, socket=pled.socket, timeout=3)
        assert took < 1 and st["tables"][0]["state"] == "staging", (took, st)
        waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a client connected before the stop
        waiting.settimeout(2)
        waiting.connect(pled.socket)
        start = time.monotonic()
        pled.proc.send_signal(signal.SIGTERM)
        refused = None
        while refused is None and time.monotonic() - start < 1:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1)
            try:
                probe.connect(pled.socket)
            except (ConnectionRefusedError, FileNotFoundError) as err:
                refused = err
            finally:
                probe.close()
            time.sleep(0.02)
        assert refused is not None, "pled still accepts connections a second after SIGTERM"
        assert waiting.recv(1) == b""  # its connection is closed at once, not held through the wait
        waiting.close()
        try:
            rc = pled.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"pled did not exit within 10 s of SIGTERM:\n{pled.log()}") from None
        took = time.monotonic() - start
        assert rc == 0 and took < 6, (rc, took)
        log = pled.log()
        assert "SIGTERM: stopping" in log
        assert re.search(r"stopping without waiting for table t's staging: it has been reading shard (\d)/4 "
                         r"\(shard_(\d)\.safetensors\) for \d+ s; its partial copy is discarded", log), log
        assert not Path(pled.socket).exists()
    finally:
        flag.unlink(missing_ok=True)
        pled.stop()


def test_a_flood_of_status_calls_checks_the_sources_at_most_every_half_second(monkeypatch):
    """A second attack's finding: every Status call started a check of every table's sources (a thread, a stat of
    each file) and waited for it on the loop; a member's 2,321 Status calls in one write did so 2,321 times. An answer
    whose check began less than SOURCES_FRESH ago is given again."""
    import threading

    checks = []

    def counted(shards):
        checks.append(threading.current_thread().name)
        return "unchanged"

    monkeypatch.setattr(tables, "check_sources", counted)
    source_check = tables.SourceCheck()
    start = time.monotonic()
    answers = [source_check.result(()) for _ in range(500)]
    took = time.monotonic() - start
    assert set(answers) == {"unchanged"}
    assert 1 <= len(checks) <= 1 + took / tables.SOURCES_FRESH, (len(checks), took)
    time.sleep(tables.SOURCES_FRESH)
    source_check.result(())  # once the answer is older than that: checked again
    assert len(checks) == 2 or len(checks) > 1 + took / tables.SOURCES_FRESH
