"""vLLM's PLE offload worker, played exactly as the Flash-Next builds run it (bench/ple_offload_worker.py):
a parent with PLED_SOCKET in its environment that imports nothing of pled spawns two workers
(multiprocessing's spawn: fresh interpreters that never load vLLM's plugins), which read a published-form
sidecar with ``from safetensors import safe_open``. pled reaches them only through its start-up hook,
``pled-autoload.pth``, so pled is installed here the way an operator installs it: a wheel built from this
tree, ``pip install``ed (not editable) into a scratch virtual environment that sees the vLLM environment's
packages (torch, safetensors) through a path .pth. No PYTHONPATH: the workers import the installed pled.

Skipped, with the reason, where .venv-vllm is missing (make test builds it).
"""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import LAYOUTS, run_pled
from pled.shared import dequant
from pled.shared.pagecache import cached_bytes
from pled.daemon.safetensors_file import read_header

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORKER = ROOT / "bench" / "ple_offload_worker.py"
MiB = 1024 * 1024
ROWS, SHARDS = 60_000, 4  # 21-39 MB a table: a private copy of it would show in Shmem
CHECK = [0, 1, ROWS - 1, ROWS, 2 * ROWS + 12_345, SHARDS * ROWS - 1]

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm: run `make test` (it builds it) or `make vllm-env`")


