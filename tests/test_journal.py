"""pled's journal entries through journald's native protocol: the fields, the MESSAGE_IDs, the catalog, and the
stderr lines that take over whenever the journal's socket does not take a record.

The journal's socket here is a datagram socket of the test's own (harness.JournalSocket, which parses each entry
as journald does), named to pled by PLED_JOURNAL_SOCKET; pled's stderr is made "the journal" the way systemd makes
it, JOURNAL_STREAM naming its device and inode. journald itself reads these entries in tests/test_systemd_pid1.py.
"""
import encodings.ascii  # noqa: F401  the forked children cannot import it: the stdlib may sit under a 0700 home
import io
import logging
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from forked import as_user
from harness import JournalSocket, clean_env, start, wait_until, write_config
from pled import client
from pled.daemon.health import journal, logs
from pled.shared import protocol
from pled.shared.errors import PledError, SidecarError

ROOT = Path(__file__).resolve().parent.parent
CATALOG = ROOT / "units" / "pled.catalog"
# Fixed for good: operators' queries (journalctl MESSAGE_ID=...) and units/pled.catalog name them.
IDS = {
    "ready": "d6841e352cdb46e08a9096e800671328",
    "refused": "a14c21fd37df47e5994ed8ad9633c97c",
    "reload_done": "36b05ea600f0435db6ac982303d3155a",
    "reload_failed": "ad97a81bbb5c4ddf9433e3966ec572cd",
    "client_attached": "94d871ad22b74bf78a1a23b67089c680",
    "client_detached": "6eb4b2a2088941bb8dbf83e6a3ecc469",
    "client_refused": "7a04562bbbf04e8e99f5386ae50a178a",
    "client_dropped": "751353ac3de341bbaa8ddb0bc64043e4",
    "verify_differs": "2b056be33c5e416b9e9571a1ccb313bc",
    "table_modified": "b14c68e002f64778ad9b81956b28e8fe",
}


def stream_of(path: Path) -> str:
    """JOURNAL_STREAM for a process whose stderr is the file at ``path``, as systemd sets it for its stream."""
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}"


def journald_env(log: Path, js: JournalSocket) -> dict:
    """pled's stderr (``log``) is the journal, and its native socket is ``js``."""
    log.touch()
    return {"JOURNAL_STREAM": stream_of(log), journal.ENV_SOCKET: js.path}


def handler_from_setup() -> logging.Handler:
    """The handler logs.setup() installs in this environment, taken off the root logger again."""
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    try:
        logs.setup("DEBUG")
        (handler,) = root.handlers
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
    return handler


def logger_with(handler: logging.Handler) -> logging.Logger:
    log = logging.getLogger("pled.journaltest")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.DEBUG)
    return log


@pytest.fixture
def journald(tmp_path, monkeypatch):
    """(log, js, stderr path): a logger set up by logs.setup() as under journald, writing to ``js``."""
    stderr = open(tmp_path / "stderr", "w")
    monkeypatch.setattr(sys, "stderr", stderr)
    js = JournalSocket(tmp_path / "j.sock")
    monkeypatch.setenv("JOURNAL_STREAM", stream_of(tmp_path / "stderr"))
    monkeypatch.setenv(journal.ENV_SOCKET, js.path)
    handler = handler_from_setup()
    assert isinstance(handler, journal.JournalHandler)
    yield logger_with(handler), js, tmp_path / "stderr"
    handler.close()
    js.close()
    stderr.close()


def last(js: JournalSocket, count: int = 1) -> dict:
    return wait_until(lambda: js.entries[count - 1:], 10, message=lambda: f"{len(js.entries)} entries")[0]


# -- the handler and the fields -----------------------------------------------------------------------------------

