"""A pled that accepts and never answers does not hold vLLM for minutes (issue 44 finding 4).

The plugin's attach (pled.client.held_files) bounds each call by one setting, ``PLED_ANSWER_TIMEOUT`` or
--additional-config's ``"answer_timeout"`` (seconds; 10 by default), apart from the wait for a table pled says is
still being staged (asked again every second, its progress said every few, up to STAGING_WAIT). On main the attach
waited ``timeout=600`` whatever the fallback: each test of a hung server here waited ten minutes there.

The hung servers are real: a real `pled serve` stopped with SIGSTOP, and tests/fakeserver.py's server that accepts
a connection and answers nothing. The staging answers come from a fake server that answers as pled does
(``protocol.error(NOT_READY, **progress)``), then with a real sealed memfd.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time

import pytest

from fakeserver import FakeServer
from pled.client import held_files, safe_open_seam
from pled.shared import protocol, region
from pled.shared.region import ALIGN, Manifest, ShardEntry, TensorEntry

WAIT = 0.5  # the answer timeout the tests set
LONG_BEFORE_MAIN = 60  # main waited 600 s; a bound of WAIT s that took this long would not be a bound


@pytest.fixture
def plugin(monkeypatch, tmp_path):
    """held_files as a fresh process sees it, pled enabled at tmp_path/pled.sock for table "t"."""
    monkeypatch.setattr(held_files, "_state", None)
    for key in ("PLED_FALLBACK", "PLED_TABLES", "VLLM_PLUGINS", "PLED_ANSWER_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PLED_SOCKET", str(tmp_path / "pled.sock"))
    monkeypatch.setenv("PLED_TABLES", "t")
    monkeypatch.setenv("PLED_ANSWER_TIMEOUT", str(WAIT))
    return monkeypatch


def timed(fn):
    began = time.monotonic()
    try:
        return fn(), time.monotonic() - began
    except Exception as err:  # noqa: BLE001 - the test looks at what it was
        return err, time.monotonic() - began


# -- a fake server that accepts and never answers --------------------------------------------------------------

@pytest.mark.parametrize("tables", ["t", None], ids=["attach", "status"])
def test_a_server_that_never_answers_fails_the_load_in_one_line_naming_the_socket_and_the_wait(plugin, tmp_path,
                                                                                                tables):
    """Without the fallback: PledUnavailable, one line, naming the socket and the wait (WAIT s), ended by the bound,
    not by STAGING_WAIT. Both calls the plugin makes: the Attach of a configured table, and the Status that lists
    the tables where none is configured."""
    if tables is None:
        plugin.delenv("PLED_TABLES")
    server = FakeServer(str(tmp_path / "pled.sock"), b"", hang=True)
    try:
        err, took = timed(held_files.state)
    finally:
        server.join()
    assert isinstance(err, held_files.PledUnavailable), err
    said = str(err)
    assert "\n" not in said and server.path in said and f"within {WAIT:g} s" in said, said
    assert ("io.pled.Attach" if tables else "io.pled.Status") in said, said
    assert took < LONG_BEFORE_MAIN, took


def test_with_the_disk_fallback_a_server_that_never_answers_is_one_warning_then_disk(plugin, tmp_path, caplog):
    """With ``PLED_FALLBACK=disk``: one warning naming the socket and the wait, and every file is read from disk
    (the state holds no table) without asking the hung server again."""
    plugin.setenv("PLED_FALLBACK", "disk")
    server = FakeServer(str(tmp_path / "pled.sock"), b"", hang=True)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.pled"):
            st, took = timed(held_files.state)
    finally:
        server.join()
    assert isinstance(st, held_files.State) and st.tables == {} and st.lookup(str(tmp_path / "x")) is None, st
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and server.path in warned[0] and f"within {WAIT:g} s" in warned[0], warned
    assert "reading from disk instead" in warned[0], warned
    assert held_files.state() is st  # not asked again: the server is gone, and nothing waits on it
    assert took < LONG_BEFORE_MAIN, took


def test_the_safe_open_seam_reads_from_disk_when_pled_never_answers(plugin, tmp_path):
    """Through the seam a spawned vLLM 0.33 PLE offload worker uses (safetensors.safe_open wrapped by pled): a real
    safetensors file opened while the server hangs is read from disk, its tensor as written."""
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    import safetensors

    plugin.setenv("PLED_FALLBACK", "disk")
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file({"w": torch.arange(12, dtype=torch.int32)}, path)
    opener = safe_open_seam.wrap(safetensors.safe_open)
    server = FakeServer(str(tmp_path / "pled.sock"), b"", hang=True)
    try:
        with opener(path, "pt") as f:
            got = f.get_tensor("w")
    finally:
        server.join()
    assert got.tolist() == list(range(12))
    assert held_files.current() is not None and held_files.current().tables == {}


# -- a real pled, stopped ---------------------------------------------------------------------------------------

@pytest.mark.daemon
def test_a_sigstopped_pled_fails_the_load_within_the_answer_timeout(plugin, daemon, sidecar, tmp_path):
    """A real `pled serve` serving table t, then SIGSTOPped (the kernel still accepts on its socket): the plugin's
    attach ends at the bound, naming the socket and the wait; after SIGCONT it attaches the table."""
    pled = daemon({"t": sidecar(shards=2, rows=100)})
    plugin.setenv("PLED_SOCKET", pled.socket)
    os.kill(pled.pid, signal.SIGSTOP)
    try:
        err, took = timed(held_files.state)
    finally:
        os.kill(pled.pid, signal.SIGCONT)
    assert isinstance(err, held_files.PledUnavailable), err
    assert pled.socket in str(err) and f"within {WAIT:g} s" in str(err) and "\n" not in str(err), err
    assert took < LONG_BEFORE_MAIN, took
    plugin.setenv("PLED_ANSWER_TIMEOUT", "30")
    st = held_files.state()
    try:
        assert list(st.tables) == ["t"]
    finally:
        for t in st.tables.values():
            t.close()


# -- a table pled says is still being staged ----------------------------------------------------------------------

def _manifest() -> Manifest:
    shard = ShardEntry(0, "/srv/t/shard_0.safetensors", 64, 1, 2, 3, "a" * 64, ALIGN, 0, "")
    return Manifest("t", "safetensors", 0, 0, ALIGN, 2 * ALIGN, "f" * 64, (shard,),
                    (TensorEntry("w", 0, "U8", (64,), ALIGN, 64),))


class StagingServer:
    """Answers each connection's one call as pled does while table t is staged: ``not_ready`` times NOT_READY with
    its progress (``state`` as given), then the region (a real sealed memfd). Counts the calls."""

    def __init__(self, path: str, not_ready: int, state: str = "staging") -> None:
        self.path, self.not_ready, self.state, self.calls = path, not_ready, state, []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.bind(path)
        self.listener.listen(8)
        self.listener.settimeout(0.1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                call = b""
                while not call.endswith(b"\0"):
                    call += conn.recv(65536) or b"\0"
                self.calls.append(json.loads(call[:-1]))
                done = len(self.calls) - 1
                if done < self.not_ready:
                    conn.sendall(json.dumps(protocol.error(protocol.NOT_READY, table="t", state=self.state,
                                                           shards_done=done, shards=self.not_ready, bytes_done=done,
                                                           bytes=self.not_ready)).encode() + b"\0")
                    continue
                fd = os.memfd_create("fake-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, 2 * ALIGN)
                os.pwrite(fd, region.encode_header(_manifest()), 0)
                import fcntl
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, region.SEALS)
                reply = {"parameters": {"table": "t", "generation": 1, "fingerprint": "f" * 64,
                                        "region_bytes": 2 * ALIGN}}
                socket.send_fds(conn, [json.dumps(reply).encode() + b"\0"], [fd])
                os.close(fd)
                # held open until the client closes its attachment
                conn.settimeout(10)
                try:
                    conn.recv(1)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.listener.close()


@pytest.fixture
def fast_polls(plugin):
    plugin.setattr(held_files, "POLL_EVERY", 0.01)
    plugin.setattr(held_files, "PROGRESS_EVERY", 0.0)
    return plugin


def test_a_table_still_being_staged_is_waited_for_with_its_progress_said(fast_polls, tmp_path, caplog):
    """Three NOT_READY answers, then the region: attached, each Attach asked without pled's own wait (which a hung
    pled could not be told apart from), the progress said as it came."""
    server = StagingServer(str(tmp_path / "pled.sock"), not_ready=3)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.pled"):
            st = held_files.state()
        assert list(st.tables) == ["t"]
        st.tables["t"].close()
    finally:
        server.close()
    assert len(server.calls) == 4 and all("wait" not in c.get("parameters", {}) for c in server.calls), server.calls
    said = [r.getMessage() for r in caplog.records if "still being staged" in r.getMessage()]
    assert len(said) == 3 and "(2 of 3 shards, 2 of 3 bytes)" in said[-1] and server.path in said[-1], said


def test_progress_is_said_once_every_few_seconds_not_at_every_ask(fast_polls, tmp_path, caplog):
    fast_polls.setattr(held_files, "PROGRESS_EVERY", 3600.0)
    server = StagingServer(str(tmp_path / "pled.sock"), not_ready=5)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.pled"):
            held_files.state().tables["t"].close()
    finally:
        server.close()
    assert len(server.calls) == 6
    assert not [r for r in caplog.records if "still being staged" in r.getMessage()]


def test_a_table_staged_longer_than_the_staging_wait_fails_the_load_naming_the_wait(fast_polls, tmp_path):
    fast_polls.setattr(held_files, "STAGING_WAIT", 0.05)
    server = StagingServer(str(tmp_path / "pled.sock"), not_ready=100)  # ready after 100 asks: not waited for
    try:
        err, _ = timed(held_files.state)
    finally:
        server.close()
    assert isinstance(err, held_files.PledUnavailable) and "after waiting 0.05 s" in str(err), err


def test_a_table_pled_could_not_stage_is_not_waited_for(fast_polls, tmp_path):
    fast_polls.setattr(held_files, "STAGING_WAIT", 2.0)  # a test that breaks still ends
    server = StagingServer(str(tmp_path / "pled.sock"), not_ready=10**6, state="failed")
    try:
        err, _ = timed(held_files.state)
    finally:
        server.close()
    assert isinstance(err, held_files.PledUnavailable) and "could not stage table 't'" in str(err), err
    assert len(server.calls) == 1


# -- the setting ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, want", [("2", 2.0), ("0.25", 0.25), ("3600", 3600.0), ("7.", 7.0)])
def test_the_answer_timeout_is_read_from_the_environment(plugin, value, want):
    plugin.setenv("PLED_ANSWER_TIMEOUT", value)
    assert held_files.settings().answer_timeout == want


def test_the_answer_timeout_defaults_to_seconds(plugin):
    plugin.delenv("PLED_ANSWER_TIMEOUT")
    assert held_files.settings().answer_timeout == held_files.ANSWER_TIMEOUT <= 30


@pytest.mark.parametrize("value", ["0", "-1", "", "1e3", "inf", "nan", "3601", "²", "1.5.2", " 2", "9" * 30, "0x10"])
def test_a_bad_answer_timeout_in_the_environment_is_refused_in_one_line(plugin, value):
    plugin.setenv("PLED_ANSWER_TIMEOUT", value)
    with pytest.raises(held_files.PledUnavailable, match="PLED_ANSWER_TIMEOUT must be a number of seconds") as err:
        held_files.settings()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value, ok", [(3, True), (0.5, True), (True, False), ("5", False), (0, False),
                                       (float("inf"), False), (None, False), ([1], False)])
def test_the_answer_timeout_from_vllms_additional_config(plugin, value, ok):
    plugin.setattr(held_files, "_vllm_additional_config", lambda: {"socket": "/x.sock", "answer_timeout": value})
    if ok:
        assert held_files.settings().answer_timeout == value
    else:
        with pytest.raises(held_files.PledUnavailable, match="answer_timeout must be a number of seconds"):
            held_files.settings()
