"""Issue 32's liveness test: while pled handles the worst input of each kind (a group member's call, a reload whose
new shard has a hostile header, a hostile META.json), another client's Ping is answered within a second and
`pled status --live --timeout 5` exits 0. On the pled this was filed against, each of these froze the loop: a
65,534-byte call for 16.7 s, a reload's headers for 12-14 s (boundary.depth's regex, math.prod of a shape before
its rank was checked), so that a liveness probe would have restarted pled.
"""
import shutil
import socket
import struct
import threading
import time

import pytest

from attack import raw
from harness import run_pled, start
from pled.daemon.sources.safetensors_file import MAX_HEADER
from pled.daemon.sources.sidecar import MAX_META
from pled.shared import protocol

pytestmark = pytest.mark.daemon
PING_BUDGET = 1.0  # seconds: a Ping answered later than this is a loop held by someone's input
ESCAPED_QUOTES = b'\\"'


class Pinger:
    """Pings pled on a fresh connection every 20 ms from a thread of its own, and keeps each round trip's time
    (a Ping not answered within 60 s counts as 60 s)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                reply = raw(self.path, protocol.call(protocol.PING), timeout=60)
                assert reply == {"parameters": {}}, reply
            except OSError:
                pass
            self.times.append(time.monotonic() - start)
            self.stop.wait(0.02)

    def __enter__(self) -> "Pinger":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(90)

    @property
    def slowest(self) -> float:
        return max(self.times, default=float("inf"))


def live(pled) -> int:
    return run_pled("status", "--live", "--timeout", "5", "--socket", pled.socket, timeout=60).returncode


def test_pings_are_answered_within_a_second_while_a_member_sends_calls_of_escaped_quotes(tmp_path, sidecar, pleds):
    pled = start(tmp_path, {"t": sidecar(shards=2, rows=64)})
    pleds.append(pled)
    call = ESCAPED_QUOTES * ((protocol.MAX_CALL - 2) // 2) + b"\0"  # 65,535 bytes with its NUL: under the limit
    with Pinger(pled.socket) as pinger:
        time.sleep(0.2)
        for _ in range(3):
            reply = raw(pled.socket, call, timeout=60)
            assert reply["error"] == protocol.INVALID_MESSAGE and "not JSON" in reply["parameters"]["reason"], reply
        # and many at once, over one connection each, sent as fast as the socket takes them
        senders = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(20)]
        for s in senders:
            s.connect(pled.socket)
            s.sendall(call)
        alive = live(pled)
        time.sleep(0.5)
        for s in senders:
            s.close()
    print(f"{len(pinger.times)} Pings, slowest {pinger.slowest * 1000:.1f} ms; status --live exited {alive}")
    assert alive == 0
    assert len(pinger.times) > 10 and pinger.slowest <= PING_BUDGET, f"slowest Ping {pinger.slowest:.2f} s"


def _header_of_escaped_quotes(path) -> None:
    header = ESCAPED_QUOTES * (MAX_HEADER // 2)  # the largest header pled reads, all of it escaped quotes
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"x")


def _header_of_many_extents(path) -> None:
    dims = b",".join([b"10000000000000000000"] * 60_000 + [b"0"])
    header = b'{"w":{"dtype":"U8","shape":[' + dims + b'],"data_offsets":[0,0]}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def _header_of_lists(path) -> None:
    header = b'{"a":[' + b"[]," * (MAX_HEADER // 3 - 4) + b"[]]}"  # 2.8 million lists: no hook, all in json.loads
    path.write_bytes(struct.pack("<Q", len(header)) + header)


HOSTILE = {  # what the new table's directory gets -> words the reload's refusal holds
    "a shard header of escaped quotes": (lambda d: _header_of_escaped_quotes(d / "shard_1.safetensors"), "not JSON"),
    "a shard header whose shape has 60,001 extents": (lambda d: _header_of_many_extents(d / "shard_1.safetensors"),
                                                      "has 60001 dimensions"),
    "a shard header of 2.8 million empty lists": (lambda d: _header_of_lists(d / "shard_1.safetensors"),
                                                  "values"),
    "a META.json of escaped quotes": (lambda d: (d / "META.json").write_bytes(ESCAPED_QUOTES * (MAX_META // 2)),
                                      "not JSON"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_pings_are_answered_within_a_second_while_a_reload_reads_a_hostile_file(tmp_path, sidecar, pleds, case):
    """The reload reads the new table's headers and META.json in a thread of its own; the loop answers meanwhile,
    and the reload's refusal names the file."""
    good = sidecar(shards=2, rows=64)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    write, words = HOSTILE[case]
    write(bad)
    pled = start(tmp_path, {"t": good}, name="live")
    pleds.append(pled)
    (tmp_path / "live.toml").write_text((tmp_path / "live.toml").read_text() + f'\n[[table]]\nname = "u"\n'
                                        f'path = "{bad}"\n')
    with Pinger(pled.socket) as pinger:
        time.sleep(0.2)
        r = run_pled("reload", "--socket", pled.socket, timeout=600)
        alive = live(pled)
    print(f"{case}: {len(pinger.times)} Pings, slowest {pinger.slowest * 1000:.1f} ms; status --live exited {alive}")
    assert alive == 0
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    named = str(bad / ("META.json" if "META" in case else "shard_1.safetensors"))
    assert words in r.stderr and named in r.stderr, r.stderr[-2000:]
    assert len(pinger.times) > 5 and pinger.slowest <= PING_BUDGET, f"slowest Ping {pinger.slowest:.2f} s"


