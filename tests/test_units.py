"""The shipped systemd units: `systemd-analyze verify` clean, and the settings pled relies on present."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).parent.parent / "units"
PLED = str(Path(sys.executable).parent / "pled")
verify_tool = shutil.which("systemd-analyze")
needs_verify = pytest.mark.skipif(verify_tool is None, reason="systemd-analyze is not installed")


def systemd_version() -> int:
    out = subprocess.run([verify_tool, "--version"], capture_output=True, text=True).stdout
    return int(re.match(r"systemd (\d+)", out).group(1))


def settings(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def verify(unit_dir: Path, unit: str) -> str:
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:", "SYSTEMD_LOG_COLOR": "0"}
    r = subprocess.run([verify_tool, "verify", str(unit_dir / unit)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return (r.stdout + r.stderr).strip()


def installed(tmp_path: Path, drop_ins: bool = False) -> Path:
    """The units as an operator installs them, ExecStart pointing at this environment's pled."""
    text = (UNITS / "pled.service").read_text()
    assert "/usr/lib/pled/bin/pled serve" in text and "/usr/lib/pled/bin/pled reload" in text
    (tmp_path / "pled.service").write_text(text.replace("/usr/lib/pled/bin/pled", PLED))
    if drop_ins:
        shutil.copytree(UNITS / "pled.service.d", tmp_path / "pled.service.d")
    return tmp_path


@needs_verify
def test_pled_service_verifies_clean(tmp_path):
    assert verify(installed(tmp_path), "pled.service") == ""


@needs_verify
def test_preserve_drop_in_needs_systemd_254(tmp_path):
    out = verify(installed(tmp_path, drop_ins=True), "pled.service")
    if systemd_version() >= 254:
        assert out == ""
    else:  # older systemd ignores the one key it does not know, and says so
        assert out.count("\n") == 0 and "Unknown key 'FileDescriptorStorePreserve'" in out


@needs_verify
def test_vllm_drop_in_verifies_clean(tmp_path):
    installed(tmp_path)
    (tmp_path / "vllm.service").write_text("[Unit]\nDescription=vLLM\n[Service]\nExecStart=/bin/true\n")
    shutil.copytree(UNITS / "vllm.service.d", tmp_path / "vllm.service.d")
    assert verify(tmp_path, "vllm.service") == ""


def test_pled_service_has_what_pled_relies_on():
    s = settings(UNITS / "pled.service")
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    assert s["RestartPreventExitStatus"] == "78" and s["Restart"] == "on-failure"
    assert int(s["FileDescriptorStoreMax"]) >= 1 and s["WatchdogSec"] and s["RuntimeDirectory"] == "pled"
    assert s["MemorySwapMax"] == "0" and s["ProtectSystem"] == "strict"
    assert s["ExecStart"].endswith("pled serve") and s["ExecReload"].endswith("pled reload")
    assert s["User"] == "pled" and s["Group"] == "pled" and s["UMask"] == "0077"
    assert "ProcSubset" not in s  # it would hide /proc/meminfo, which the preflight reads
    d = settings(UNITS / "vllm.service.d" / "pled.conf")
    # Wants=, not Requires=: a restart or stop of pled must not restart or stop vLLM (systemd.unit(5)).
    assert d["Wants"] == "pled.service" and d["After"] == "pled.service" and "Requires" not in d and "BindsTo" not in d
    assert d["Environment"] == "PLED_SOCKET=/run/pled/pled.sock"
    # The unit's socket and the default socket agree.
    from pled.daemon import config

    assert config.DEFAULT_SOCKET == "/run/pled/pled.sock"


@needs_verify
def test_sandbox_exposure_is_at_most_1_5():
    """The figure the README and the operations guide state; `--offline=true` needs systemd 250 or newer."""
    if systemd_version() < 250:
        pytest.skip("systemd-analyze security --offline needs systemd 250")
    r = subprocess.run([verify_tool, "security", "--offline=true", "--no-pager", str(UNITS / "pled.service")],
                       capture_output=True, text=True, env={**os.environ, "SYSTEMD_COLORS": "0"}, timeout=120)
    figure = float(re.search(r"Overall exposure level for pled.service: ([\d.]+)", r.stdout).group(1))
    assert figure <= 1.5, r.stdout
    for doc in ("README.md", "docs/operations.md"):
        assert f"exposure {figure}" in (UNITS.parent / doc).read_text(), doc


def test_sysusers_creates_user_and_group_pled(tmp_path):
    tool = shutil.which("systemd-sysusers")
    if tool is None:
        pytest.skip("systemd-sysusers is not installed")
    (tmp_path / "etc").mkdir()
    r = subprocess.run([tool, f"--root={tmp_path}", str(UNITS / "pled.sysusers.conf")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    passwd = (tmp_path / "etc/passwd").read_text().splitlines()
    group = (tmp_path / "etc/group").read_text().splitlines()
    pled, = (line.split(":") for line in passwd if line.startswith("pled:"))
    gid, = (line.split(":")[2] for line in group if line.startswith("pled:"))
    assert pled[3] == gid and int(pled[2]) < 1000  # a system user whose primary group is pled
