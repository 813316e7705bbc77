"""Soak: a daemon under a mix of misbehaving clients and a reload every few seconds, for a bounded time.

Misbehaving clients, each kind in its own thread, over and over: connect and vanish; attach and vanish before
reading the reply; send garbage (random bytes, deeply nested JSON, half a message); send calls and never read
the replies; leave an Attach reply stuck over a reload (just before the reload releasing table b, as many Pings
as pled's socket buffer takes replies for, then an Attach of b; after it, connect again to take b's fd number;
read all within pled's 5 s: any fd not b's sealed memfd, four seals and no writable mapping, is a breach).
Beside them well-behaved clients attach, compare a random shard's first, last and a random 4 KiB with its file,
and detach, counting every refusal and mismatch. Every few seconds the config alternates between one table and
two, and pled gets SIGHUP, so every other reload stages a table and the next one releases it. Afterwards pled's
RSS, fds and the host's Shmem are compared with before. A refusal, mismatch or breach fails the soak.

    python -m bench.soak --seconds 60            # on its own
    make bench                                   # as part of the full run (docs/BENCHMARKS.md)
"""
from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import random
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

from bench import report as bench_report

MiB = 1024**2
STUCK = "stuck reply over a reload"
KINDS = ("connect and vanish", "attach and vanish", "garbage", "half a message", "calls, never reads", STUCK)
STUCK_THREADS = 4
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def _meminfo(key: str) -> int:
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except FileNotFoundError:  # closed since the directory was listed: pled's clients come and go all the time
        return ""


def _proc(pid: int) -> dict:
    fds = os.listdir(f"/proc/{pid}/fd")
    memfds = sum(1 for fd in fds if _link(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"))
    status = {line.split(":")[0]: (line.split() + ["0", "0"])[1] for line in open(f"/proc/{pid}/status") if ":" in line}
    return {"rss": int(status["VmRSS"]) * 1024, "rss_shmem": int(status.get("RssShmem", 0)) * 1024, "fds": len(fds),
            "memfds": memfds, "shmem": _meminfo("Shmem")}


def _connect(path: str, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def _attacker(kind: str, path: str, stop: threading.Event, counts: dict) -> None:
    from pled.shared import protocol

    rng = random.Random(kind)
    held: list[socket.socket] = []
    while not stop.is_set():
        try:
            s = _connect(path)
            if kind == "attach and vanish":
                s.sendall(protocol.call(protocol.ATTACH, table="a"))
            elif kind == "garbage":
                junk = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))) + b"\0",
                        b'{"method":"io.pled.Ping","parameters":' + b"[" * 3000 + b"]" * 3000 + b"}\0",
                        b'{"method":"' + b"x" * 70000]
                s.sendall(rng.choice(junk))
            elif kind == "half a message":
                s.sendall(b'{"method": "io.pled.Sta')
                held.append(s)
            elif kind == "calls, never reads":
                s.setblocking(False)
                try:
                    for _ in range(200):
                        s.send(protocol.call(protocol.STATUS) * 50)
                except (BlockingIOError, OSError):
                    pass
                held.append(s)
            if s not in held:
                s.close()
            counts[kind] += 1
        except OSError:
            counts[kind + " (refused)"] = counts.get(kind + " (refused)", 0) + 1
        while len(held) > 20:
            held.pop(0).close()
        time.sleep(0.01)
    for s in held:
        s.close()