def _flood(path: str, call: bytes, stop: threading.Event) -> None:
    """Send ``call`` packed as many times as fit in 64 KiB, one write at a time, reading the replies, until ``stop``."""
    batch = call * (protocol.MAX_CALL // len(call))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.settimeout(30)
        while not stop.is_set():
            s.sendall(batch)
            got = 0
            while got < len(batch) // len(call):
                data = s.recv(1 << 20)
                if not data:
                    return
                got += data.count(b"\0")


CALLS = {  # one write of a member's calls, each cheap, packed by the thousand; and calls of 64 KiB of DEL: (the call,
    # how many connections send it)
    "Status calls packed 2,000 to a write": (protocol.call(protocol.STATUS), 8),
    "calls whose method is 65,000 DEL characters": (b'{"method":"' + b"\x7f" * 65_000 + b'"}\0', 32),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_pings_are_answered_within_a_second_while_members_flood_the_socket(tmp_path, sidecar, pleds, case):
    """A second attack's findings: a member's 64 KiB write of 2,321 Status calls held the loop a second with one
    table (7 s with eight: every call of a write was handled in one turn, each starting a check of the sources), and
    calls naming a method of 65,000 DEL characters cost 18 ms each in escaping what they said (64 connections: Pings
    of 3 s). Calls are handled one a turn of the loop, each connection in its turn; sources are checked at most every
    half second; only what is quoted of a peer's text is escaped."""
    tables = {f"t{i}": sidecar(shards=2, rows=64 + i) for i in range(8)}  # eight tables: eight sources to check
    pled = start(tmp_path, tables)
    pleds.append(pled)
    stop = threading.Event()
    call, connections = CALLS[case]
    floods = [threading.Thread(target=_flood, args=(pled.socket, call, stop), daemon=True) for _ in range(connections)]
    with Pinger(pled.socket) as pinger:
        for f in floods:
            f.start()
        time.sleep(3)
        alive = live(pled)
        time.sleep(1)
        stop.set()
    for f in floods:
        f.join(60)
    print(f"{case}: {len(pinger.times)} Pings, slowest {pinger.slowest * 1000:.1f} ms; status --live exited {alive}")
    assert alive == 0
    assert len(pinger.times) > 10 and pinger.slowest <= PING_BUDGET, f"slowest Ping {pinger.slowest:.2f} s"
