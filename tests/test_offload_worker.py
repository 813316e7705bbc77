"""vLLM's PLE offload worker, played exactly as the Flash-Next builds run it (bench/ple_offload_worker.py):
a parent with PLED_SOCKET in its environment that imports nothing of pled spawns two workers
(multiprocessing's spawn: fresh interpreters that never load vLLM's plugins), which read a published-form
sidecar with ``from safetensors import safe_open``, on sidecars of the published shape (2,500,012 rows a shard,
width 160; one or two shards stand in for the published 128, the worker told the model's rows accordingly), since
the worker, like the published one, refuses any other shape. pled reaches them only through its start-up hook,
``pled-autoload.pth``, so pled is installed here the way an operator installs it: a wheel built from this
tree, ``pip install``ed (not editable) into a scratch virtual environment that sees the vLLM environment's
packages (torch, safetensors) through a path .pth. No PYTHONPATH: the workers import the installed pled.

The published-shape sidecars (about 0.9 GB in all) are made once for the module and deleted at its end.

Skipped, with the reason, where .venv-vllm is missing (make test builds it).
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from harness import LAYOUTS, run_pled
from pled.daemon.sources.safetensors_file import read_header
from pled.generator import make_sidecar
from pled.shared import dequant
from pled.shared.layouts import PUBLISHED_ROWS_PER_SHARD, PUBLISHED_WIDTH
from pled.shared.pagecache import cached_bytes

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORKER = ROOT / "bench" / "ple_offload_worker.py"
MiB = 1024 * 1024
ROWS = PUBLISHED_ROWS_PER_SHARD  # what the worker hard-codes
# Shards of the published shape per layout: int4's two (240 MB each) cross a shard boundary; nvfp4 (215 MB) and
# fp8 (390 MB, the slowest to make) one each. A private copy of any would show in the workers' shmem (shmem_besides).
SHARDS = {"ples_int4": 2, "ples_nvfp4": 1, "ples_fp8": 1}


def check_ids(shards: int) -> list[int]:
    """Global ids at each shard's edges and inside it."""
    return [s * ROWS + r for s in range(shards) for r in (0, 1, 12_345, ROWS - 1)]

pytestmark = pytest.mark.vllm


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


def shmem_besides(pid: int, table: str) -> int:
    """The shared memory process ``pid`` has resident in its mappings (RssShmem), less its mappings of pled's memfd
    of ``table``: any copy of the table in shared memory it made or was handed. Not the host's Shmem (meminfo),
    which every other process on the host moves: it grew 18 MiB under a busy host's load, none of it the workers'."""
    with open(f"/proc/{pid}/status") as f:
        rss_shmem = next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssShmem:"))
    pled_rss, in_pled = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and not head[0].endswith(":"):  # a mapping's first line: its range, ..., its name
                in_pled = len(head) > 5 and head[5] == f"/memfd:pled:{table}"
            elif in_pled and head[0] == "Rss:":
                pled_rss += int(head[1]) * 1024
    return rss_shmem - pled_rss


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """layout -> a sidecar of the published shape (SHARDS[layout] shards of 2,500,012 rows, width 160), made on
    first use and shared by the module's tests; deleted at the module's end (pytest keeps tmp dirs otherwise)."""
    root = tmp_path_factory.mktemp("published")
    made: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in made:
            d = root / layout
            make_sidecar(str(d), layout, shards=SHARDS[layout], rows=ROWS, width=PUBLISHED_WIDTH, seed=7)
            made[layout] = d
        return made[layout]

    yield get
    shutil.rmtree(root, ignore_errors=True)


def drop_cache(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)  # pages still dirty from the writing are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def expected_rows(d: Path, layout: str, check: list[int]) -> np.ndarray:
    """An independent dequantization: the files read with numpy, pled.shared.dequant's reference formulas."""
    out = []
    for gid in check:
        h = read_header(str(d / f"shard_{gid // ROWS}.safetensors"))
        raw = np.memmap(h.path, dtype=np.uint8, mode="r")
        tensors = {t.name: dequant.view(raw, t.begin, t.dtype, t.shape)
                   for t in h.tensors}
        out.append(dequant.dequant_rows(layout, tensors, np.array([gid % ROWS]))[0])
    return np.array(out)


