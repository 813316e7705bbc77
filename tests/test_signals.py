"""Every asynchronous signal has a named action in a real `pled serve` (lifecycle.py's table): none of them
ends it silently with the default action, leaving its socket file behind and systemd without STOPPING=1; and once
it has handled them, an idle pled sleeps."""
import os
import signal
from pathlib import Path

import pytest

from harness import stays_false
from pled import client


def signal_mask(pid: int, field: str) -> set[int]:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_every_asynchronous_signal_is_caught_or_ignored_and_faults_keep_their_default(daemon, sidecar):
    pled = daemon({"t": sidecar(shards=2, rows=256)})
    caught = signal_mask(pled.pid, "SigCgt")
    for name in ("SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM"):
        assert getattr(signal, name) in caught, name
    assert signal.SIGPIPE in signal_mask(pled.pid, "SigIgn")  # Python's own doing
    faults = () if os.environ.get("PYTHONFAULTHANDLER") else ("SIGBUS", "SIGSEGV", "SIGFPE", "SIGILL")
    for name in (*faults, "SIGTSTP", "SIGCONT"):
        assert getattr(signal, name) not in caught, name


@pytest.mark.parametrize("sig, line", [
    (signal.SIGUSR1, "SIGUSR1: status: serving 1 table(s)"),
    (signal.SIGUSR2, "SIGUSR2: ignored (pled gives it no meaning)"),
    (signal.SIGALRM, "SIGALRM: ignored (pled gives it no meaning)"),
])
def test_a_signal_with_no_stop_is_logged_and_pled_goes_on_serving(daemon, sidecar, sig, line):
    pled = daemon({"t": sidecar(shards=2, rows=256)})
    pled.proc.send_signal(sig)
    pled.wait_for(line, timeout=10)
    with client.attach("t", socket=pled.socket, timeout=5) as t:
        assert t.generation == 1
    assert pled.proc.poll() is None
    assert pled.stop() == 0


def test_sigquit_stops_pled_as_sigterm_does(daemon, sidecar):
    pled = daemon({"t": sidecar(shards=2, rows=256)})
    pled.proc.send_signal(signal.SIGQUIT)
    assert pled.proc.wait(timeout=10) == 0, pled.log()
    log = pled.log()
    assert "SIGQUIT: stopping" in log and "stopped: released 1 table(s)" in log
    assert not Path(pled.socket).exists()


def cpu_seconds(pid: int) -> float:
    """The CPU time ``pid`` has used, all its threads, user and system (utime + stime in /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command, which may hold spaces and parentheses
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_pled_sleeps_when_idle_after_every_signal_it_handles(daemon, sidecar):
    """After SIGHUP (a reload), SIGUSR1, SIGUSR2 and SIGALRM, each handled and logged, an idle pled sleeps: over 2 s
    its CPU time grows by far less than 0.2 s. Its loop hears of a signal, and of a worker thread's event, through a
    pipe it reads empty each time; a pipe left unread wakes it at once every turn, for good: a core's worth, about a
    second of CPU a second (a bound of a tenth of that stays clear of both, however busy the machine)."""
    pled = daemon({"t": sidecar(shards=2, rows=256)})
    assert pled.reload() == "reload done"
    for sig, line in [(signal.SIGUSR1, "SIGUSR1: status: serving 1 table(s)"),
                      (signal.SIGUSR2, "SIGUSR2: ignored"), (signal.SIGALRM, "SIGALRM: ignored")]:
        pled.send_signal(sig)
        pled.wait_for(line, timeout=10)
    with client.attach("t", socket=pled.socket, timeout=5) as t:
        assert t.generation == 1
    began = cpu_seconds(pled.pid)
    stays_false(lambda: (used := cpu_seconds(pled.pid) - began) >= 0.2 and used, 2.0,
                "pled used this much CPU in under 2 s of idling (a wakeup left unread spins its loop)")
    assert pled.stop() == 0
