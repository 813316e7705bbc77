"""The daemon is split by concern (issue 15's first bullet, done with issue 11): each module stays readable,
and `pled preflight` reaches its helpers without importing the daemon, the server or staging."""
import subprocess
import sys
from pathlib import Path

PLED = Path(__file__).resolve().parent.parent / "pled"


def test_preflight_imports_no_daemon_code():
    code = ("import sys, pled.cli, pled.daemon.regions.planning; "
            "print(' '.join(m for m in ('pled.daemon.lifecycle', 'pled.daemon.serving.server', "
            "'pled.daemon.regions.staging', 'pled.daemon.stager') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_modules_stay_small():
    """No module much over 350 lines: a module per concern, each readable at one sitting."""
    sizes = {str(p.relative_to(PLED.parent)): len(p.read_text().splitlines()) for p in PLED.rglob("*.py")}
    assert len(sizes) > 40
    big = {name: n for name, n in sizes.items() if n > 350}
    assert not big, big