def test_each_kind_of_event_has_its_fixed_message_id_and_every_one_is_logged_somewhere():
    assert journal.MESSAGE_IDS == IDS
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in IDS.values()) and len(set(IDS.values())) == len(IDS)
    used = {m for p in (ROOT / "pled").rglob("*.py") for m in re.findall(r'fields\(\s*"(\w+)"', p.read_text())}
    assert used == set(IDS)


def test_a_record_is_one_entry_with_its_fields(journald):
    log, js, stderr = journald
    peer = SimpleNamespace(pid=1234, uid=567)
    log.warning("dropping %s: \x1b[2J%s", "pid 1234", "\u2028", extra=journal.fields(
        "client_dropped", table=["a", "b"], generation=3, peer=peer))
    e = last(js)
    assert e["MESSAGE"] == ["dropping pid 1234: \\x1b[2J\\u2028"]
    assert (e["PRIORITY"], e["SYSLOG_IDENTIFIER"], e["MESSAGE_ID"]) == (["4"], ["pled"], [IDS["client_dropped"]])
    assert (e["PLED_TABLE"], e["PLED_GENERATION"], e["PLED_CLIENT_PID"], e["PLED_CLIENT_UID"]) == (
        ["a", "b"], ["3"], ["1234"], ["567"])
    assert e["CODE_FILE"] == [__file__] and e["CODE_FUNC"] == ["test_a_record_is_one_entry_with_its_fields"]
    assert e["CODE_LINE"][0].isdigit()
    log.info("plain")
    assert set(last(js, 2)) == {"MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER", "CODE_FILE", "CODE_LINE", "CODE_FUNC"}
    assert stderr.read_text() == ""


def test_no_value_can_end_its_field_and_start_another(journald):
    """A newline in a table's name or a peer's command line is escaped; a traceback's lines stay one MESSAGE, in
    the binary length form."""
    log, js, _ = journald
    evil = "t\nMESSAGE_ID=" + IDS["refused"] + "\nPRIORITY=0"
    try:
        raise ValueError("boom\nPRIORITY=0")
    except ValueError:
        log.exception("client %s failed", "cmd\nPRIORITY=0",
                      extra=journal.fields("client_dropped", table=evil, peer=SimpleNamespace(pid=1, uid=2)))
    e = last(js)
    assert e["MESSAGE_ID"] == [IDS["client_dropped"]] and e["PRIORITY"] == ["3"]
    assert e["PLED_TABLE"] == [evil.replace("\n", "\\n")]
    (message,) = e["MESSAGE"]
    lines = message.split("\n")
    assert lines[0] == "client cmd\\nPRIORITY=0 failed" and lines[1] == "Traceback (most recent call last):"
    assert lines[-2:] == ["ValueError: boom", "PRIORITY=0"]  # lines of the traceback, inside MESSAGE
    assert journal.field("MESSAGE", "a\nb") == b"MESSAGE\n" + struct.pack("<Q", 3) + b"a\nb\n"
    assert journal.field("PLED_TABLE", "t") == b"PLED_TABLE=t\n"


