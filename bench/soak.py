"""Soak: a daemon under a mix of misbehaving clients and a reload every few seconds, for a bounded time.

Misbehaving clients, each kind in its own thread, over and over: connect and vanish; attach and vanish
before reading the reply; send garbage (random bytes, deeply nested JSON, half a message); send calls and
never read the replies. Beside them well-behaved clients attach, read a row's bytes and detach, and count
every refusal. Every few seconds the config alternates between one table and two, and pled gets SIGHUP,
so every other reload stages a table and the next one releases it. Afterwards pled's RSS, its fd count and
the host's Shmem are compared with what they were before.

    python -m bench.soak --seconds 60            # on its own
    make bench                                   # as part of the full run (docs/BENCHMARKS.md)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import report as bench_report

MiB = 1024**2
KINDS = ("connect and vanish", "attach and vanish", "garbage", "half a message", "calls, never reads")


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


def _good_client(path: str, stop: threading.Event, result: dict) -> None:
    from pled.client import attach

    while not stop.is_set():
        try:
            with attach("a", socket=path, timeout=10, populate=False) as t:
                first = t.shards[0]
                bytes(t.buffer[first.offset: first.offset + 4096])
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
    from pled.shared import protocol
    from pled.generator import make_sidecar

    a, b = work / "soak-a", work / "soak-b"
    make_sidecar(str(a), "ples_int4", shards=4, rows=20_000)  # 8 MB
    make_sidecar(str(b), "ples_fp8", shards=2, rows=20_000)
    sock = str(work / "soak-run" / "pled.sock")
    cfg = work / "soak.toml"
    one = f'socket = "{sock}"\nheadroom_margin = 0\n[[table]]\nname = "a"\npath = "{a}"\n'
    two = one + f'[[table]]\nname = "b"\npath = "{b}"\n'
    cfg.write_text(one)
    log_path = work / "soak.log"
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "JOURNAL_STREAM")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pled", "serve", "-c", str(cfg)], stderr=log,
                                stdout=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 120
        while "ready:" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pled did not start:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.05)
        with client.attach("a", socket=sock):
            pass
        time.sleep(0.5)
        before = _proc(proc.pid)
        stop = threading.Event()
        counts = {k: 0 for k in KINDS}
        good = {"ok": 0, "refused": 0}
        threads = [threading.Thread(target=_attacker, args=(k, sock, stop, counts), daemon=True) for k in KINDS]
        threads += [threading.Thread(target=_good_client, args=(sock, stop, good), daemon=True) for _ in range(good_clients)]
        for t in threads:
            t.start()
        reloads, peak_rss, peak_fds = 0, before["rss"], before["fds"]
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(reload_every)
            cfg.write_text(two if reloads % 2 == 0 else one)
            proc.send_signal(signal.SIGHUP)
            reloads += 1
            now = _proc(proc.pid)
            peak_rss, peak_fds = max(peak_rss, now["rss"]), max(peak_fds, now["fds"])
        stop.set()
        for t in threads:
            t.join(30)
        if reloads % 2:  # leave the config as it began, and let that reload finish
            cfg.write_text(one)
            proc.send_signal(signal.SIGHUP)
        time.sleep(2)
        after = _settle(proc.pid, before)
        st = client.call(protocol.STATUS, socket=sock)
        log_text = log_path.read_text()
        return {
            "seconds": seconds, "reload_every_s": reload_every, "reloads": reloads,
            "reloads_done": log_text.count("reload done"), "reloads_failed": log_text.count("reload failed"),
            "misbehaving": counts, "good": {k: v for k, v in good.items() if k != "errors"},
            "good_errors": sorted(set(good.get("errors", [])))[:5],
            "before": before, "after": after, "peak_rss": peak_rss, "peak_fds": peak_fds,
            "dropped_logged": log_text.count("dropping pid"), "alive": proc.poll() is None,
            "tables_after": [t["table"] for t in st["tables"]],
        }
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


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
             + f"; pled {'still serving' if s['alive'] else 'NOT running'} afterwards."]
    return lines


@bench_report.section
def section(res: dict) -> list[str] | None:
    return report(res["soak"]) if "soak" in res else None


@bench_report.verdict
def verdicts(res: dict) -> list[tuple[bool, str]] | None:
    s = res.get("soak")
    if not s:
        return None
    b, a = s["before"], s["after"]
    return [(s["alive"] and s["good"]["refused"] == 0,
             f"soak: pled still serving, {s['good']['refused']} of {s['good']['ok'] + s['good']['refused']} "
             "well-behaved attaches refused (target 0)"),
            (a["fds"] == b["fds"] and a["memfds"] == b["memfds"],
             f"soak: pled's fds {b['fds']} -> {a['fds']}, memfds {b['memfds']} -> {a['memfds']} (target: back where they started)")]


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
    return 0 if res["alive"] and res["good"]["refused"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
