"""Reloads that overlap (issue 48, class 7), against a real `pled serve` whose sources lie on a FUSE file system
that holds a reload (or the first staging) where the test wants it (tests/blockfs.py): a SIGHUP, or a burst of them,
during the first staging or during a reload causes exactly one reload once that has ended, never a loop; a
`pled reload` while a reload is under way is answered with that reload's result when it ends, not left to its
timeout; a `pled reload` during the first staging is refused at once.

Counted: the RELOADING=1 notifications systemd is sent (one per reload begun: one planning pass each, in a child of
pled's, regions/parsing.py) and Status's `reloads` (each reload's end, done or failed); timed: every caller's answer,
from the moment the held file system lets go. Nothing here waits on a clock but for what is awaited to happen.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import Daemon, blocked_calls, run_pled, wait_until, write_config
from pled import client
from pled.shared import protocol

pytestmark = [pytest.mark.daemon, pytest.mark.root]  # root: the FUSE mount

HELD_PAST = 2 << 20  # the file system holds reads past this byte: a shard's header reads, its data waits
BURST = 5


def hold(flag: Path, past: int | None = None) -> None:
    """From now on the file system holds every call (``past`` None) or the reads of bytes past ``past``."""
    tmp = flag.with_name(flag.name + ".new")
    tmp.write_text("" if past is None else str(past))
    tmp.rename(flag)


def reloading(notify) -> int:
    return notify.lines().count("RELOADING=1")


def reloads(pled: Daemon) -> dict:
    return client.call(protocol.STATUS, socket=pled.socket, timeout=30)["daemon"]["reloads"]


def sighup_burst(pled: Daemon, marker: int) -> None:
    """BURST SIGHUPs as fast as kill(2) sends them, then SIGUSR1: once pled has logged SIGUSR1's line (its
    ``marker``th), it has handled every SIGHUP before it (signals are dispatched in the order they were recorded, and
    the kernel delivers a pending SIGHUP before a pending SIGUSR1)."""
    for _ in range(BURST):
        os.kill(pled.pid, signal.SIGHUP)
    os.kill(pled.pid, signal.SIGUSR1)
    pled.wait_for("SIGUSR1: status", count=marker)


def reload_caller(sock: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pled", "reload", "--socket", sock], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_sighups_during_the_first_staging_cause_one_reload_once_it_is_done(tmp_path, sidecar, blockfs, notify_socket):
    d = sidecar("ples_int4", shards=2, rows=40_000)  # shards of ~4 MB: their data lies past HELD_PAST
    point, flag = blockfs(d)
    hold(flag, HELD_PAST)
    cfg = write_config(tmp_path / "pled.toml", {"t": point}, headroom_margin=0)
    pled = Daemon(cfg, env={"NOTIFY_SOCKET": notify_socket.path})
    try:
        assert any(c.startswith("read /shard_") for c in blocked_calls(flag, timeout=60))  # the first staging waits
        refused = run_pled("reload", "--socket", pled.socket)
        assert refused.returncode == 1 and "the first staging is still under way; try again" in refused.stderr, \
            refused.stderr
        sighup_burst(pled, 1)
        sighup_burst(pled, 2)
        assert "READY=1" not in notify_socket.lines() and reloading(notify_socket) == 0
        assert pled.log().count("reloading again once it is done") >= 2  # at least one of each burst was handled
        flag.unlink()
        pled.wait_for("reload done", timeout=120)  # the one reload the SIGHUPs asked for
        lines = notify_socket.lines()
        assert lines.index("RELOADING=1") > lines.index("READY=1")  # after the first staging, not during it
        done = run_pled("reload", "--socket", pled.socket)  # a reload of our own: it ends after any other
        assert done.returncode == 0 and done.stdout.strip() == "unchanged: t\nnothing changed", done
        assert reloading(notify_socket) == 2, notify_socket.lines()  # the SIGHUPs' one, and ours: no loop
        assert reloads(pled) == {"done": 2, "failed": 0}
        assert pled.log().count("reload done") == 2
    finally:
        flag.unlink(missing_ok=True)
        pled.stop()


@pytest.mark.parametrize("phase", ["planning", "staging"])
def test_overlapping_reloads_share_one_answer_and_sighups_cause_one_more(tmp_path, sidecar, blockfs, notify_socket,
                                                                         phase):
    """A reload adding table u, held while it plans (its child stats u's files) or while it stages (it reads u's
    data); meanwhile two bursts of SIGHUPs and two more `pled reload`s. Every caller gets the held reload's answer
    once the file system lets go; then exactly one more reload runs (the SIGHUPs'), and no other."""
    t = sidecar("ples_int4", shards=2, rows=64)
    u = sidecar("ples_int4", shards=2, rows=40_000)
    point, flag = blockfs(u)
    cfg = write_config(tmp_path / "pled.toml", {"t": t}, headroom_margin=0)
    pled = Daemon(cfg, env={"NOTIFY_SOCKET": notify_socket.path})
    callers: list[subprocess.Popen] = []
    try:
        pled.wait_ready()
        write_config(cfg, {"t": t, "u": point}, socket=pled.socket, headroom_margin=0)
        hold(flag, None if phase == "planning" else HELD_PAST)
        callers.append(reload_caller(pled.socket))
        held = blocked_calls(flag, timeout=60)
        assert all(c.split()[0] in (("getattr", "open", "read") if phase == "planning" else ("read",)) for c in held)
        sighup_burst(pled, 1)
        callers += [reload_caller(pled.socket) for _ in range(2)]
        sighup_burst(pled, 2)

        def progress() -> dict | None:
            st = client.call(protocol.STATUS, socket=pled.socket, timeout=30)["reload"]
            return st if st is not None and st["callers"] == 3 else None

        under_way = wait_until(progress, 60, "the three `pled reload` calls never all waited on the reload")
        assert under_way["state"] == phase and under_way["again"] is True, under_way
        assert reloading(notify_socket) == 1 and reloads(pled) == {"done": 0, "failed": 0}
        assert all(c.poll() is None for c in callers)  # each waits for the reload's answer

        released = time.monotonic()
        flag.unlink()
        answers = []
        for c in callers:
            out, err = c.communicate(timeout=120)
            answers.append((c.returncode, out, err, time.monotonic() - released))
        print("answered, s after the file system let go:", ", ".join(f"{a[3]:.2f}" for a in answers))
        for code, out, err, _ in answers:
            assert code == 0 and out == "added: u (generation 1)\nunchanged: t\n", (code, out, err)

        wait_until(lambda: pled.log().count("reload done") == 2, 120, lambda: f"no second reload:\n{pled.log()}")
        assert reloading(notify_socket) == 2
        last = run_pled("reload", "--socket", pled.socket)  # ours, after the SIGHUPs' one
        assert last.returncode == 0 and last.stdout == "unchanged: t, u\nnothing changed\n", last
        assert reloading(notify_socket) == 3, notify_socket.lines()  # the held one, the SIGHUPs' one, ours
        assert reloads(pled) == {"done": 3, "failed": 0}
        text = pled.log()
        assert text.count("reload done") == 3 and "reload failed" not in text
        assert pled.proc.poll() is None
    finally:
        flag.unlink(missing_ok=True)
        for c in callers:
            if c.poll() is None:
                c.kill()
                c.wait()
        pled.stop()
