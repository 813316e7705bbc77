"""Errors that must not escape or mislead: each is a clear message, not a traceback or a wrong reason."""
import gc
import os
import subprocess
import sys
import textwrap

import pytest

from forked import as_user
from pled import client
from pled.client import mapped_table
from pled.daemon.regions import staging
from pled.daemon.sources.sidecar import open_table
from pled.shared import region


@pytest.mark.root
def test_an_unreadable_huge_page_setting_is_reported_as_such(tmp_path, open_dir):
    """EACCES on shmem_enabled is not "this kernel has no transparent huge pages"."""
    thp = tmp_path / "sys/kernel/mm/transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "shmem_enabled").write_text("always within_size [advise] never deny force\n")
    os.chmod(tmp_path, 0o700)  # nobody cannot reach it: open() fails with EACCES
    from pled.generator import make_sidecar

    make_sidecar(os.path.join(open_dir, "sc"), "ples_int4", shards=1, rows=10)

    def stage_and_tell():
        with staging.stage("t", open_table(os.path.join(open_dir, "sc")), sys_root=str(tmp_path)) as r:
            return f"{r.stats.fill.policy} | {r.stats.fill.note}"

    said = as_user(stage_and_tell)
    assert said.startswith("unreadable | cannot read ") and "shmem_enabled (Permission denied)" in said, said
    assert "no transparent huge pages" not in said
    # Root reads the same tree: advise.
    with staging.stage("t", open_table(os.path.join(open_dir, "sc")), sys_root=str(tmp_path)) as r:
        assert r.stats.fill.policy == "advise"


@pytest.mark.root
def test_verify_without_read_access_to_the_sources_is_one_line(sidecar, daemon, open_dir):
    d = sidecar(shards=2, rows=10)  # under pytest's 0700 tmp directory: nobody cannot read it
    sock = os.path.join(open_dir, "pled.sock")
    pled = daemon({"t": d}, socket=sock, allow_uids=[65534])
    os.chmod(sock, 0o666)
    os.chmod(open_dir, 0o755)

    def verify_as_nobody():
        import io

        from pled.verify import verify

        sys.stderr = err = io.StringIO()
        rc = verify(pled.socket, out=io.StringIO())
        return f"{rc} | {err.getvalue()}"

    said = as_user(verify_as_nobody)
    rc, _, text = said.partition(" | ")
    assert rc == "1", said
    assert text.count("\n") == 1 and text.startswith("pled verify: cannot read ") and "Permission denied" in text, said
    assert "shard_0.safetensors" in text and "Traceback" not in text


def test_a_populate_that_fails_is_an_error_not_a_crash(sidecar, tmp_path):
    """MADV_POPULATE_READ failing for any reason but EINVAL (an old kernel) is raised. Here the mapping runs past
    the end of its memfd (EFAULT, the kernel's answer where a read would SIGBUS): swallowing that error and reading
    the pages anyway kills the process."""
    d = sidecar(shards=2, rows=2000)
    code = textwrap.dedent(f"""
        import os
        from pled import client
        from pled.daemon.regions import staging
        from pled.daemon.sources.sidecar import open_table
        with staging.stage("t", open_table({str(d)!r})) as r:
            data = os.pread(r.fd, r.manifest.region_bytes, 0)
        fd = os.memfd_create("copy")  # an unsealed copy, so that it can shrink under the mapping
        os.write(fd, data)
        t = client.Table(fd, 1, populate=False)
        os.ftruncate(fd, 4096)
        try:
            t.populate()
        except client.ClientError as err:
            print("ClientError:", err)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith("ClientError: pre-faulting table t failed: Bad address"), r.stdout


def _unraisable(monkeypatch) -> list:
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u))
    return seen


def test_region_and_table_close_at_interpreter_exit(sidecar, monkeypatch):
    """At interpreter exit a module's globals are set to None before the objects they hold are freed: __del__ must
    not need them. Simulated by taking ``os`` away from the modules, as the interpreter would."""
    seen = _unraisable(monkeypatch)
    d = sidecar(shards=1, rows=10)
    r = staging.stage("t", open_table(str(d)))
    fd = r.fd
    t = client.Table(os.dup(fd), 1, populate=False)
    tfd = t.fd
    monkeypatch.setattr(region, "os", None)
    monkeypatch.setattr(mapped_table, "os", None)  # where Table lives
    del r, t
    gc.collect()
    monkeypatch.undo()
    assert not seen, [str(u.exc_value) for u in seen]
    for closed in (fd, tfd):
        with pytest.raises(OSError):
            os.fstat(closed)