def scratch_venv(where: Path, *install: str) -> Path:
    """A venv of the vLLM environment's interpreter, seeing that environment's packages, with pled installed by pip."""
    subprocess.run([str(VLLM_PYTHON), "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    vllm_site = subprocess.run([str(VLLM_PYTHON), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_pled_test_vllm_env.pth").write_text(vllm_site + "\n")  # a path line: torch, safetensors
    r = subprocess.run([str(VLLM_PYTHON), "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                        "--no-build-isolation", *install], capture_output=True, text=True, timeout=600, env=clean_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return python


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLED_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env | {"OMP_NUM_THREADS": "1"} | extra


@pytest.fixture(scope="module")
def hook_python(tmp_path_factory) -> Path:
    """pled installed from a wheel of this tree with a plain `pip install`."""
    wheels = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([str(VLLM_PYTHON), "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=600, env=clean_env())
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = wheels.glob("pled-*.whl")
    return scratch_venv(tmp_path_factory.mktemp("venv") / "v", str(wheel))


def shmem() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Shmem:"))


def drop_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def expected_rows(d: Path, layout: str) -> np.ndarray:
    """An independent dequantization: the files read with numpy, pled.shared.dequant's reference formulas."""
    out = []
    for gid in CHECK:
        h = read_header(str(d / f"shard_{gid // ROWS}.safetensors"))
        raw = np.fromfile(h.path, dtype=np.uint8)
        tensors = {t.name: dequant.view(raw, t.begin, t.dtype, t.shape)
                   for t in h.tensors}
        out.append(dequant.dequant_rows(layout, tensors, np.array([gid % ROWS]))[0])
    return np.array(out)


def start_workers(python: Path, d: Path, env: dict, check=CHECK) -> subprocess.Popen:
    return subprocess.Popen([str(python), str(WORKER), str(d), "--workers", "2", "--check", ",".join(map(str, check)),
                             "--hold"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd="/")


def reports_until_holding(proc: subprocess.Popen) -> list[dict]:
    reports = []
    for line in proc.stdout:
        if line.startswith("HOLDING"):
            return reports
        reports.append(json.loads(line))
    raise AssertionError(f"the workers ended without holding: {reports}\n{proc.stderr.read()[-4000:]}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_spawned_offload_workers_read_the_table_from_pled(hook_python, sidecar, daemon, layout):
    d = sidecar(layout, shards=SHARDS, rows=ROWS)
    files = sorted(str(p) for p in d.glob("*.safetensors"))
    pled = daemon({layout: d})
    drop_cache(files)
    assert [cached_bytes(f) for f in files] == [0] * len(files)
    before = shmem()
    proc = start_workers(hook_python, d, clean_env(PLED_SOCKET=pled.socket))
    try:
        reports = reports_until_holding(proc)
        grown = shmem() - before
        status = run_pled("status", "--socket", pled.socket).stdout
        cached = [cached_bytes(f) for f in files]
    finally:
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(timeout=120)
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr[-4000:]
    assert len(reports) == 2 and all("error" not in r for r in reports), reports
    for r in reports:
        assert r["opened_as"] == ["PledSafeOpen"]
        # Every tensor the worker kept is a view of pled's sealed memfd; no shard file is mapped.
        assert r["tensors_backed_by"] == [f"/memfd:pled:{layout} (deleted)"], r["tensors_backed_by"]
        assert r["shard_files_mapped"] == []
        np.testing.assert_allclose(np.array(r["rows"], dtype=np.float32), expected_rows(d, layout), rtol=1e-6, atol=0)
        assert f"pled: pid {r['pid']} mapped table {layout} (generation 1): {SHARDS} of {SHARDS} files" in stderr
        assert str(r["pid"]) in status  # pled status lists both workers as clients
    assert "through safe_open" in stderr
    assert cached == [0] * len(files)  # the shard files were never read
    assert grown < 16 * MiB, f"Shmem grew by {grown / MiB:.1f} MiB"


def test_a_dead_socket_fails_the_load_naming_pled_and_the_fallback_reads_the_files(hook_python, sidecar, tmp_path):
    d = sidecar("ples_nvfp4", shards=2, rows=1000)
    dead = str(tmp_path / "nothing-here.sock")
    proc = start_workers(hook_python, d, clean_env(PLED_SOCKET=dead), check=[0, 1999])
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(reports) == 2
    for r in reports:
        assert r["error"].startswith(f"PledUnavailable: pled: configured by PLED_SOCKET ({dead}) but cannot attach")
        assert "PLED_FALLBACK=disk" in r["error"]
    proc = start_workers(hook_python, d, clean_env(PLED_SOCKET=dead, PLED_FALLBACK="disk"), check=[0, 1999])
    out, err = proc.communicate("\n", timeout=300)
    assert proc.returncode == 0, err[-4000:]
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["opened_as"] for r in reports] == [["safe_open"]] * 2  # safetensors' own: the files were read
    assert all(r["shard_files_mapped"] for r in reports)
    assert err.count(f"WARNING pled: configured by PLED_SOCKET ({dead}) but cannot attach") == 2
    assert 'reading from disk instead (fallback = "disk")' in err


def test_the_hook_is_inert_without_pled_socket_and_off_with_autoload_0(hook_python):
    probe = "import sys; import safetensors; print(sorted(m for m in sys.modules if m.split('.')[0] == 'pled'), " \
            "getattr(safetensors.safe_open, '__pled__', False))"
    runs = {name: subprocess.run([str(hook_python), "-c", probe], capture_output=True, text=True, env=env, cwd="/")
            for name, env in {"unset": clean_env(), "on": clean_env(PLED_SOCKET="/nonexistent"),
                              "off": clean_env(PLED_SOCKET="/nonexistent", PLED_AUTOLOAD="0")}.items()}
    assert all(r.returncode == 0 and r.stderr == "" for r in runs.values()), runs
    assert runs["unset"].stdout.strip() == "[] False"  # nothing of pled imported where PLED_SOCKET is unset
    assert runs["off"].stdout.strip() == "[] False"
    on = runs["on"].stdout.strip()
    assert on.endswith("True") and "'pled.autoload'" in on
    assert "'pled.client.held_files'" not in on  # what serves files is imported when a file is asked for, not at start-up


def test_a_broken_hook_is_one_line_and_the_interpreter_starts(hook_python, tmp_path):
    broken = tmp_path / "broken" / "pled"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise RuntimeError('this pled is broken')\n")
    r = subprocess.run([str(hook_python), "-c", "print('started')"], capture_output=True, text=True, cwd="/",
                       env=clean_env(PLED_SOCKET="/x", PYTHONPATH=str(broken.parent)))
    assert r.returncode == 0 and r.stdout == "started\n"
    assert r.stderr.splitlines() == ["pled: start-up hook not loaded (RuntimeError: this pled is broken); "
                                     "set PLED_AUTOLOAD=0 to silence this"]
    (broken / "__init__.py").write_text("")  # a pled whose autoload imports, but whose plugin does not
    (broken / "autoload.py").write_text((ROOT / "pled" / "autoload.py").read_text())
    (broken / "client").mkdir()
    (broken / "client" / "__init__.py").write_text("")
    (broken / "client" / "vllm_plugin.py").write_text("raise ImportError('no plugin here')\n")
    r = subprocess.run([str(hook_python), "-c", "print('started')"], capture_output=True, text=True, cwd="/",
                       env=clean_env(PLED_SOCKET="/x", PYTHONPATH=str(broken.parent)))
    assert r.returncode == 0 and r.stdout == "started\n"
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("pled: start-up hook failed (ImportError: no plugin here)")


def test_an_editable_install_carries_the_hook_too(tmp_path):
    """The shared development environments install pled with `pip install -e`: the hook is written there too."""
    python = scratch_venv(tmp_path / "v", "-e", str(ROOT))
    r = subprocess.run([str(python), "-c", "import sys, pled, safetensors; print(pled.__file__, safetensors.safe_open.__pled__)"],
                       capture_output=True, text=True, cwd="/", env=clean_env(PLED_SOCKET="/nonexistent"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(ROOT / "pled" / "__init__.py"), "True"]
