"""`pled gpu-check` (issue 45 item 3) against a real `pled serve`: a read-only table and a writable one whose writers
name this uid, both real checkpoint tables.

On this machine (no GPU) the real command lists the tables and exits 4, saying so. The route lines are shown with
the CUDA runtime FAKED (tests/fakecuda.py: the device's attributes and registration results), in process, through
the same run() the command calls: the registrations it makes for a table's first page are real calls into the fake,
released afterwards.
"""
import gc
import os
import subprocess
import sys

import pytest

from fakecuda import RO_OK, FakeCuda
from pled.client import gpu
from pled.client.gpu import check, registry
from pled.generator import make_checkpoint

pytestmark = [pytest.mark.daemon]
torch = pytest.importorskip("torch")
BARE = {99: 1, 113: 0, 88: 0, 100: 0, 91: 1}
ATS = {99: 1, 113: 0, 88: 1, 100: 1, 91: 1}


@pytest.fixture
def served(tmp_path, daemon):
    for name in ("ro", "rw"):
        make_checkpoint(str(tmp_path / name), "fp8", {0: 600}, width=64, parts=2, files=1)
    return daemon({"ro": {"checkpoint": str(tmp_path / "ro")},
                   "rw": {"checkpoint": str(tmp_path / "rw"), "gpu_access": "writable", "writers": [os.geteuid()],
                          "verify_interval": 3600}})


def gpu_check(*args, **env):
    return subprocess.run([sys.executable, "-m", "pled", "gpu-check", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_without_a_gpu_it_lists_the_tables_says_so_and_exits_4(served, tmp_path):
    done = gpu_check("--socket", served.socket)
    assert done.returncode == check.EX_NO_DEVICE == 4, done.stderr
    assert f"table ro: gpu_access = \"read-only\", routes read-only, pageable, writable; uid {os.geteuid()} is not " \
           "a writer" in done.stdout
    assert f"table rw: gpu_access = \"writable\", routes read-only, pageable, writable; uid {os.geteuid()} is one of " \
           "its writers" in done.stdout
    assert "no CUDA device in this process" in done.stdout and "(exit 4)" in done.stdout
    gone = gpu_check("--socket", str(tmp_path / "nobody.sock"))
    assert gone.returncode == 3 and "nobody.sock" in gone.stdout


@pytest.mark.parametrize("attrs, fail, routes, code", [
    (RO_OK, {}, {"ro": "read-only", "rw": "read-only"}, 0),
    ({**ATS, 113: 1}, {0x0A: 801}, {"ro": "pageable", "rw": "pageable"}, 0),
    (BARE, {}, {"ro": None, "rw": "writable"}, 1),
])
def test_each_table_s_route_on_each_device_and_why(served, capsys, monkeypatch, attrs, fail, routes, code):
    fake = FakeCuda(attrs, fail)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: fake.pinned(self.untyped_storage()
                                                                                          .data_ptr()))
    with gpu.use(fake):
        assert check.run(served.socket) == code
        out = capsys.readouterr().out
        assert "device 0 (FakeGPU): host registration yes (99)" in out and "driver 13.0, runtime 12.8" in out
        for table, route in routes.items():
            if route is None:
                assert f"  table {table}: NO ROUTE: pled: device 0 (FakeGPU) cannot read table {table}'s first " \
                       "page" in out and "gpu_access = \"writable\" with writers" in out, out
            else:
                assert f"  table {table}: {gpu.routes.NAMES[route]}" in out, out
        if fail:
            assert "(passed over: read-only registration: cudaHostRegister(Mapped|ReadOnly) of table ro's first " \
                   "page" in out and "operation not supported (error 801)" in out, out
        gc.collect()
        assert not registry.registrations.held and not fake.ranges  # every trial registration released
