"""What the tests that run podman share (tests/test_podman.py, tests/test_deb.py): whether podman can run here, its
settings for this machine, and the Debian 12 base image made with debootstrap, no registry needed.

The base is a minimal bookworm with python3 and pip (`debootstrap`, from Debian's mirror through apt's own client),
`podman import`ed as localhost/pled-test-base:bookworm, its tar cached in .cache/podman-base/ between runs. The
settings (CONTAINERS_CONF) carry what some machines need: runc (crun refuses a hybrid cgroup layout) and default
ulimits within the hard limits (root may lack CAP_SYS_RESOURCE: podman's default nproc is refused).
"""
from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomli_w

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "podman-base"
SUITE = "bookworm"
BASE = f"localhost/pled-test-base:{SUITE}"  # kept between runs (with its tar in CACHE)


def missing() -> str | None:
    """Why podman cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (rootful podman, debootstrap)"
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"  # runc and debootstrap live in sbin
    gone = [t for t in ("podman", "runc", "debootstrap") if not shutil.which(t, path=path)]
    if gone:
        return f"{', '.join(gone)} not installed (.ci/run installs podman, runc and debootstrap with apt-get)"
    return None


def run(cmd: list[str], env: dict, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return r


def podman_env(work: Path) -> dict:
    """The environment podman runs in: its settings written into work/containers.conf."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 1048576 if hard == resource.RLIM_INFINITY else min(hard, 1048576)
    # nproc too: podman's default (pid_max) is refused without CAP_SYS_RESOURCE; 65536 was refused here, 4096 is not
    (work / "containers.conf").write_text(tomli_w.dumps({
        "containers": {"default_ulimits": [f"nofile={nofile}:{nofile}", "nproc=4096:4096"]},
        "engine": {"runtime": "runc"}}))
    env = {**os.environ, "CONTAINERS_CONF": str(work / "containers.conf"),
           "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
    env.pop("NOTIFY_SOCKET", None)
    return env


@contextlib.contextmanager
def workspace(prefix: str) -> Iterator[tuple[Path, dict]]:
    """(a directory of the test's own, podman's environment with its settings there), or the test skipped, naming
    what is missing; the directory removed afterwards."""
    why = missing()
    if why:
        pytest.skip(why)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work, podman_env(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def base_image(env: dict, times: dict[str, float]) -> str:
    """The cached base image, else its cached tar imported, else debootstrap made now (about 90 s)."""
    if run(["podman", "image", "exists", BASE], env, check=False).returncode == 0:
        return BASE
    CACHE.mkdir(parents=True, exist_ok=True)
    tar = CACHE / f"{SUITE}-rootfs.tar"
    if not tar.exists():
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(dir=CACHE) as d:
            r = run(["debootstrap", "--variant=minbase", "--include=python3,python3-pip,python-is-python3",
                     SUITE, f"{d}/rootfs"], env, timeout=1200, check=False)
            if r.returncode != 0:
                pytest.skip(f"debootstrap could not make the base (is Debian's mirror reachable?): "
                            f"{(r.stdout + r.stderr)[-600:]}")
            run(["tar", "-C", f"{d}/rootfs", "-cf", f"{tar}.part", "."], env)
            os.rename(f"{tar}.part", tar)
        times["debootstrap"] = time.monotonic() - t0
    # pip's settings for the builds: no index, the wheels fetched on the host (mounted at /wheelhouse), and pip may
    # install into Debian's system Python (python:3.12-slim has no EXTERNALLY-MANAGED; Debian's python3 has).
    changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV PIP_NO_INDEX=1",
               "ENV PIP_FIND_LINKS=/wheelhouse", "ENV PIP_BREAK_SYSTEM_PACKAGES=1", "ENV PIP_ROOT_USER_ACTION=ignore",
               "ENV PIP_DISABLE_PIP_VERSION_CHECK=1"]
    run(["podman", "import", *[a for c in changes for a in ("--change", c)], str(tar), BASE], env)
    return BASE
