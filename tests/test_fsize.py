"""RLIMIT_FSIZE (LimitFSIZE= in a unit, ulimit -f in a shell) below a region is refused by the preflight, 78.

A memfd is a file: its ftruncate and writes obey the limit, so without the check staging failed with EFBIG
("File too large") once listening and exited 1, which systemd restarts in a loop. Python ignores SIGXFSZ, so the
signal never killed it; the preflight now names the limit, the size needed and the fix, before copying a byte."""
import resource
import signal
import time

import pytest

from harness import Daemon, run_pled, write_config
from pled.daemon.memory import preflight
from pled.daemon.sources.sidecar import open_table
from pled.shared import region
from pled.shared.errors import EX_CONFIG, PreflightRefused
from pled.shared.sizes import gib

MiB = 1024**2


def _limit(nbytes: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))
    return apply


def _config(tmp_path, sidecar) -> tuple:
    """A config of one small table (2 shards of 64 rows), and its region's size (6 MiB: 2 MiB boundaries)."""
    table = sidecar("ples_int4", shards=2, rows=64)
    size = region.plan("t", open_table(str(table))).region_bytes
    return write_config(tmp_path / "pled.toml", {"t": table}, headroom_margin=0), size


def test_python_ignores_sigxfsz():
    """Why the failure was an exit 1 rather than a kill: Python sets SIGXFSZ to SIG_IGN at start."""
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN


def test_check_refuses_a_region_over_the_limit():
    v = preflight.check({"a": 2 * MiB, "b": 6 * MiB}, 0, "/nonexistent", fsize_limit=4 * MiB)
    assert not v.ok and v.file_size_limit == 4 * MiB
    assert "table b" in v.message and gib(6 * MiB) in v.message and gib(4 * MiB) in v.message
    assert "LimitFSIZE=" in v.message and "ulimit -f" in v.message
    assert v.as_dict()["file_size_limit_bytes"] == 4 * MiB
    with pytest.raises(PreflightRefused) as refused:
        v.raise_if_refused()
    assert (refused.value.needed, refused.value.available, refused.value.exit_status) == (6 * MiB, 4 * MiB, EX_CONFIG)
    assert preflight.check({"a": 6 * MiB}, 0, "/nonexistent", fsize_limit=None).ok  # RLIM_INFINITY
    assert preflight.check({"a": 6 * MiB}, 0, "/nonexistent", fsize_limit=6 * MiB).ok


@pytest.mark.daemon
def test_serve_refuses_a_file_size_limit_below_the_region(tmp_path, sidecar):
    cfg, size = _config(tmp_path, sidecar)
    started = time.monotonic()
    r = run_pled("serve", "-c", cfg, timeout=30, preexec_fn=_limit(size // 2))
    out = r.stdout + r.stderr
    assert r.returncode == EX_CONFIG, out
    assert time.monotonic() - started < 15
    assert gib(size) in out and gib(size // 2) in out and "LimitFSIZE=" in out, out
    assert "File too large" not in out


def test_preflight_command_reports_the_file_size_limit(tmp_path, sidecar):
    cfg, size = _config(tmp_path, sidecar)
    r = run_pled("preflight", "-c", cfg, timeout=30, preexec_fn=_limit(size // 2))
    assert r.returncode == EX_CONFIG, r.stdout + r.stderr
    assert gib(size) in r.stdout and gib(size // 2) in r.stdout and "ulimit -f" in r.stdout


@pytest.mark.daemon
def test_serve_starts_with_a_file_size_limit_above_the_region(tmp_path, sidecar):
    cfg, size = _config(tmp_path, sidecar)
    pled = Daemon(cfg, fsize=4 * size)
    try:
        pled.wait_ready(timeout=30)
    finally:
        rc = pled.stop()
    assert rc == 0, pled.log()
