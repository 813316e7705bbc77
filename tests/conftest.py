"""Fixtures, and the rules of the markers (registered in pyproject.toml; `make test-fast` runs the tests with none):

    daemon   starts `pled serve`: given to every test that uses the ``daemon`` or ``pleds`` fixture, written on the
             others; tests/harness.py fails a test that starts pled without it
    root     needs root: skipped otherwise (also given to the users of ``memcg``)
    vllm     needs vLLM's environment, .venv-vllm (`make vllm-env`): skipped without it
    slow     takes more than about 10 s here; the run's summary names unmarked tests that took longer

What starts pled, talks to it or stands in for systemd lives in tests/harness.py; no test imports another test.
"""
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import harness
from cgroups import own_v1_memory_cgroup
from pled.generator import make_sidecar

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
SLOW_S = 10
MARKED_BY_FIXTURE = {"daemon": "daemon", "pleds": "daemon", "memcg": "root"}
_unmarked_slow: list[str] = []


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        for fixture in MARKED_BY_FIXTURE.keys() & set(item.fixturenames):
            item.add_marker(MARKED_BY_FIXTURE[fixture])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    """Before any fixture: the test's markers for tests/harness.py's check, and the skips they mean."""
    markers = {m.name for m in item.iter_markers()}
    harness.current_markers = markers
    if "root" in markers and os.geteuid() != 0:
        pytest.skip("needs root")
    if "vllm" in markers and not VLLM_PYTHON.exists():
        pytest.skip("no .venv-vllm: run `make test` (it builds it) or `make vllm-env`")


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" and report.duration > SLOW_S and "slow" not in report.keywords:
        _unmarked_slow.append(f"{report.nodeid} ({report.duration:.0f} s)")


def pytest_terminal_summary(terminalreporter) -> None:
    for line in harness.SUMMARY:
        terminalreporter.write_line(line)
    if _unmarked_slow:
        terminalreporter.write_line(f"over {SLOW_S} s without @pytest.mark.slow: {', '.join(_unmarked_slow)}")


@pytest.fixture
def sidecar(tmp_path):
    """make(layout, shards, rows) -> the directory of a fresh synthetic sidecar."""

    def make(layout="ples_int4", shards=4, rows=256, **kw) -> Path:
        d = tmp_path / f"{layout}-{shards}x{rows}"
        make_sidecar(str(d), layout, shards=shards, rows=rows, **kw)
        return d

    return make


@pytest.fixture
def open_dir():
    """A directory under /tmp that any uid may traverse (tmp_path's parents are 0700), removed afterwards: for
    sockets and sidecars that a test's non-root client must reach."""
    d = tempfile.mkdtemp(prefix="pled-open-", dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


@pytest.fixture
def daemon(tmp_path):
    """start(tables, wait="ready:", socket=None, **config keys and Daemon options) -> a running pled, as
    harness.start makes it in tmp_path; every one started is stopped afterwards."""
    started = []

    def start(tables: dict, wait: str | None = "ready:", **kw) -> harness.Daemon:
        d = harness.start(tmp_path, tables, wait=None, **kw)
        started.append(d)
        if wait:
            d.wait_for(wait)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def pleds():
    """A list to put daemons started with harness.start in; each is stopped afterwards."""
    started = []
    yield started
    for p in started:
        p.stop()


@pytest.fixture
def notify_socket(tmp_path):
    n = harness.NotifySocket(tmp_path / "notify.sock")
    yield n
    n.close()


@pytest.fixture
def memcg():
    """make(limit) -> a fresh child of this process's v1 memory cgroup, removed afterwards."""
    parent = own_v1_memory_cgroup()
    if parent is None:
        pytest.skip("no cgroup v1 memory controller mounted (cgroup v2 needs a delegated subtree)")
    made = []

    def make(limit: int) -> Path:
        child = parent / f"pled-test-{os.getpid()}-{len(made)}"
        try:
            child.mkdir()
            (child / "memory.limit_in_bytes").write_text(str(limit))
        except OSError as err:
            pytest.skip(f"cannot create a memory cgroup under {parent}: {err}")
        made.append(child)
        return child

    yield make
    for child in made:
        for _ in range(50):
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.1)  # the last task is still leaving


@pytest.fixture
def blockfs(tmp_path):
    """mount(source) -> (mountpoint, flag): a FUSE pass-through of ``source`` (tests/blockfs.py) whose getattr, open
    and read hang while ``flag`` exists (only reads past byte N where it holds N); each call that hangs adds a line
    to ``flag``.calls (harness.blocked_calls reads them)."""
    harness.require_fuse()
    mounts = []

    def mount(source: Path) -> tuple[Path, Path]:
        point, flag = tmp_path / f"fuse{len(mounts)}", tmp_path / f"block{len(mounts)}"
        point.mkdir()
        mounts.append((point, flag, harness.mount_fuse("blockfs.py", source, point, str(flag))))
        return point, flag

    yield mount
    for point, flag, proc in mounts:
        flag.unlink(missing_ok=True)  # first: whatever waits in the file system goes on
        if subprocess.run(["fusermount3", "-u", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(point)], capture_output=True)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