def _breach(fd: int, table: str) -> str | None:
    """Why ``fd`` is not what an Attach of ``table`` must carry (its sealed memfd); None when it is."""
    link = _link(f"/proc/self/fd/{fd}")
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if stat.S_ISREG(st.st_mode) else 0
        if not (link + " ").startswith(f"/memfd:pled:{table} ") or seals & SEALS != SEALS:
            return f"{link or fd}: mode {st.st_mode:o}, seals {seals:#x}"
        mmap.mmap(fd, st.st_size or 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()
    except OSError as err:  # the writable mapping refused (EPERM: sealed, EACCES: opened read-only): as it must be
        return None if isinstance(err, PermissionError) else f"{link or fd}: {err.strerror}"
    return f"{link}: a writable shared mapping"


def _waiting(s: socket.socket, most: float = 2.0, still: float = 0.5) -> int:
    """The bytes of replies waiting in ``s`` to be read, once they have not grown for ``still`` seconds."""
    sizes, end, n = [-1], time.monotonic() + most, int(still / 0.02)
    while time.monotonic() < end and (len(sizes) <= n or len(set(sizes[-n:])) > 1):
        sizes.append(struct.unpack("i", fcntl.ioctl(s.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
        time.sleep(0.02)
    return sizes[-1]


def _stuck(path: str, stop: threading.Event, counts: dict, found: dict, phase: dict, every: float, seed: int) -> None:
    """Attach replies of b left in pled's queue over the reload that releases b (see the top), fds checked."""
    from pled.shared import protocol

    rng = random.Random(seed)
    while not stop.is_set():
        n, t = phase["n"], phase["t"]  # odd n: table b is served, and the next reload releases it
        if n % 2 == 0 or time.monotonic() < t + every - 0.5 - 0.1 * rng.random():
            time.sleep(0.02)
            continue
        (fit, size), held = found["fit"], []
        try:
            s, struck = _connect(path), time.monotonic()
            s.sendall(protocol.call(protocol.PING) * fit + protocol.call(protocol.ATTACH, table="b"))
            if (waiting := _waiting(s)) != fit * size:  # the Attach reply went out, or waits behind a Ping's: tune
                found["fit"] = (fit + (1 if waiting > fit * size else -1), size)
            while phase["n"] == n and time.monotonic() < struck + 3.0:
                time.sleep(0.01)
            found["stuck"] += waiting == fit * size and phase["n"] != n
            for _ in range(4):  # clients arriving after the release: one of them takes b's fd number
                time.sleep(0.05)
                held.append(_connect(path))
            time.sleep(rng.uniform(0.0, max(0.0, struck + 4.2 - time.monotonic())))  # read within pled's 5 s
            got = 0
            while got <= fit and (received := socket.recv_fds(s, 65536, 16))[0]:
                got += received[0].count(b"\0")
                found["fds"] += len(received[1])
                for fd in received[1]:
                    if why := _breach(fd, "b"):
                        found["breaches"].append(why[:160])
                    os.close(fd)
            s.close()
            counts[STUCK] += 1
        except OSError:
            counts[STUCK + " (refused)"] = counts.get(STUCK + " (refused)", 0) + 1
        for h in held:
            h.close()


def _good_client(path: str, stop: threading.Event, result: dict) -> None:
    """Attach, compare a random shard's first and last 4 KiB and a random 4 KiB with its source file, detach."""
    from pled.client import attach

    rng = random.Random()
    while not stop.is_set():
        try:
            with (attach("a", socket=path, timeout=10, populate=False) as t,
                  open((sh := rng.choice(t.shards)).path, "rb") as f):
                for at, n in ((at, min(4096, sh.size - at))
                              for at in (0, max(0, sh.size - 4096), rng.randrange(sh.size))):
                    if t.buffer[sh.offset + at: sh.offset + at + n] != os.pread(f.fileno(), n, at):
                        result["mismatches"] += 1
                        result.setdefault("errors", []).append(f"bytes differ from {sh.path} at {at}")
            result["ok"] += 1
        except Exception as err:  # every refusal counts, whatever it is
            result["refused"] += 1
            result.setdefault("errors", []).append(f"{type(err).__name__}: {err}"[:200])
        time.sleep(0.02)


def _settle(pid: int, before: dict, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    now = _proc(pid)
    while time.monotonic() < deadline and (now["fds"] > before["fds"] or now["memfds"] > before["memfds"]):
        time.sleep(0.2)
        now = _proc(pid)
    return now


def run(work: Path, seconds: float = 120.0, reload_every: float = 3.0, good_clients: int = 2) -> dict:
    from pled import client
    from pled.generator import make_sidecar
    from pled.shared import protocol
    from tests.harness import start, write_config

    a, b = work / "soak-a", work / "soak-b"
    make_sidecar(str(a), "ples_int4", shards=4, rows=20_000)  # 8 MB
    make_sidecar(str(b), "ples_fp8", shards=2, rows=20_000)
    sock = str(work / "soak-run" / "pled.sock")
    one, two = {"a": a}, {"a": a, "b": b}
    pled = start(work, one, name="soak", socket=sock, wait=None)

    def configure(tables: dict) -> None:
        write_config(pled.config, tables, socket=sock, headroom_margin=0)

    try:
        pled.wait_ready(timeout=120)
        with client.attach("a", socket=sock):
            pass
        time.sleep(0.5)
        before = _proc(pled.pid)
        stop = threading.Event()
        counts = {k: 0 for k in KINDS}
        good = {"ok": 0, "refused": 0, "mismatches": 0}
        phase = {"n": 0, "t": time.monotonic()}  # reloads sent, and when the last was
        with _connect(sock) as s:  # how many Ping replies pled's socket buffer takes before the next waits in its queue
            s.sendall(protocol.call(protocol.PING) * 1000)
            fit = s.recv(waiting := _waiting(s, 4.0), socket.MSG_PEEK).count(b"\0")
        found = {"fit": (fit, waiting // max(fit, 1)), "stuck": 0, "fds": 0, "breaches": []}
        threads = [threading.Thread(target=_attacker, args=(k, sock, stop, counts), daemon=True) for k in KINDS[:-1]]
        threads += [threading.Thread(target=_stuck, args=(sock, stop, counts, found, phase, reload_every, i),
                                     daemon=True) for i in range(STUCK_THREADS)]
        threads += [threading.Thread(target=_good_client, args=(sock, stop, good), daemon=True)
                    for _ in range(good_clients)]
        for t in threads:
            t.start()
        reloads, peak_rss, peak_fds = 0, before["rss"], before["fds"]
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(reload_every)
            configure(two if reloads % 2 == 0 else one)
            pled.send_signal(signal.SIGHUP)
            reloads += 1
            phase.update(n=reloads, t=time.monotonic())
            now = _proc(pled.pid)
            peak_rss, peak_fds = max(peak_rss, now["rss"]), max(peak_fds, now["fds"])
        stop.set()
        for t in threads:
            t.join(30)
        if reloads % 2:  # leave the config as it began, and let that reload finish
            configure(one)
            pled.send_signal(signal.SIGHUP)
        time.sleep(2)
        after = _settle(pled.pid, before)
        st = client.call(protocol.STATUS, socket=sock)
        log_text = pled.log()
        return {
            "seconds": seconds, "reload_every_s": reload_every, "reloads": reloads,
            "reloads_done": log_text.count("reload done"), "reloads_failed": log_text.count("reload failed"),
            "misbehaving": counts, "good": {k: v for k, v in good.items() if k != "errors"},
            "good_errors": sorted(set(good.get("errors", [])))[:5],
            "stuck": {"replies_that_fit": fit, "tuned_to": found["fit"][0], "attach_replies_stuck": found["stuck"],
                      "fds_checked": found["fds"], "breaches": len(found["breaches"]),
                      "breach_examples": sorted(set(found["breaches"]))[:5]},
            "before": before, "after": after, "peak_rss": peak_rss, "peak_fds": peak_fds,
            "dropped_logged": log_text.count("dropping pid"), "alive": pled.poll() is None,
            "tables_after": [t["table"] for t in st["tables"]],
        }
    finally:
        pled.stop()


def report(s: dict) -> list[str]:
    """The soak's section of docs/BENCHMARKS.md."""
    b, a = s["before"], s["after"]
    misbehaving = ", ".join(f"{k} {v}" for k, v in s["misbehaving"].items())
    lines = ["## 7. Soak: misbehaving clients and reloads", "",
             f"{s['seconds']:.0f} s of misbehaving clients, one thread per kind, connections made: {misbehaving}; "
             f"beside them well-behaved clients attaching and reading, and SIGHUP every "
             f"{s['reload_every_s']:.0f} s alternating between one table and two ({s['reloads']} reloads: "
             f"{s['reloads_done']} done, {s['reloads_failed']} failed). pled logged {s['dropped_logged']} \"dropping\" "
             f"line(s) (at most one a minute per peer pid). Afterwards, with the misbehaving clients gone:", "",
             "| figure | before | peak | after |", "|---|---|---|---|",
             f"| pled RSS | {b['rss'] / MiB:.1f} MiB | {s['peak_rss'] / MiB:.1f} MiB | {a['rss'] / MiB:.1f} MiB |",
             f"| pled fds | {b['fds']} | {s['peak_fds']} | {a['fds']} |",
             f"| pled memfds | {b['memfds']} | | {a['memfds']} |",
             f"| host Shmem | {b['shmem'] / MiB:.1f} MiB | | {a['shmem'] / MiB:.1f} MiB |", "",
             f"Well-behaved attaches: {s['good']['ok']} served, {s['good']['refused']} refused"
             + (f" ({'; '.join(s['good_errors'])})" if s["good_errors"] else "")
             + (f", {s['good']['mismatches']} byte mismatches with the source files"
                if "mismatches" in s["good"] else "")
             + f"; pled {'still serving' if s['alive'] else 'NOT running'} afterwards."]
    if st := s.get("stuck"):
        lines += ["", f"Stuck replies over a reload ({STUCK_THREADS} threads): {st['replies_that_fit']} Ping replies "
                  f"fit in pled's socket buffer (tuned to {st['tuned_to']}); {st['attach_replies_stuck']} "
                  "Attach replies of a table waited in pled's queue over the reload releasing it; "
                  f"{st['breaches']} of the {st['fds_checked']} fds received were not its sealed memfd"
                  + (f" ({'; '.join(st['breach_examples'])})" if st["breach_examples"] else "") + "."]
    return lines


@bench_report.section
def section(res: dict) -> list[str] | None:
    return report(res["soak"]) if "soak" in res else None


@bench_report.verdict
def verdicts(res: dict) -> list[tuple[bool, str]] | None:
    s = res.get("soak")
    if not s:
        return None
    b, a, good, st = s["before"], s["after"], s["good"], s.get("stuck", {})
    out = [(s["alive"] and good["refused"] == good.get("mismatches", 0) == 0,
            f"soak: pled still serving, {good['refused']} of "
            f"{good['ok'] + good['refused']} well-behaved attaches refused"
            + (f", {good['mismatches']} byte mismatches with the source files" if "mismatches" in good else "")
            + " (target 0)"),
           (a["fds"] == b["fds"] and a["memfds"] == b["memfds"],
            f"soak: pled's fds {b['fds']} -> {a['fds']}, memfds {b['memfds']} -> {a['memfds']} "
            "(target: back where they started)")]
    if st:
        out.append((st["breaches"] == 0, f"soak: {st['breaches']} of {st['fds_checked']} fds sent over stuck Attach "
                    "replies not the table's sealed memfd (target 0)"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--reload-every", type=float, default=3.0)
    p.add_argument("--workdir", default="/var/tmp")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pled-soak-", dir=a.workdir))
    try:
        res = run(work, a.seconds, a.reload_every)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=2))
    print("\n".join(report(res)))
    good, stuck = res["good"], res["stuck"]
    return 0 if res["alive"] and good["refused"] == good["mismatches"] == stuck["breaches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
