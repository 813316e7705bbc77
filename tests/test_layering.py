"""The layering is a rule a test checks, not only a sentence in docs/ARCHITECTURE.md: import-linter's contracts in
pyproject.toml ([tool.importlinter]): clients never import daemon code, the daemon never imports torch, what the
two share imports neither, the daemon's modules keep their layers (its wings, pled/daemon/*/, below the modules that
tie them together), each wing imports only what its contract allows, and no import circle exists in pled."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept():
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        exe = shutil.which("lint-imports")
        if exe is None:
            pytest.fail("lint-imports not installed: pip install 'pled[test]' (import-linter)")
    # This checkout's pled, whatever an editable install elsewhere points at.
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([str(exe), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout and "Contracts: 12 kept" in r.stdout, r.stdout[-2000:]
    assert str(ROOT) in subprocess.run([sys.executable, "-c", "import pled; print(pled.__file__)"], env=env,
                                       capture_output=True, text=True, cwd="/").stdout