def test_a_multi_line_message_in_other_scripts_arrives_whole_its_length_counted_in_bytes(journald):
    """A failure logged with its traceback, about a table named in Greek and a path in Japanese: MESSAGE holds
    several lines, so it goes in the binary form, its 64-bit little-endian length the count of its UTF-8 bytes (not
    of its characters), and journald reads the whole message and then the next field. Read here twice: the datagram
    byte by byte, as the protocol lays it out, and parsed as journald parses it (harness.JournalSocket)."""
    log, js, stderr = journald
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # a journal socket of its own: the datagram unparsed
    raw.bind(str(Path(js.path).parent / "raw.sock"))
    raw.settimeout(10)
    handler = log.handlers[0]

    def fail():
        try:
            raise OSError(5, "ünïcödé — /srv/モデル/ples_int4/shard_0.safetensors ✓")
        except OSError:
            log.warning("staging table %s failed", "πίνακας", exc_info=True, extra=journal.fields(table="πίνακας"))

    try:
        handler.path = raw.getsockname()
        fail()
        data = raw.recv(1 << 20)
    finally:
        handler.path = js.path
        raw.close()
    assert data.startswith(b"MESSAGE\n"), data[:100]
    (length,) = struct.unpack("<Q", data[8:16])
    message = data[16:16 + length].decode(errors="replace")  # its bytes: a length in characters cuts it short
    assert data[16 + length:].startswith(b"\nPRIORITY=4\nSYSLOG_IDENTIFIER=pled\n"), data[16 + length - 40:][:120]
    lines = message.split("\n")
    assert lines[0] == "staging table πίνακας failed" and lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "OSError: [Errno 5] ünïcödé — /srv/モデル/ples_int4/shard_0.safetensors ✓"
    assert len(message) < length  # more bytes than characters: where the two counts part
    assert b"\nPLED_TABLE=" + "πίνακας".encode() + b"\n" in data
    fail()  # and as journald reads it
    wait_until(lambda: js.entries or js.errors, 10)
    assert js.errors == [] and js.entries[0]["MESSAGE"] == [message], js.errors
    assert (js.entries[0]["PRIORITY"], js.entries[0]["PLED_TABLE"]) == (["4"], ["πίνακας"])
    assert stderr.read_text() == ""


def test_an_entry_too_big_for_a_datagram_goes_in_a_sealed_memfd(journald):
    log, js, stderr = journald
    log.info("%s", "x" * 400_000, extra=journal.fields(table="big"))  # over the socket's send buffer (212992)
    e = last(js)
    assert e["MESSAGE"] == ["x" * 400_000] and e["PLED_TABLE"] == ["big"]
    import fcntl

    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    assert js.sealed[0] is not None and js.sealed[0] & seals == seals
    assert stderr.read_text() == ""