def start_workers(python: Path, d: Path, env: dict, check: list[int], model_rows: int) -> subprocess.Popen:
    """Two workers, told the model's rows (the shards here stand in for the published 128)."""
    return subprocess.Popen([str(python), str(WORKER), str(d), "--model-rows", str(model_rows), "--workers", "2",
                             "--check", ",".join(map(str, check)), "--hold"], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")


def reports_until_holding(proc: subprocess.Popen) -> list[dict]:
    reports = []
    for line in proc.stdout:
        if line.startswith("HOLDING"):
            return reports
        reports.append(json.loads(line))
    raise AssertionError(f"the workers ended without holding: {reports}\n{proc.stderr.read()[-4000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_spawned_offload_workers_read_the_table_from_pled(hook_python, published, daemon, layout):
    d, shards = published(layout), SHARDS[layout]
    check = check_ids(shards)
    files = sorted(str(p) for p in d.glob("*.safetensors"))
    pled = daemon({layout: d})
    drop_cache(files)
    assert [cached_bytes(f) for f in files] == [0] * len(files)
    proc = start_workers(hook_python, d, clean_env(PLED_SOCKET=pled.socket), check, shards * ROWS)
    try:
        reports = reports_until_holding(proc)
        besides = {r["pid"]: shmem_besides(r["pid"], layout) for r in reports if "pid" in r}
        besides[proc.pid] = shmem_besides(proc.pid, layout)  # the parent that spawned them
        print(f"shmem besides pled's memfd, by pid: {besides}")
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
        np.testing.assert_allclose(np.array(r["rows"], dtype=np.float32), expected_rows(d, layout, check), rtol=1e-6,
                                   atol=0)
        assert f"pled: pid {r['pid']} mapped table {layout} (generation 1): {shards} of {shards} files" in stderr
        assert str(r["pid"]) in status  # pled status lists both workers as clients
    assert "through safe_open" in stderr
    assert cached == [0] * len(files)  # the shard files were never read
    # No copy of the table in shared memory in the workers or their parent (a table is 215-480 MB): what they hold
    # of shmem besides pled's memfd, all together, is the few MiB of their own.
    assert len(besides) == 3 and sum(besides.values()) < 16 * MiB, {p: f"{b / MiB:.1f} MiB" for p, b in besides.items()}


@pytest.mark.slow
def test_a_dead_socket_fails_the_load_naming_pled_and_the_fallback_reads_the_files(hook_python, published, tmp_path):
    d = published("ples_nvfp4")
    rows = SHARDS["ples_nvfp4"] * ROWS
    dead = str(tmp_path / "nothing-here.sock")
    proc = start_workers(hook_python, d, clean_env(PLED_SOCKET=dead), [0, rows - 1], rows)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(reports) == 2
    for r in reports:
        assert r["error"].startswith(f"PledUnavailable: pled: configured by PLED_SOCKET ({dead}) but cannot attach")
        assert "PLED_FALLBACK=disk" in r["error"]
    proc = start_workers(hook_python, d, clean_env(PLED_SOCKET=dead, PLED_FALLBACK="disk"), [0, rows - 1], rows)
    out, err = proc.communicate("\n", timeout=300)
    assert proc.returncode == 0, err[-4000:]
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["opened_as"] for r in reports] == [["safe_open"]] * 2  # safetensors' own: the files were read
    assert all(r["shard_files_mapped"] for r in reports)
    assert err.count(f"WARNING pled: configured by PLED_SOCKET ({dead}) but cannot attach") == 2
    assert 'reading from disk instead (fallback = "disk")' in err


@pytest.mark.parametrize("case", ["another shape", "another model's rows", "another model's width"])
def test_the_worker_refuses_a_sidecar_the_published_worker_refuses(hook_python, published, sidecar, daemon, case):
    """Its asserts, before any shard is opened: shards x 2,500,012 = META rows, META rows and width = the model's.
    A sidecar of another shape is refused even with pled serving it."""
    n = SHARDS["ples_int4"]
    env = clean_env()
    if case == "another shape":  # 60,000 rows a shard, as earlier synthetic sidecars had; the model told its rows
        d, model_rows, more = sidecar("ples_int4", shards=4, rows=60_000), ["--model-rows", str(4 * 60_000)], []
        env = clean_env(PLED_SOCKET=daemon({"ples_int4": d}).socket)
        message = f"AssertionError: PLE sidecar: 4 shards x {ROWS} rows != 240000 rows in META.json"
    elif case == "another model's rows":  # published shards, fewer than the published model's 128 (the default)
        d, model_rows, more = published("ples_int4"), [], []
        message = f"AssertionError: PLE sidecar: META.json rows {n * ROWS} != model rows {128 * ROWS}"
    else:
        d, model_rows, more = published("ples_int4"), ["--model-rows", str(n * ROWS)], ["--model-width", "128"]
        message = f"AssertionError: PLE sidecar: META.json width {PUBLISHED_WIDTH} != model width 128"
    r = subprocess.run([str(hook_python), str(WORKER), str(d), "--workers", "1", "--check", "0", *model_rows, *more],
                       capture_output=True, text=True, cwd="/", timeout=300, env=env)
    assert r.returncode == 1, r.stdout + r.stderr[-4000:]
    (report,) = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert report["error"] == message, report
    assert "mapped table" not in r.stderr  # refused before any safe_open: nothing was asked of pled


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
    # what serves files is imported when a file is asked for, not at start-up
    assert "'pled.client.held_files'" not in on


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
    assert len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("pled: start-up hook failed (ImportError: no plugin here)")


def test_an_editable_install_carries_the_hook_too(tmp_path):
    """The shared development environments install pled with `pip install -e`: the hook is written there too."""
    python = scratch_venv(tmp_path / "v", "-e", str(ROOT))
    r = subprocess.run([str(python), "-c",
                        "import sys, pled, safetensors; print(pled.__file__, safetensors.safe_open.__pled__)"],
                       capture_output=True, text=True, cwd="/", env=clean_env(PLED_SOCKET="/nonexistent"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(ROOT / "pled" / "__init__.py"), "True"]
