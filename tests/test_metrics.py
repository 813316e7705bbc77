"""The metrics file (config ``metrics_file``), against its real consumer and the kernel.

Debian's node exporter (``prometheus-node-exporter``, run as uid 65534, pled under the unit's UMask=0077) serves
pled's samples while pled stages, serves, refuses and reloads, with no textfile error; promtool accepts the file;
the figures agree with `pled status --json` and /proc; a reader never sees half a file over fifty rewrites; a full
file system keeps the previous file and is one warning; a directory that is not there is one warning and serving
goes on; a write that never returns stalls neither the loop nor a stop. The figures are read with
prometheus_client's own parser. Where the node exporter or promtool is missing (.ci/run installs them), those tests
skip and say so.
"""
import encodings.ascii  # noqa: F401  the forked client cannot import it: the stdlib may sit under root's 0700 home
import errno
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from forked import as_user
from harness import run_pled, wait_until, write_config
from pled import client
from pled.daemon import config
from pled.daemon.health.metrics_file import write_atomically
from pled.generator import make_sidecar
from pled.shared import metrics, protocol
from pled.shared.errors import ConfigError

EXPORTER = "/usr/bin/prometheus-node-exporter"
UMASK_077 = ["sh", "-c", 'umask 077; exec "$@"', "sh"]  # pled.service's UMask=0077; exec keeps pled's pid
UNITS = Path(__file__).resolve().parent.parent / "units"
WARNING = "cannot write the metrics file"


# -- reading metrics --------------------------------------------------------------------------------------------

def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample: (name, its labels) -> value, by prometheus_client's parser (which raises on a bad line)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def read(path: Path) -> dict:
    try:
        return parse(path.read_text())
    except FileNotFoundError:
        return {}


def ready_file(path: Path, table: str = "t", timeout: float = 30) -> dict:
    """The metrics file once it shows ``table`` ready."""
    return wait_until(lambda: (m := read(path)) and value(m, "pled_table_state", table=table, state="ready") == 1
                      and m, timeout, f"{path} never showed table {table} ready")


# -- the fast lane: config, the renderer, the atomic write --------------------------------------------------------

def test_metrics_file_is_taken_from_the_configs_directory_and_checked(tmp_path):
    c = config.parse('metrics_file = "m/pled.prom"\nmetrics_interval = 2.5\n', str(tmp_path / "pled.toml"))
    assert (c.metrics_file, c.metrics_interval) == (str(tmp_path / "m" / "pled.prom"), 2.5)
    assert config.parse("", "/etc/pled/pled.toml").metrics_file is None  # off unless set
    assert config.parse("", "/etc/pled/pled.toml").metrics_interval == 15
    for text, words in (('metrics_file = "pled.txt"', "must end in .prom"),
                        ("metrics_interval = 0", "metrics_interval"), ("metrics_interval = 7200", "metrics_interval"),
                        ('metrics_interval = "15"', "expected seconds"),
                        ("metrics_interval = true", "expected seconds")):
        with pytest.raises(ConfigError, match=words):
            config.parse(text, "/etc/pled/pled.toml")


STATUS = {
    "version": "9.9", "pid": 1, "uptime_seconds": 12.5, "socket": "/run/pled/pled.sock", "reload": None,
    "tables": [{"table": "t", "state": "ready", "bytes": 1000, "bytes_done": 1000, "region_bytes": 4194304,
                "generation": 2, "layout": "ples_int4", "origin": "staged", "fingerprint": "ab", "clients": 1,
                "resident_share": 1.0, "huge_page_bytes": 2097152, "page_size_bytes": 2097152,
                "staging_seconds": 0.5, "staging_bytes_per_second": 2000, "sources": "unchanged"},
               {"table": "u", "state": "staging", "bytes": 5000, "bytes_done": 10, "region_bytes": 6291456,
                "generation": 1, "layout": "ples_fp8", "origin": "staged", "fingerprint": "cd", "clients": 0}],
    "clients": [], "daemon": {
        "attaches": 3, "refused": {"access": 1, "not_ready": 0}, "dropped": {"timeout": 2},
        "reloads": {"done": 1, "failed": 0}, "connections": 2, "clients": 1, "open_fds": 12, "max_fds": 1024,
        "fdstore": {"entries": 1, "max_entries": 64}, "resident_memory_bytes": 30_000_000}}


