"""Nothing a peer or a file controls reaches a terminal or a log line raw.

A client's command line (pled reads it from /proc: here the client is root, as it is where pled runs
without ProtectProc=, in containers, or for clients running as root or as user pled), a table's path, and
a file's text quoted in an error are full of ESC, BEL, the C1 CSI U+009B and U+2028. `pled status`, pled's
log and systemd's STATUS= must show them escaped.
"""
import json
import os
import subprocess
import sys

import pytest

from fakeserver import FakeServer
from harness import Daemon, run_pled, start, wait_until, write_config
from pled import client
from pled.shared import protocol

pytestmark = pytest.mark.daemon

EVIL = ["\x1b]0;pwned\x07", "\x9b2J", "a\u2028b\u202e", "\x1b[2K\r\x1b[31mERROR table t1 DIFFERS from disk\x1b[0m"]


def raw_control(text: str) -> list[str]:
    """The characters of ``text`` a terminal or a log viewer would act on (line breaks between lines aside)."""
    return sorted({repr(c) for c in text if not c.isprintable() and c != "\n"})


def test_a_clients_command_line_and_a_tables_path_are_escaped_everywhere(tmp_path, sidecar):
    d = sidecar(shards=2, rows=64).rename(tmp_path / "ples\x1b[2J\x07\u2028dir")
    sock = str(tmp_path / "run" / "pled.sock")
    cfg = write_config(tmp_path / "pled.toml", {"t1": d}, socket=sock, headroom_margin=0)
    pled = Daemon(cfg)
    holder = None
    try:
        pled.wait_for("ready:")
        # The code comes from the environment and python is started by a relative name from its own directory,
        # so that EVIL starts within the first 80 characters `pled status` shows, wherever the checkout lies.
        code = "import sys, pled.client as c; t = c.attach('t1'); print('attached', flush=True); sys.stdin.read()"
        holder = subprocess.Popen(["./" + os.path.basename(sys.executable), "-c", "exec(__import__('os').environ['C'])",
                                   *EVIL], cwd=os.path.dirname(sys.executable), executable=sys.executable,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "C": code, "PLED_SOCKET": sock})
        assert holder.stdout.readline().strip() == "attached"
        st = client.call(protocol.STATUS, socket=sock)
        (entry,) = st["clients"]
        assert "\\x1b]0;pwned\\x07" in entry["command"] and "\\x9b2J" in entry["command"], entry["command"]
        assert raw_control(entry["command"]) == []
        shown = run_pled("status", "--socket", sock)
        assert "\\x1b]0;pwned" in shown.stdout and raw_control(shown.stdout) == [], shown.stdout
        # a reload over a config whose error quotes a key with escapes in it
        write_config(cfg, {"t1": d}, socket=sock, headroom_margin=0, **{"bad\x1b[31mkey\u2028": 1})
        assert pled.reload() == "reload failed"
    finally:
        if holder is not None:
            holder.stdin.close()
            holder.wait(timeout=30)
        pled.stop()
    log = pled.log()
    assert "\\x1b]0;pwned\\x07" in log and "bad\\x1b[31mkey\\u2028" in log
    assert raw_control(log) == [], [line for line in log.splitlines() if raw_control(line)][:3]


def test_status_to_systemd_cannot_be_split_into_other_fields(tmp_path, sidecar, notify_socket):
    """A newline in a table's path would end STATUS= and start another sd_notify field."""
    d = sidecar(shards=4, rows=40_000).rename(tmp_path / "x\nFDSTOREREMOVE=1\nFDNAME=pled.1.t1\x1b[2J")
    cfg = write_config(tmp_path / "pled.toml", {"t1": d}, headroom_margin=0, staging_bandwidth="8MB/s")
    pled = Daemon(cfg, env={"NOTIFY_SOCKET": notify_socket.path}, log=tmp_path / "pled.log")
    try:
        notify_socket.wait_for("READY=1")
        wait_until(lambda: any(line.startswith("STATUS=serving") for line in notify_socket.lines()), 10)
    finally:
        assert pled.stop() == 0
    lines = notify_socket.lines()
    staging = [line for line in lines if line.startswith("STATUS=staging t1 from ")]
    assert staging and all("x\\nFDSTOREREMOVE=1\\nFDNAME=pled.1.t1\\x1b[2J" in line for line in staging), staging
    assert "FDSTOREREMOVE=1" not in lines and all(raw_control(line) == [] for line in lines)
    assert raw_control((tmp_path / "pled.log").read_text()) == []


def test_clip_costs_what_it_shows_whatever_the_length_of_the_text():
    """A second attack's finding: clip escaped all of a text before cutting it, a character at a time in Python (280
    microseconds a KiB): a member's 64 KiB method name of DEL cost the loop 18 ms a call. It escapes what it shows."""
    import time

    from pled.shared.boundary import clip

    def median(text: str) -> float:
        runs = []
        for _ in range(21):
            start = time.perf_counter()
            clip(text, 200)
            runs.append(time.perf_counter() - start)
        return sorted(runs)[10]

    small, large = "\x7f" * 1024, "\x7f" * (8 << 20)
    assert clip(large, 200) == "\\x7f" * 50 + f"... ({8 << 20} characters)"
    assert median(large) < 5 * median(small), (median(large), median(small))


def test_a_tables_error_and_its_huge_page_note_reach_the_terminal_escaped(tmp_path, sidecar):
    """`pled status` prints a note per table: its error (a staging that failed names its file, whose path is the
    operator's or a file's, not pled's) and its huge-page note. Whatever they hold, and whatever answers at the
    socket (a pled of another version), the terminal gets them escaped. The reply is a real pled's Status with
    those two keys filled in, served by a stand-in (tests/fakeserver.py): a running pled shows an error only in the
    moment before it exits."""
    pled = start(tmp_path, {"t1": sidecar(shards=2, rows=64)}, name="real")
    try:
        st = client.call(protocol.STATUS, socket=pled.socket)
    finally:
        assert pled.stop() == 0
    (table,) = st["tables"]
    table["state"] = "failed"
    table["error"] = f"reading /srv/{EVIL[3]}/shard_0.safetensors failed at offset 0: Input/output error{EVIL[0]}"
    table["huge_page_note"] = f"4 KiB/THP pages as \"auto\": {EVIL[1]} {EVIL[2]}"
    server = FakeServer(str(tmp_path / "stand-in.sock"), json.dumps({"parameters": st}).encode())
    shown = run_pled("status", "--socket", server.path)
    server.join()
    assert shown.returncode == 1, shown.stdout + shown.stderr  # a failed table is not healthy
    notes = [line for line in shown.stdout.splitlines() if line.startswith("  note: t1: ")]
    assert ("  note: t1: reading /srv/\\x1b[2K\\r\\x1b[31mERROR table t1 DIFFERS from disk\\x1b[0m/"
            "shard_0.safetensors failed at offset 0: Input/output error\\x1b]0;pwned\\x07") in notes, shown.stdout
    assert '  note: t1: 4 KiB/THP pages as "auto": \\x9b2J a\\u2028b\\u202e' in notes, shown.stdout
    assert raw_control(shown.stdout) == [], shown.stdout
