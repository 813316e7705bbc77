"""Issue 32's liveness test: while pled handles the worst input of each kind (a group member's call, a reload whose
new shard has a hostile header, a hostile META.json), another client's Ping is answered within a second and
`pled status --live --timeout 5` exits 0. On the pled this was filed against, each of these froze the loop: a
65,534-byte call for 16.7 s, a reload's headers for 12-14 s (boundary.depth's regex, math.prod of a shape before
its rank was checked), so that a liveness probe would have restarted pled.

Issue 44, finding 3: a reload of the largest input of each kind that pled *accepts* (a checkpoint index at its 32 MiB
bound, a shard header at its 8 MiB bound, a META.json at its 4 MiB bound, a config at its 1 MiB bound) held the
slowest Ping 2.6 s while a thread of pled's parsed the index. A reload's planning runs in a child process now
(pled/daemon/regions/parsing.py): the slowest Ping, each a round trip on a connection already made, measured from
the call's first byte sent to its reply's last byte read, stays under 100 ms (the issue's bound) while a reload of
each reads, plans and stages it.
"""
import json
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from attack import raw
from harness import run_pled, start, write_config
from pled.daemon.sources.checkpoint import INDEX, MAX_INDEX
from pled.daemon.sources.safetensors_file import MAX_HEADER, MAX_TENSORS, write
from pled.daemon.sources.sidecar import MAX_META
from pled.generator import make_checkpoint
from pled.shared import protocol
from pled.shared.config_file import MAX_CONFIG, MAX_LINE

pytestmark = pytest.mark.daemon
PING_BUDGET = 1.0  # seconds: a Ping answered later than this is a loop held by someone's input
RELOAD_PING_BUDGET = 0.1  # seconds: issue 44's bound while a reload reads any input, accepted or refused
ESCAPED_QUOTES = b'\\"'


PINGER = r"""
import json, os, select, socket, sys, time
path, pid, call = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode() + b"\0"

def run_delay(pid):
    with open(f"/proc/{pid}/task/{pid}/schedstat", "rb") as f:
        return int(f.read().split()[1])

times, own, wrong = [], [], []
while not select.select([sys.stdin], [], [], 0.02)[0]:  # until the test closes our stdin
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        try:
            s.connect(path)
        except OSError:  # a listener whose backlog is full (the floods): no call was sent
            continue
        try:
            waited = run_delay(pid) + run_delay(os.getpid())
        except OSError:
            wrong.append("pled exited")
            break
        start = time.monotonic()
        try:
            s.sendall(call)
            reply = b""
            while not reply.endswith(b"\0"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
        except OSError as err:
            reply = repr(err).encode()
        took = time.monotonic() - start
        try:
            waited = run_delay(os.getpid()) + run_delay(pid) - waited
        except OSError:
            waited = 0
        times.append(took)
        own.append(max(0.0, took - waited / 1e9))
        try:
            if json.loads(reply[:-1]) != {"parameters": {}} or not reply.endswith(b"\0"):
                wrong.append(reply[:200].decode(errors="replace"))
        except ValueError:
            wrong.append(reply[:200].decode(errors="replace"))
print(json.dumps({"times": times, "own": own, "wrong": wrong}))
"""


class Pinger:
    """Pings pled (``pid``) on a fresh connection every 20 ms from a process of its own (not this one, whose
    threads and collector would count as pled's), and keeps each Ping's time: from its first byte sent, on a
    connection already made (accepting it is the loop's work, connecting is the kernel's), to its reply's last byte
    read (a Ping not answered within 60 s counts as 60 s; one answered wrongly is kept in ``wrong``).

    ``times`` holds the round trips as the client sees them; ``own`` holds the loop's own share of each: the round
    trip less the time that pled's loop thread (its main thread) and the pinger spent meanwhile runnable but waiting
    for a CPU (/proc's schedstat). On two cores shared with other work, a process can wait 200 ms for a CPU with no
    reload under way (measured: Pings of an idle pled up to 228 ms at a load average of 11); what is left is what
    pled itself took: the loop's work, and its waits for the GIL that another of pled's threads held."""

    def __init__(self, path: str, pid: int) -> None:
        self.path, self.pid = path, pid
        self.times: list[float] = []
        self.own: list[float] = []
        self.wrong: list[object] = []
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Pinger":
        call = protocol.call(protocol.PING)[:-1].decode()
        self.proc = subprocess.Popen([sys.executable, "-c", PINGER, self.path, str(self.pid), call],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc) -> None:
        assert self.proc is not None
        out, _ = self.proc.communicate("", timeout=120)
        found = json.loads(out)
        self.times, self.own, self.wrong = found["times"], found["own"], found["wrong"]

    @property
    def slowest(self) -> float:
        """The slowest Ping's own time (see the class's doc); inf if none was answered."""
        return max(self.own, default=float("inf"))

    def says(self) -> str:
        return (f"{len(self.times)} Pings, slowest {self.slowest * 1000:.1f} ms of pled's own "
                f"({max(self.times, default=float('inf')) * 1000:.1f} ms as the client saw it)")