def test_render_turns_a_status_reply_into_prometheus_text():
    text = metrics.render(STATUS).decode()
    m = parse(text)
    assert value(m, "pled_info", version="9.9") == 1 and value(m, "pled_uptime_seconds") == 12.5
    assert value(m, "pled_attaches_total") == 3 and value(m, "pled_refused_total", reason="access") == 1
    assert value(m, "pled_dropped_connections_total", reason="timeout") == 2
    assert value(m, "pled_reloads_total", result="done") == 1 and value(m, "pled_reloads_total", result="failed") == 0
    assert value(m, "pled_fdstore_max_entries") == 64 and value(m, "pled_resident_memory_bytes") == 30_000_000
    assert value(m, "pled_table_state", table="u", state="staging") == 1
    assert value(m, "pled_table_state", table="u", state="ready") == 0
    assert value(m, "pled_table_copied_bytes", table="u") == 10
    assert value(m, "pled_table_source_bytes", table="u") == 5000
    assert value(m, "pled_table_huge_page_ratio", table="t") == 0.5
    assert value(m, "pled_table_resident_ratio", table="u") is None  # not staged: left out, not 0
    for line in text.splitlines():  # every counter says it restarts with the process
        if line.startswith("# HELP") and line.split()[2].endswith("_total"):
            assert "restarts at 0 with the process" in line, line
    # A pled without the daemon's figures (older than the metrics): what it has, no error.
    older = parse(metrics.render({k: v for k, v in STATUS.items() if k != "daemon"}).decode())
    assert value(older, "pled_uptime_seconds") == 12.5 and value(older, "pled_attaches_total") is None


def test_render_without_prometheus_client_names_the_package(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "prometheus_client", None)
    with pytest.raises(metrics.MetricsUnavailable, match="prometheus-client"):
        metrics.render(STATUS)