def fill(path: str) -> socket.socket:
    """Datagrams into ``path`` until its queue is full (EAGAIN), as with a journald that does not keep up."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for n in range(100_000):
        try:
            s.sendto(b"FILLER=%d\n" % n, socket.MSG_DONTWAIT, path)
        except BlockingIOError:
            return s
    raise AssertionError("the socket's queue never filled")


def test_a_socket_full_or_gone_sends_each_record_to_stderr_at_once(tmp_path):
    js = JournalSocket(tmp_path / "j.sock", read=False)
    filler = fill(js.path)
    out = io.StringIO()
    fallback = logging.StreamHandler(out)
    fallback.setFormatter(logging.Formatter("<%(levelname)s>%(message)s"))
    h = journal.JournalHandler(fallback, js.path)
    log = logger_with(h)
    try:
        worker = threading.Thread(target=lambda: [log.info("line %d", i, extra=journal.fields("ready"))
                                                  for i in range(3)])
        worker.start()
        worker.join(2)
        blocked = worker.is_alive()
        if blocked:
            js.start()  # what a blocking send waits for
            worker.join()
        assert not blocked, "logging waited for the journal's socket"
        text = out.getvalue().splitlines()
        assert text[1:] == ["<INFO>line 0", "<INFO>line 1", "<INFO>line 2"], text
        assert text[0].startswith(f"<WARNING>the journal's socket {js.path} refused a record (EAGAIN")
        js.start()  # journald catches up: the next record is an entry again
        wait_until(lambda: len(js.entries) >= 5, 10)
        log.info("back", extra=journal.fields("ready"))
        assert wait_until(lambda: [e for e in js.entries if e.get("MESSAGE") == ["back"]], 10)
        h.path = str(tmp_path / "gone.sock")
        log.info("after")
        assert out.getvalue().splitlines()[-1] == "<INFO>after"  # the note: at most once a minute
        h._noted = None
        log.info("again")
        assert "refused a record (ENOENT" in out.getvalue().splitlines()[-2]
    finally:
        h.close()
        filler.close()
        js.close()


def test_setup_writes_to_the_journal_only_where_stderr_is_the_journal(tmp_path, monkeypatch):
    err = tmp_path / "stderr"
    stderr = open(err, "w")
    monkeypatch.setattr(sys, "stderr", stderr)
    js = JournalSocket(tmp_path / "j.sock")
    try:
        monkeypatch.setenv(journal.ENV_SOCKET, js.path)
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
        h = handler_from_setup()  # a terminal: the text log, as it was
        assert type(h) is logging.StreamHandler
        logger_with(h).warning("x\ny")
        stderr.flush()
        text = err.read_text()
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d pled\[\d+\] WARNING x\\ny\n", text), text
        stderr.truncate(0)
        stderr.seek(0)
        other = tmp_path / "other"
        other.touch()
        monkeypatch.setenv("JOURNAL_STREAM", stream_of(other))  # systemd's stream, but not our stderr
        assert type(handler_from_setup()) is logging.StreamHandler
        monkeypatch.setenv("JOURNAL_STREAM", stream_of(err))
        h = handler_from_setup()
        assert isinstance(h, journal.JournalHandler) and h.path == js.path
        h.close()
        monkeypatch.setenv(journal.ENV_SOCKET, str(tmp_path / "none.sock"))  # stderr is the journal; no socket
        h = handler_from_setup()
        assert type(h) is logging.StreamHandler
        logger_with(h).warning("x\ny")
        stderr.flush()
        assert err.read_text() == "<4>x\\ny\n"
        assert js.entries == []
    finally:
        js.close()
        stderr.close()


def test_the_refusal_pled_exits_78_with_is_tagged_refused():
    def tagged(err):
        return journal.refusal_fields(err)[journal.ATTR] or None

    refused = SidecarError("/x", "no such file")
    refused.table = "t1"
    assert tagged(refused) == {"MESSAGE_ID": [IDS["refused"]], "PLED_TABLE": ["t1"]}
    assert tagged(PledError("exit 1")) is None and tagged(ValueError("a text")) is None


# -- the catalog --------------------------------------------------------------------------------------------------

def test_the_catalog_is_accepted_and_lists_exactly_the_ids_pled_emits(tmp_path):
    if shutil.which("journalctl") is None:
        pytest.skip("no journalctl (systemd) here")
    (tmp_path / "usr/lib/systemd/catalog").mkdir(parents=True)
    shutil.copy(CATALOG, tmp_path / "usr/lib/systemd/catalog/pled.catalog")
    r = subprocess.run(["journalctl", f"--root={tmp_path}", "--update-catalog"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = subprocess.run(["journalctl", f"--root={tmp_path}", "--list-catalog"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    listed = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert set(listed) == set(journal.MESSAGE_IDS.values())
    assert all(subject.startswith("pled: ") for subject in listed.values()), listed  # Defined-By: pled


# -- pled serve ---------------------------------------------------------------------------------------------------

def entry_of(js: JournalSocket, event: str, count: int = 1) -> dict:
    return js.wait_for(IDS[event], timeout=15, count=count)


@pytest.mark.daemon
def test_ready_clients_and_reloads_reach_the_journal_with_their_fields(tmp_path, sidecar):
    js = JournalSocket(tmp_path / "j.sock")
    a, b = sidecar(shards=2, rows=64), sidecar(shards=3, rows=64)
    log = tmp_path / "pled.log"
    pled = start(tmp_path, {"t1": a}, name="j", wait=None, env=journald_env(log, js), log=log)
    cfg, sock = tmp_path / "j.toml", str(tmp_path / "run-j" / "pled.sock")
    try:
        e = entry_of(js, "ready")
        assert e["MESSAGE"][0].startswith("ready: 1 table(s)") and e["PLED_TABLE"] == ["t1"]
        assert (e["PRIORITY"], e["SYSLOG_IDENTIFIER"]) == (["6"], ["pled"])
        assert e["CODE_FILE"][0].endswith("pled/daemon/lifecycle.py") and e["CODE_FUNC"] == ["_on_all_ready"]
        me = {"PLED_CLIENT_PID": [str(os.getpid())], "PLED_CLIENT_UID": [str(os.getuid())]}

        with client.attach("t1", socket=sock):
            e = entry_of(js, "client_attached")
            assert {k: e.get(k) for k in (*me, "PLED_TABLE", "PLED_GENERATION")} == {
                **me, "PLED_TABLE": ["t1"], "PLED_GENERATION": ["1"]}
        e = entry_of(js, "client_detached")
        assert {k: e.get(k) for k in (*me, "PLED_TABLE")} == {**me, "PLED_TABLE": ["t1"]}

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a call pled cannot read: dropped
            s.connect(sock)
            s.sendall(b"{not json\0")
            assert b"InvalidMessage" in s.recv(65536)
        e = entry_of(js, "client_dropped")
        assert {k: e.get(k) for k in (*me, "PRIORITY")} == {**me, "PRIORITY": ["4"]}

        write_config(cfg, {"t1": b}, socket=sock, headroom_margin=0)  # t1 changed: generation 2
        pled.send_signal(signal.SIGHUP)
        e = entry_of(js, "reload_done")
        assert (e["PLED_TABLE"], e["PLED_GENERATION"], e["PRIORITY"]) == (["t1"], ["2"], ["6"])
        with client.attach("t1", socket=sock):
            assert entry_of(js, "client_attached", count=2)["PLED_GENERATION"] == ["2"]

        write_config(cfg, {"t1": b, "t2": tmp_path / "missing"}, socket=sock, headroom_margin=0)
        pled.send_signal(signal.SIGHUP)
        e = entry_of(js, "reload_failed")
        assert (e["PLED_TABLE"], e["PRIORITY"]) == (["t2"], ["3"]) and "missing" in e["MESSAGE"][0]
        assert "PLED_GENERATION" not in e
        staged = [e for e in js.entries if e["MESSAGE"][0].startswith("table t1 staged")]
        assert [e["PLED_GENERATION"] for e in staged] == [["1"], ["2"]]  # per-table lines carry the table too
    finally:
        assert pled.stop() == 0
        js.close()
    assert "ready:" not in pled.log()  # it went to the journal, not to stderr


@pytest.mark.daemon
@pytest.mark.parametrize("what", ["preflight", "sidecar", "config"])
def test_a_refusal_at_start_is_one_refused_entry(tmp_path, sidecar, what):
    js = JournalSocket(tmp_path / "j.sock")
    log = tmp_path / "pled.log"
    tables, keys = {"t1": sidecar(shards=2, rows=64)}, {}
    if what == "preflight":
        keys["headroom_margin"] = "100000GiB"
    elif what == "sidecar":
        tables["t1"] = tmp_path / "missing"
    else:
        keys["no_such_key"] = 1
    pled = start(tmp_path, tables, wait=None, env=journald_env(log, js), log=log, **keys)
    try:
        assert pled.wait(30) == 78
        e = entry_of(js, "refused")
        assert e["PRIORITY"] == ["3"] and e.get("PLED_TABLE") == (["t1"] if what == "sidecar" else None)
        assert {"preflight": "headroom_margin", "sidecar": "missing", "config": "no_such_key"}[what] in e["MESSAGE"][0]
        time.sleep(0.2)
        assert [x["MESSAGE"] for x in js.entries if x["PRIORITY"] == ["3"]] == [e["MESSAGE"]]  # said once
    finally:
        js.close()


@pytest.mark.daemon
@pytest.mark.root
def test_a_refused_client_is_a_client_refused_entry(tmp_path, sidecar, open_dir):
    js = JournalSocket(tmp_path / "j.sock")
    log = tmp_path / "pled.log"
    sock = os.path.join(open_dir, "pled.sock")
    pled = start(tmp_path, {"t": sidecar(shards=2, rows=64)}, socket=sock, wait=None, env=journald_env(log, js),
                 log=log)
    try:
        entry_of(js, "ready")
        os.chmod(sock, 0o666)  # the socket's mode lets anyone in: pled's own check decides

        def attach():
            try:
                client.attach("t", socket=sock)
            except client.PermissionDenied:
                return f"{os.getpid()} refused"
            return f"{os.getpid()} attached"

        pid, said = as_user(attach, []).split()
        assert said == "refused"
        e = entry_of(js, "client_refused")
        assert (e["PLED_CLIENT_PID"], e["PLED_CLIENT_UID"], e["PRIORITY"]) == ([pid], ["65534"], ["4"])
    finally:
        assert pled.stop() == 0
        js.close()


@pytest.mark.daemon
def test_a_journal_socket_that_is_full_or_gone_leaves_pled_serving_and_the_lines_on_stderr(tmp_path, sidecar):
    js = JournalSocket(tmp_path / "j.sock", read=False)
    filler = fill(js.path)
    log = tmp_path / "pled.log"
    pled = start(tmp_path, {"t1": sidecar(shards=2, rows=64)}, name="j", wait=None, env=journald_env(log, js),
                 log=log)
    sock = str(tmp_path / "run-j" / "pled.sock")
    try:
        pled.wait_for("<6>ready: 1 table(s)", timeout=20)  # journald not reading: every line on stderr, at once
        with client.attach("t1", socket=sock):
            pled.wait_for("<6>client attached: table t1 generation 1")
        assert pled.log().count("refused a record (EAGAIN") == 1  # noted once
        js.start()  # journald catches up: pled's next lines are entries again
        wait_until(lambda: any(e.get("FILLER") for e in js.entries), 10)
        pled.send_signal(signal.SIGUSR1)
        wait_until(lambda: any(e["MESSAGE"][0].startswith("SIGUSR1: status") for e in js.entries if "MESSAGE" in e),
                   10, message=lambda: pled.log()[-2000:])
        js.close()
        os.unlink(js.path)  # and now it is gone
        with client.attach("t1", socket=sock):
            pled.wait_for("<6>client attached: table t1 generation 1", count=2)
        assert client.call(protocol.STATUS, socket=sock)["tables"][0]["state"] == "ready"
    finally:
        assert pled.stop() == 0
        filler.close()
        js.close()


@pytest.mark.daemon
def test_pled_verify_under_journald_records_a_table_that_differs(tmp_path, sidecar):
    d = sidecar(shards=2, rows=64)
    pled = start(tmp_path, {"t1": d}, name="v")
    sock = str(tmp_path / "run-v" / "pled.sock")
    js = JournalSocket(tmp_path / "j.sock")
    try:
        shard = sorted(d.glob("*.safetensors"))[1]
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(data)  # the same size, one byte changed
        err = tmp_path / "verify.err"
        verify = [sys.executable, "-m", "pled", "verify", "--socket", sock]
        with open(err, "w") as stderr:  # a unit running pled verify: its stderr is the journal
            r = subprocess.run(verify, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=60,
                               env=clean_env(**journald_env(err, js)))
        assert r.returncode == 1 and "DIFFERS" in r.stdout, r.stdout
        e = entry_of(js, "verify_differs")
        assert (e["PLED_TABLE"], e["PLED_GENERATION"], e["PRIORITY"]) == (["t1"], ["1"], ["4"])
        assert e["MESSAGE"] == ["pled verify: table t1 generation 1: 1 shard(s) differ from its source files"]
        r = subprocess.run(verify, capture_output=True, text=True, timeout=60,
                           env=clean_env(**{journal.ENV_SOCKET: js.path}))  # in a terminal: printed only
        assert r.returncode == 1 and r.stderr == ""
        time.sleep(0.3)
        assert len(js.with_id(IDS["verify_differs"])) == 1
    finally:
        assert pled.stop() == 0
        js.close()