def live(pled) -> int:
    return run_pled("status", "--live", "--timeout", "5", "--socket", pled.socket, timeout=60).returncode


def test_pings_are_answered_within_a_second_while_a_member_sends_calls_of_escaped_quotes(tmp_path, sidecar, pleds):
    pled = start(tmp_path, {"t": sidecar(shards=2, rows=64)})
    pleds.append(pled)
    call = ESCAPED_QUOTES * ((protocol.MAX_CALL - 2) // 2) + b"\0"  # 65,535 bytes with its NUL: under the limit
    with Pinger(pled.socket, pled.pid) as pinger:
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
    print(f"{pinger.says()}; status --live exited {alive}")
    assert alive == 0
    assert len(pinger.times) > 10 and pinger.slowest <= PING_BUDGET, f"slowest Ping {pinger.slowest:.2f} s"
    assert not pinger.wrong, pinger.wrong[:3]


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
def test_pings_are_answered_within_100_ms_while_a_reload_reads_a_hostile_file(tmp_path, sidecar, pleds, case):
    """The reload reads the new table's headers and META.json in a child process of its own; the loop answers
    meanwhile, and the reload's refusal names the file."""
    good = sidecar(shards=2, rows=64)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    write, words = HOSTILE[case]
    write(bad)
    pled = start(tmp_path, {"t": good}, name="live")
    pleds.append(pled)
    (tmp_path / "live.toml").write_text((tmp_path / "live.toml").read_text() + f'\n[[table]]\nname = "u"\n'
                                        f'path = "{bad}"\n')
    with Pinger(pled.socket, pled.pid) as pinger:
        time.sleep(0.2)
        r = run_pled("reload", "--socket", pled.socket, timeout=600)
        alive = live(pled)
    print(f"{case}: {pinger.says()}; status --live exited {alive}")
    assert alive == 0
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    named = str(bad / ("META.json" if "META" in case else "shard_1.safetensors"))
    assert words in r.stderr and named in r.stderr, r.stderr[-2000:]
    assert len(pinger.times) > 5 and pinger.slowest < RELOAD_PING_BUDGET, f"slowest Ping {pinger.slowest:.3f} s"
    assert not pinger.wrong, pinger.wrong[:3]


# -- issue 44, finding 3: the largest input of each kind that pled accepts -----------------------------------------

def _fill(room: int, entry) -> list[bytes]:
    """``entry(i)`` for i = 0, 1, ... while their bytes fit in ``room``."""
    out, used = [], 0
    while len(e := entry(len(out))) + used <= room:
        out.append(e)
        used += len(e)
    return out


def _largest_index(d: Path, good: Path) -> dict:
    """A checkpoint whose model.safetensors.index.json is as large as pled reads (MAX_INDEX): its PLE tensors, then
    2.3 million other tensors' entries (a file pled never opens: only the PLE tensors' files are read)."""
    make_checkpoint(str(d), "bf16", {0: 1000}, width=64, parts=4, files=1)
    doc = json.dumps(json.loads((d / INDEX).read_bytes()), separators=(",", ":")).encode()
    assert doc.endswith(b"}}")
    raw = doc[:-2] + b"".join(_fill(MAX_INDEX - len(doc), lambda i: b',"x%d":"f"' % i)) + b"}}"
    assert MAX_INDEX - 16 < len(raw) <= MAX_INDEX
    (d / INDEX).write_bytes(raw)
    return {"checkpoint": d}


def _largest_header(d: Path, good: Path) -> dict:
    """A checkpoint file whose header is as large as pled reads (MAX_HEADER): a PLE table's shard tensors beside
    ~120,000 other one-byte tensors, every one of which pled parses, checks and keeps in the plan."""
    entry = len('"e100000":{"dtype":"U8","shape":[1],"data_offsets":[1000000,1000001]},')  # the longest one
    count, length = MAX_HEADER // entry, 0
    while not MAX_HEADER - 2 * entry < length <= MAX_HEADER:
        if length:
            count += (MAX_HEADER - entry - length) // entry
        extra = [(f"e{i}", "U8", (1,), np.zeros(1, np.uint8)) for i in range(count)]
        (path,) = make_checkpoint(str(d), "bf16", {0: 1000}, width=64, parts=4, files=1, index=False, extra=extra)
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
    assert count < MAX_TENSORS
    return {"checkpoint": d}


def _largest_meta(d: Path, good: Path) -> dict:
    """A sidecar whose META.json is as large as pled reads (MAX_META), of as many values as it takes (MAX_META // 8):
    its own keys, then a list of half a million numbers, a key pled keeps and shows (`pled inspect`)."""
    shutil.copytree(good, d)
    meta = json.loads((d / "META.json").read_bytes())
    doc = json.dumps(meta | {"notes": []}, separators=(",", ":")).encode()
    assert doc.endswith(b"[]}")
    numbers = _fill(min(MAX_META - len(doc), 8 * (MAX_META // 8 - 64)), lambda i: b"%d," % (1_000_000 + i))
    (d / "META.json").write_bytes(doc[:-2] + b"".join(numbers)[:-1] + b"]}")
    assert MAX_META - 64 * 8 - 16 < (d / "META.json").stat().st_size <= MAX_META
    return {"path": d}


def _largest_config(d: Path, good: Path) -> str:
    """A config as large as pled reads (MAX_CONFIG), lines within MAX_LINE: allow_uids of ~110,000 uids (a key a
    reload puts in force): the text to put before the config's first line."""
    head, tail = b"allow_uids = [\n", b"]\n"
    room = MAX_CONFIG - len(head) - len(tail) - 4096  # the rest of the config: its socket and tables
    per_line = (MAX_LINE - 16) // len(b"1000000, ")
    uids = _fill(room, lambda i: b"%d,%s" % (1_000_000 + i, b"\n" if i % per_line == per_line - 1 else b" "))
    return (head + b"".join(uids) + tail).decode()


def _largest_generic_header(d: Path, good: Path) -> dict:
    """A table of whole files (a generic safetensors file, no PLE layout) whose header is as large as pled reads
    (MAX_HEADER): ~120,000 one-byte tensors, each of which the region's manifest lists for clients."""
    entry = len('"e100000":{"dtype":"U8","shape":[1],"data_offsets":[1000000,1000001]},')  # the longest one
    count, length = MAX_HEADER // entry, 0
    d.mkdir()
    while not MAX_HEADER - 2 * entry < length <= MAX_HEADER:
        if length:
            count += (MAX_HEADER - entry - length) // entry
        write(str(d / "data.safetensors"), [(f"e{i}", "U8", (1,), b"\0") for i in range(count)])
        with open(d / "data.safetensors", "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
    assert count < MAX_TENSORS
    return {"path": d}


ACCEPTED = {  # the largest accepted input of each kind -> (its builder, the words the reload's answer holds)
    "an index of 2.3 million entries (32 MiB)": (_largest_index, "added: u"),
    "a shard header of 120,000 tensors (8 MiB)": (_largest_header, "added: u"),
    "a META.json of half a million values (4 MiB)": (_largest_meta, "added: u"),
    "a config of 110,000 allow_uids (1 MiB)": (_largest_config, "settings changed: allow_uids"),
}
# Not parsing but staging: a table of whole files whose header lists 120,000 tensors is a region whose manifest lists
# them all (10 MB of JSON, encoded twice by the staging thread, a million objects unpickled from the plan): about two
# seconds of CPU in pled's own threads, whose GIL the loop waits for. Measured with the collector kept off the plan
# (regions/parsing.py): slowest Pings of 30-50 ms of pled's own at a load average of 15 on two cores, 116 and 184 ms
# at 17 and 25 (979 ms before). Held to the one-second bound of the attacks above, not yet to 100 ms.
STAGED = {"a generic file's header of 120,000 tensors (8 MiB)": (_largest_generic_header, "added: u")}
BUDGET = dict.fromkeys(ACCEPTED, RELOAD_PING_BUDGET) | dict.fromkeys(STAGED, PING_BUDGET)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BUDGET))
def test_pings_are_answered_within_100_ms_while_a_reload_reads_the_largest_input_pled_accepts(tmp_path, sidecar,
                                                                                               pleds, case):
    """Issue 44's bound: the reload reads, plans (in a child process) and stages the largest index, header, META.json
    and config pled accepts; every Ping meanwhile is answered within 100 ms, and the reload succeeds."""
    good = sidecar(shards=2, rows=64)
    build, words = (ACCEPTED | STAGED)[case]
    new = build(tmp_path / "big", good)  # a table "u" to add, or the text to put before the config's first line
    pled = start(tmp_path, {"t": good}, name="live")
    pleds.append(pled)
    config = tmp_path / "live.toml"
    if isinstance(new, dict):
        write_config(config, {"t": good, "u": new}, socket=pled.socket, headroom_margin=0)
    else:
        config.write_text(new + config.read_text())
        assert MAX_CONFIG - 4096 < config.stat().st_size <= MAX_CONFIG
    with Pinger(pled.socket, pled.pid) as pinger:
        time.sleep(0.2)
        r = run_pled("reload", "--socket", pled.socket, timeout=600)
        time.sleep(0.2)  # the reload's end (its switch, its log lines) is the loop's too
        alive = live(pled)
    print(f"{case}: {pinger.says()}; status --live exited {alive}")
    assert r.returncode == 0 and words in r.stdout, (r.stdout, r.stderr[-2000:], pled.log()[-3000:])
    assert alive == 0
    assert not pinger.wrong, pinger.wrong[:3]
    assert len(pinger.times) > 5 and pinger.slowest < BUDGET[case], f"slowest Ping {pinger.slowest:.3f} s"


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
    with Pinger(pled.socket, pled.pid) as pinger:
        for f in floods:
            f.start()
        time.sleep(3)
        alive = live(pled)
        time.sleep(1)
        stop.set()
    for f in floods:
        f.join(60)
    print(f"{case}: {pinger.says()}; status --live exited {alive}")
    assert alive == 0
    assert len(pinger.times) > 10 and pinger.slowest <= PING_BUDGET, f"slowest Ping {pinger.slowest:.2f} s"
    assert not pinger.wrong, pinger.wrong[:3]
