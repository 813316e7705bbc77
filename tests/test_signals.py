"""Every asynchronous signal has a named action in a real `pled serve` (lifecycle.py's table): none of them
ends it silently with the default action, leaving its socket file behind and systemd without STOPPING=1."""
import os
import signal
from pathlib import Path

import pytest

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
