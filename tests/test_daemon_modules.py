"""The daemon is split by concern (issue 15's first bullet, done with issue 11): each module stays readable,
and `pled preflight` reaches its helpers without importing the daemon, the server or staging."""
import subprocess
import sys
from pathlib import Path

PLED = Path(__file__).resolve().parent.parent / "pled"


def test_preflight_imports_no_daemon_code():
    code = ("import sys, pled.cli, pled.planning; "
            "print(' '.join(m for m in ('pled.daemon', 'pled.server', 'pled.staging', 'pled.stager') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_daemon_modules_stay_small():
    for name in ("daemon", "loop", "stager", "reload", "handlers", "tables", "planning", "server", "connection",
                 "listener", "boundary", "fdlimit"):
        lines = len((PLED / f"{name}.py").read_text().splitlines())
        assert lines <= 350, f"pled/{name}.py has {lines} lines"