def test_the_file_is_world_readable_whatever_the_umask(tmp_path):
    path = tmp_path / "pled.prom"
    old = os.umask(0o077)
    try:
        write_atomically(str(path), b"pled_up 1\n")
        write_atomically(str(path), b"pled_up 2\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 and path.read_bytes() == b"pled_up 2\n"
    assert sorted(os.listdir(tmp_path)) == ["pled.prom"]  # no temporary file left


def test_the_unit_may_write_the_textfile_directory_and_only_where_it_exists():
    text = (UNITS / "pled.service").read_text()
    assert "\nReadWritePaths=-/var/lib/prometheus/node-exporter\n" in text
    tmpfiles = (UNITS / "pled-metrics.tmpfiles.conf").read_text()
    assert "\na+ /var/lib/prometheus/node-exporter - - - - u:pled:rwx\n" in tmpfiles


@pytest.mark.root
def test_tmpfiles_gives_user_pled_the_textfile_directory(tmp_path):
    """units/pled-metrics.tmpfiles.conf applied by systemd-tmpfiles to a scratch root whose /etc knows user pled:
    an ACL entry rwx for pled's uid; owner, group and the mode's other bits unchanged."""
    tool, unshare = shutil.which("systemd-tmpfiles"), shutil.which("unshare")
    if tool is None or unshare is None:
        pytest.skip("needs systemd-tmpfiles and unshare")
    textfile = tmp_path / "var/lib/prometheus/node-exporter"
    textfile.mkdir(parents=True)
    textfile.chmod(0o755)
    (tmp_path / "etc").mkdir()
    uid = 64999
    (tmp_path / "etc/passwd").write_text(Path("/etc/passwd").read_text() + f"pled:x:{uid}:{uid}::/:/usr/sbin/nologin\n")
    (tmp_path / "etc/group").write_text(Path("/etc/group").read_text() + f"pled:x:{uid}:\n")
    # systemd-tmpfiles resolves u:pled through this host's NSS: the scratch passwd and group, bound over /etc's.
    script = ('mount --bind "$1/etc/passwd" /etc/passwd && mount --bind "$1/etc/group" /etc/group && '
              'exec "$2" --create --root="$1" "$3"')
    r = subprocess.run([unshare, "--mount", "sh", "-c", script, "sh", str(tmp_path), tool,
                        str(UNITS / "pled-metrics.tmpfiles.conf")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    acl = os.getxattr(textfile, "system.posix_acl_access")
    entries = [(int.from_bytes(acl[i:i + 2], "little"), int.from_bytes(acl[i + 2:i + 4], "little"),
                int.from_bytes(acl[i + 4:i + 8], "little")) for i in range(4, len(acl), 8)]
    assert (2, 7, uid) in entries, entries  # ACL_USER pled: rwx
    st = textfile.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o707) == (0, 0, 0o705)


# -- against a real pled ------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    """node exporter's /metrics, parsed; every scrape must have read pled's file without an error."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            m = parse(r.read().decode())
    except (urllib.error.URLError, ConnectionError):
        return {}  # not listening yet
    assert value(m, "node_textfile_scrape_error") == 0, "node exporter could not read pled's metrics file"
    return m


def scraped(port: int, name: str, want: float, **labels) -> dict:
    return wait_until(lambda: (m := scrape(port)) and value(m, name, **labels) == want and m, 30,
                      lambda: f"node exporter never served {name}{labels} = {want}: "
                              f"{sorted(k for k in scrape(port) if k[0].startswith('pled'))}")


@pytest.mark.daemon
@pytest.mark.root
@pytest.mark.slow
def test_node_exporter_serves_pleds_metrics_while_it_stages_serves_refuses_and_reloads(tmp_path, daemon, open_dir):
    if not os.access(EXPORTER, os.X_OK):
        pytest.skip(f"{EXPORTER} is not installed (Debian's prometheus-node-exporter; .ci/run installs it)")
    textfile = Path(open_dir) / "textfile"
    textfile.mkdir(mode=0o755)
    src, new = tmp_path / "src", tmp_path / "new"
    make_sidecar(str(src), "ples_int4", shards=4, rows=25000)  # 10 MB: 3 s at 3 MB/s, so staging is seen
    make_sidecar(str(new), "ples_fp8", shards=1, rows=100)
    sock = os.path.join(open_dir, "run", "pled.sock")
    keys = {"socket": sock, "staging_bandwidth": "3MB/s", "metrics_file": textfile / "pled.prom",
            "metrics_interval": 1}
    pled = daemon({"t": src}, wait=None, prefix=UMASK_077, **keys)
    port = free_port()
    exporter_log = open(tmp_path / "exporter.log", "w")  # noqa: SIM115  closed below
    exporter = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", EXPORTER,
                                 "--collector.disable-defaults", "--collector.textfile",
                                 f"--collector.textfile.directory={textfile}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=exporter_log)
    try:
        # Staging: the state, and a client that asks too early refused as not ready.
        scraped(port, "pled_table_state", 1, table="t", state="staging")
        with pytest.raises(client.NotReady):
            client.attach("t", socket=sock)
        pled.wait_ready()
        m = scraped(port, "pled_table_state", 1, table="t", state="ready")
        assert value(m, "pled_table_state", table="t", state="staging") == 0
        assert value(m, "pled_refused_total", reason="not_ready") == 1
        assert stat.S_IMODE(os.stat(textfile / "pled.prom").st_mode) == 0o644  # by pled, under umask 077
        # Serving: a client attached.
        with client.attach("t", socket=sock):
            m = scraped(port, "pled_table_clients", 1, table="t")
            assert value(m, "pled_attaches_total") == 1 and value(m, "pled_clients") == 1
        # Refusing: a uid outside pled's policy, the socket's mode opened so that pled decides.
        os.chmod(os.path.dirname(sock), 0o755)
        os.chmod(sock, 0o666)
        said = as_user(lambda: client.call(protocol.STATUS, socket=sock), [])
        assert said.startswith("PermissionDenied"), said
        scraped(port, "pled_refused_total", 1, reason="access")
        # Reloading: one refused by its preflight (nothing changes), then one that adds a table.
        write_config(pled.config, {"t": src, "u": new}, headroom_margin="1000TiB", **keys)
        assert pled.reload() == "reload failed"
        m = scraped(port, "pled_reloads_total", 1, result="failed")
        assert value(m, "pled_reloads_total", result="done") == 0
        assert value(m, "pled_table_generation", table="u") is None
        write_config(pled.config, {"t": src, "u": new}, headroom_margin=0, **keys)
        assert pled.reload() == "reload done"
        m = scraped(port, "pled_reloads_total", 1, result="done")
        assert value(m, "pled_table_state", table="u", state="ready") == 1
        assert value(m, "node_textfile_mtime_seconds", file=str(textfile / "pled.prom")) is not None
    finally:
        exporter.terminate()
        exporter.wait(timeout=10)
        exporter_log.close()


@pytest.mark.daemon
def test_promtool_accepts_the_file_and_pled_status_output(tmp_path, daemon, sidecar):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus; .ci/run installs it)")
    path = tmp_path / "pled.prom"
    pled = daemon({"t": sidecar(shards=2, rows=300), "u": sidecar("ples_nvfp4", shards=1, rows=100)},
                  metrics_file=path, metrics_interval=1)
    with client.attach("t", socket=pled.socket), pytest.raises(client.NoSuchTable):
        client.attach("nope", socket=pled.socket)
    wait_until(lambda: value(read(path), "pled_refused_total", reason="no_such_table") == 1)
    for text in (path.read_bytes(), metrics.render(client.call(protocol.STATUS, socket=pled.socket))):
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
        assert r.returncode == 0 and not r.stdout and not r.stderr, (r.stdout + r.stderr).decode()


def kernel_memfd_sizes(pid: int) -> dict[str, int]:
    """Each of pled's memfds, by table: its size as the kernel has it."""
    out = {}
    for n in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{n}")
            if link.startswith("/memfd:pled:"):
                out[link[len("/memfd:pled:"):].removesuffix(" (deleted)")] = os.stat(f"/proc/{pid}/fd/{n}").st_size
        except FileNotFoundError:
            pass
    return out


def soft_nofile(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    return int(line.split()[3])


@pytest.mark.daemon
def test_the_figures_agree_with_pled_status_and_the_kernel(tmp_path, daemon, sidecar):
    path = tmp_path / "pled.prom"
    pled = daemon({"a": sidecar(shards=2, rows=300), "b": sidecar("ples_fp8", shards=3, rows=200)},
                  metrics_file=path, metrics_interval=1)
    holders = [client.attach(name, socket=pled.socket) for name in ("a", "a", "b")]
    try:
        with pytest.raises(client.NoSuchTable):
            client.attach("nope", socket=pled.socket)
        with socket.socket(socket.AF_UNIX) as s:  # not a call: pled answers InvalidMessage and drops it
            s.connect(pled.socket)
            s.sendall(b"[1, 2]\0")
            assert b"InvalidMessage" in s.recv(65536) and s.recv(65536) == b""
        m = wait_until(lambda: (m := read(path)) and value(m, "pled_clients") == 3
                       and value(m, "pled_dropped_connections_total", reason="invalid_message") == 1 and m)
        r = run_pled("status", "--json", "--socket", pled.socket)
        st = json.loads(r.stdout)
        # pled's fds at rest (the fewest over half a second: a write holds one more for a moment), and the next
        # rewrite (every second), made after the status call's connection closed.
        fds = f"/proc/{pled.pid}/fd"
        at_rest = min(len(os.listdir(fds)) for _ in range(50) if time.sleep(0.01) is None)
        version = (path.stat().st_ino, path.stat().st_mtime_ns)
        wait_until(lambda: (path.stat().st_ino, path.stat().st_mtime_ns) != version, 5)
        m = read(path)
        assert value(m, "pled_open_fds") == at_rest, f"pled_open_fds {value(m, 'pled_open_fds')}, {fds}: {at_rest}"
        memfds = kernel_memfd_sizes(pled.pid)
        for t in st["tables"]:
            name = t["table"]
            assert value(m, "pled_table_region_bytes", table=name) == t["region_bytes"] == memfds[name]
            assert value(m, "pled_table_source_bytes", table=name) == t["bytes"]
            assert value(m, "pled_table_copied_bytes", table=name) == t["bytes_done"] == t["bytes"]
            assert value(m, "pled_table_generation", table=name) == t["generation"] == 1
            assert value(m, "pled_table_state", table=name, state="ready") == 1 and t["state"] == "ready"
            assert value(m, "pled_table_resident_ratio", table=name) == t["resident_share"]
            assert value(m, "pled_table_page_size_bytes", table=name) == t["page_size_bytes"]
            rate = value(m, "pled_table_staging_bytes_per_second", table=name)
            assert rate == pytest.approx(t["bytes"] / t["staging_seconds"], rel=0.2)
        assert value(m, "pled_table_clients", table="a") == 2 and value(m, "pled_table_clients", table="b") == 1
        assert value(m, "pled_clients") == len(st["clients"]) == st["daemon"]["clients"] == 3
        assert value(m, "pled_attaches_total") == st["daemon"]["attaches"] == 3
        assert value(m, "pled_refused_total", reason="no_such_table") == st["daemon"]["refused"]["no_such_table"] == 1
        assert value(m, "pled_max_fds") == soft_nofile(pled.pid) == st["daemon"]["max_fds"]
        assert value(m, "pled_resident_memory_bytes") > 10 * 2**20
        assert value(m, "pled_fdstore_max_entries") == 0  # no systemd here: no fd store
        # `pled status --format prometheus` renders the reply of its own call: the same families as the file.
        assert families(metrics.render(client.call(protocol.STATUS, socket=pled.socket)).decode()) == \
            families(path.read_text())
        printed = run_pled("status", "--format", "prometheus", "--socket", pled.socket)  # the command itself
        assert printed.returncode == 0 and families(printed.stdout) == families(path.read_text()), printed.stderr
    finally:
        for h in holders:
            h.close()
    wait_until(lambda: value(read(path), "pled_clients") == 0)


@pytest.mark.daemon
@pytest.mark.slow
def test_a_change_is_in_the_file_at_once_not_at_the_next_interval(tmp_path, daemon, sidecar):
    """With an interval of an hour, a client that attaches and one that leaves are each in the file within seconds
    (a change is written at most MIN_GAP after it, not at the next interval)."""
    path = tmp_path / "pled.prom"
    pled = daemon({"t": sidecar(shards=2, rows=300)}, metrics_file=path, metrics_interval=3600)
    assert value(ready_file(path), "pled_clients") == 0
    with client.attach("t", socket=pled.socket, populate=False):
        wait_until(lambda: value(read(path), "pled_clients") == 1, 10, "the attach never reached the file")
    wait_until(lambda: value(read(path), "pled_clients") == 0, 10, "the detach never reached the file")


def test_a_reader_never_sees_half_a_file_over_fifty_rewrites(tmp_path, daemon, sidecar):
    """A reader opens, reads and parses the file in a loop while clients attach and leave (each change rewrites it,
    at most every 0.1 s): every read is a whole file, and a file a reader holds open never changes under it."""
    path = tmp_path / "pled.prom"
    pled = daemon({"t": sidecar(shards=2, rows=300)}, metrics_file=path, metrics_interval=1)
    ready_file(path)
    expected = families(path.read_text())
    stop, seen, bad = threading.Event(), set(), []

    def reader():
        held = None  # (fd, what was read through it)
        while not stop.is_set() and len(bad) < 5:
            fd = os.open(path, os.O_RDONLY)
            st = os.fstat(fd)
            text = os.pread(fd, st.st_size + 4096, 0).decode()
            seen.add((st.st_ino, st.st_mtime_ns))
            try:
                if families(text) != expected or not text.endswith("\n"):
                    bad.append(f"a read of {len(text)} bytes held families {sorted(families(text))}")
            except ValueError as err:
                bad.append(f"a read did not parse ({err}): {text[-200:]!r}")
            if held is not None:
                if os.pread(held[0], len(held[1]) + 4096, 0).decode() != held[1]:
                    bad.append("a file a reader held open changed under it (written in place, not replaced)")
                os.close(held[0])
            held = (fd, text)
        if held is not None:
            os.close(held[0])

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        deadline = time.monotonic() + 120  # it ends at 50 versions: about 10 s here, longer on a busy machine
        while len(seen) < 50 and time.monotonic() < deadline and not bad:
            with client.attach("t", socket=pled.socket, populate=False):
                time.sleep(0.06)
            time.sleep(0.06)
    finally:
        stop.set()
        thread.join()
    assert not bad, bad
    assert len(seen) >= 50, f"only {len(seen)} versions of the file in 120 s of clients attaching and leaving"


def fill(path: Path) -> None:
    """Write ``path`` until its file system has no byte left."""
    with open(path, "wb", buffering=0) as f:
        for size in (65536, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise


@pytest.mark.daemon
@pytest.mark.root
def test_a_full_file_system_keeps_the_previous_file_and_is_one_warning(tmp_path, daemon, sidecar):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=755", "pled-test-metrics", str(small)], check=True)
    try:
        path = small / "pled.prom"
        pled = daemon({"t": sidecar(shards=2, rows=300)}, metrics_file=path, metrics_interval=1)
        ready_file(path)
        fill(small / "filler")
        pled.wait_for(WARNING)  # a write failed since: none can succeed now
        before = path.read_bytes()
        for _ in range(4):  # changes and intervals: several writes, each one failing
            with client.attach("t", socket=pled.socket, populate=False):
                time.sleep(0.3)
            time.sleep(0.7)
        assert path.read_bytes() == before and value(parse(before.decode()), "pled_table_state", table="t",
                                                     state="ready") == 1
        assert sorted(os.listdir(small)) == ["filler", "pled.prom"]  # no temporary file left behind
        log = pled.log()
        assert log.count(WARNING) == 1, log
        assert f"{WARNING} {path}: No space left on device" in log
        assert client.call(protocol.STATUS, socket=pled.socket)["tables"][0]["state"] == "ready"  # serving on
        (small / "filler").unlink()
        pled.wait_for(f"metrics file {path} written again")
        assert path.read_bytes() != before and value(read(path), "pled_attaches_total") == 4
        assert pled.stop() == 0
    finally:
        if subprocess.run(["umount", str(small)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(small)], capture_output=True)


@pytest.mark.daemon
def test_a_metrics_directory_that_is_not_there_is_one_warning_and_serving_goes_on(tmp_path, daemon, sidecar):
    path = tmp_path / "absent" / "pled.prom"
    pled = daemon({"t": sidecar(shards=2, rows=300)}, metrics_file=path, metrics_interval=1)
    pled.wait_for(WARNING)
    for _ in range(3):
        with client.attach("t", socket=pled.socket, populate=False) as t:
            assert t.generation == 1
        time.sleep(1)
    log = pled.log()
    assert log.count(WARNING) == 1 and f"{WARNING} {path}: No such file or directory" in log, log
    path.parent.mkdir()
    pled.wait_for(f"metrics file {path} written again")
    assert value(ready_file(path), "pled_attaches_total") == 3


@pytest.mark.daemon
def test_a_table_that_fails_to_stage_is_in_the_file_pled_leaves(tmp_path, daemon, sidecar):
    """The first staging fails (a shard that does not match its shipped digest) and pled exits: its last write,
    at stop, shows the table failed."""
    d = sidecar("ples_fp8", shards=2, rows=2000)
    bad = bytearray((d / "shard_1.safetensors").read_bytes())
    bad[len(bad) // 2] ^= 0x01
    (d / "shard_1.safetensors").write_bytes(bad)
    path = tmp_path / "pled.prom"
    pled = daemon({"t": d}, wait=None, metrics_file=path, metrics_interval=3600)
    assert pled.wait_ready_or_exit() == 78, pled.log()
    m = read(path)
    assert value(m, "pled_table_state", table="t", state="failed") == 1, m
    assert value(m, "pled_table_state", table="t", state="staging") == 0


@pytest.mark.daemon
def test_a_stop_writes_the_last_figures(tmp_path, daemon, sidecar):
    """SIGTERM while a reload stages: the reload fails at stop, after the loop's last turn; the file pled leaves
    counts it."""
    path = tmp_path / "pled.prom"
    small, big = sidecar(shards=1, rows=100), sidecar(shards=2, rows=40000)  # big: 8 MB at 1 MB/s
    pled = daemon({"t": small}, metrics_file=path, metrics_interval=3600)
    wait_until(lambda: value(read(path), "pled_table_state", table="t", state="ready") == 1)
    write_config(pled.config, {"t": small, "u": big}, socket=pled.socket, headroom_margin=0,
                 staging_bandwidth="1MB/s", metrics_file=path, metrics_interval=3600)
    pled.send_signal(signal.SIGHUP)
    pled.wait_for("reload: staging table u")
    assert pled.stop() == 0
    log = pled.log()
    assert "reload failed, nothing changed" in log.split("SIGTERM: stopping")[1], log  # in the stop, not before it
    m = read(path)
    assert value(m, "pled_reloads_total", result="failed") == 1 and value(m, "pled_reloading") == 0, m


HANG = ("import threading, pled.daemon.health.metrics_file as m\n"
        "m.write_atomically = lambda path, data: threading.Event().wait()")


@pytest.mark.daemon
def test_a_metrics_write_that_never_returns_stalls_neither_serving_nor_a_stop(tmp_path, daemon, sidecar):
    """Each write hangs, as on a file system that stopped answering: pled answers and stops as usual."""
    path = tmp_path / "pled.prom"
    pled = daemon({"t": sidecar(shards=2, rows=300)}, metrics_file=path, metrics_interval=1, patch=HANG)
    for _ in range(3):  # the loop keeps making snapshots meanwhile, each second and at each attach
        began = time.monotonic()
        assert client.call(protocol.STATUS, socket=pled.socket, timeout=3)["tables"][0]["state"] == "ready"
        with client.attach("t", socket=pled.socket, timeout=3, populate=False):
            pass
        assert time.monotonic() - began < 1.5
        time.sleep(1)
    assert not path.exists()
    began = time.monotonic()
    assert pled.stop(timeout=10) == 0
    assert time.monotonic() - began < 6
    assert f"stopping without waiting for the metrics file's writer: it has been writing {path} for" in pled.log()


def test_the_temporary_file_is_opened_without_blocking_and_must_be_regular(tmp_path):
    """write_atomically itself: a FIFO at the temporary name (no reader: open() would block for good, or with a
    reader: data would go to it) is refused at once and removed, and the next write succeeds. Each write runs in a
    forked child given 10 s: one that blocks is reported, not waited for."""
    path = tmp_path / "pled.prom"
    tmp = tmp_path / ".pled.prom.tmp"

    def write() -> str:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                write_atomically(str(path), b"a 1\n")
                os.write(w, b"written")
            except OSError as err:
                os.write(w, f"{errno.errorcode.get(err.errno or 0)}: {err.strerror}".encode())
            finally:
                os._exit(0)
        os.close(w)
        deadline = time.monotonic() + 10
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(r)
                return "blocked"
            time.sleep(0.01)
        with os.fdopen(r) as f:
            return f.read()

    os.mkfifo(tmp)
    assert write().startswith("ENXIO"), "a FIFO without a reader"  # without O_NONBLOCK: blocked in open(O_WRONLY)
    assert not os.path.lexists(tmp) and not path.exists()
    os.mkfifo(tmp)
    reader = os.open(tmp, os.O_RDONLY | os.O_NONBLOCK)  # a reader present: the open succeeds, fstat refuses it
    try:
        said = write()
        assert said.startswith("EINVAL") and "not a regular file" in said, said
        assert os.read(reader, 100) == b""  # nothing was written into the FIFO
    finally:
        os.close(reader)
    assert not os.path.lexists(tmp)
    assert write() == "written" and path.read_bytes() == b"a 1\n"


@pytest.mark.daemon
@pytest.mark.slow
def test_a_fifo_planted_at_the_temporary_name_is_said_once_in_the_log_and_status(tmp_path, daemon, sidecar):
    """Whoever may write the textfile directory plants a FIFO at .pled.prom.tmp before pled starts, and again
    after each write: the writer never blocks (the file is written between plantings), says it once in the log
    and in Status until it writes again, and serving goes on."""
    metrics_dir = tmp_path / "textfile"
    metrics_dir.mkdir()
    path, tmp = metrics_dir / "pled.prom", metrics_dir / ".pled.prom.tmp"
    os.mkfifo(tmp)
    pled = daemon({"t": sidecar(shards=2, rows=300)}, metrics_file=path, metrics_interval=1)
    pled.wait_for(WARNING)
    text = pled.log()
    assert text.count(WARNING) == 1 and str(path) in text, text[-2000:]
    ready_file(path)  # pled removed the FIFO, and the next write went through
    assert "written again" in pled.log()
    assert client.call(protocol.STATUS, socket=pled.socket)["daemon"]["metrics_file_error"] is None
    for _ in range(3):  # planted again and again: each time one write fails, said only when the reason is new
        wait_until(lambda: not os.path.lexists(tmp), 10)
        os.mkfifo(tmp)
        wait_until(lambda: not os.path.lexists(tmp), 10)
    tmp.mkdir()  # a failure that stays (pled cannot remove a directory there): Status says it while it lasts
    wait_until(lambda: client.call(protocol.STATUS, socket=pled.socket)["daemon"]["metrics_file_error"], 10)
    st = client.call(protocol.STATUS, socket=pled.socket)
    assert st["daemon"]["metrics_file_error"].startswith(f"{path}: ") and st["tables"][0]["state"] == "ready", st
    status = run_pled("status", "--socket", pled.socket, timeout=30)
    assert "the metrics file cannot be written" in status.stdout and "Traceback" not in status.stderr, status
    time.sleep(2.5)  # two more intervals, each write failing for the same reason: nothing more in the log
    assert pled.log().count(WARNING) <= 5, pled.log()[-3000:]  # the FIFO's (at most one a planting) and this one
    warned = pled.log().count(WARNING)
    time.sleep(2.5)
    assert pled.log().count(WARNING) == warned
    tmp.rmdir()
    wait_until(lambda: client.call(protocol.STATUS, socket=pled.socket)["daemon"]["metrics_file_error"] is None, 10)
    assert pled.stop() == 0
