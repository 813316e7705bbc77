"""The Debian 12 package of pled's host side (debian/, `make deb`, tools/deb.sh), as an operator meets it.

Built here twice from this checkout (its own version, and a higher one for the upgrade), checked by lintian, then
installed with `apt-get install ./pled_*.deb` into a fresh Debian 12 container: tests/podmanlib.py's debootstrapped
base with systemd added, started with `podman run --systemd=always`, so that systemd 252 is PID 1 on the Debian tree
and not on the host's /usr. There pled is installed (nothing enabled or started, one line saying what to do), started
on a table, upgraded to the rebuilt package (pled restarted by postinst, the table adopted from the fd store: no byte
read again, the same generation; an edited config kept), then purged (no pled process, unit, config or file left;
the system user stays, as sysusers' users do).

systemd as PID 1 here is fenced by podman, not by this test: the container has its own PID, mount, UTS, IPC and
cgroup namespaces, its own /run and /tmp, and a read-only /sys (the unit's ExecStartPre= cannot change the host's
shmem_enabled); the test checks afterwards that the host's hostname, sysctls, THP settings and user database are
unchanged. So it runs in CI (.ci/run), unlike tests/test_systemd_pid1.py, which fences a bare systemd itself.
Needs root, podman, runc and debootstrap, and dpkg-buildpackage, dh-virtualenv and lintian (`make deb` and .ci/run
install them); skips without them, naming what is missing. Debian's mirror and PyPI must be reachable.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import pled
from harness import host_settings
from podmanlib import base_image, run, workspace

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD_IMAGE = "localhost/pled-test-systemd:bookworm"  # the base with systemd, kept between runs like the base
# that with bookworm-backports' systemd (254), which keeps the fd store across a stop (FileDescriptorStorePreserve=)
SYSTEMD_254_IMAGE = "localhost/pled-test-systemd-254:bookworm"
NAME = f"pled-test-deb-{os.getpid()}"
HINT = "pled: set your tables in /etc/pled/pled.toml, then: systemctl enable --now pled"
pytestmark = [pytest.mark.timeout(1800), pytest.mark.root, pytest.mark.slow]


def changelog_version() -> str:
    return subprocess.run(["dpkg-parsechangelog", "-l", str(ROOT / "debian" / "changelog"), "-S", "Version"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def debs():
    """{version: path} of the two packages built from this checkout: its own version and a higher one."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the package's files are owned by root)")
    gone = [t for t in ("dpkg-buildpackage", "dh_virtualenv", "lintian") if not shutil.which(t)]
    if gone:
        pytest.skip(f"{', '.join(gone)} not installed (`make deb` and .ci/run install dh-virtualenv and lintian)")
    work = Path(tempfile.mkdtemp(prefix="pled-deb-"))
    try:
        version = changelog_version()
        built = {}
        for v, extra in ((version, []), (f"{version}+test1", [f"{version}+test1"])):
            r = subprocess.run([str(ROOT / "tools" / "deb.sh"), str(work / v), *extra], capture_output=True,
                               text=True, timeout=1200)
            assert r.returncode == 0, f"tools/deb.sh {' '.join(extra)} exited {r.returncode}:\n{r.stdout[-6000:]}"
            # every lintian warning fixed, overridden (third-party files) or explained in debian/lintian-warnings
            assert "explained in debian/lintian-warnings or overridden)" in r.stdout, r.stdout
            assert "not explained" not in r.stdout, r.stdout
            built[v] = Path(r.stdout.strip().splitlines()[-1])
        yield built
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_the_package_holds_what_the_manual_install_does_and_lintian_finds_no_error(debs, tmp_path):
    version = changelog_version()
    assert version.split("-")[0] == pled.__version__  # the changelog and pled.__version__ agree
    deb = debs[version]
    tree = tmp_path / "tree"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
    # the files the operations guide has an operator install by hand, from this checkout, unchanged
    for installed, source in [("lib/systemd/system/pled.service", "units/pled.service"),
                              ("lib/systemd/system/pled.service.d/preserve-fdstore.conf",
                               "units/pled.service.d/preserve-fdstore.conf"),
                              ("usr/lib/sysusers.d/pled.conf", "units/pled.sysusers.conf"),
                              ("usr/lib/tmpfiles.d/pled-metrics.conf", "units/pled-metrics.tmpfiles.conf"),
                              ("usr/lib/systemd/catalog/pled.catalog", "units/pled.catalog"),
                              ("etc/pled/pled.toml", "config/pled.toml"),
                              ("usr/share/doc/pled/examples/vllm.service.d/pled.conf",
                               "units/vllm.service.d/pled.conf")]:
        assert (tree / installed).read_bytes() == (ROOT / source).read_bytes(), installed
    assert "ExecStart=/usr/lib/pled/bin/pled serve" in (tree / "lib/systemd/system/pled.service").read_text()
    assert os.readlink(tree / "usr/bin/pled") == "../lib/pled/bin/pled"
    interpreter = os.path.normpath(tree / "usr/lib/pled/bin" / os.readlink(tree / "usr/lib/pled/bin/python3.11"))
    assert interpreter == str(tree / "usr/bin/python3.11")  # Debian's own, not the pyenv one first on this PATH
    assert not (tree / "opt").exists() and not list(tree.rglob("__pycache__"))
    leaks = subprocess.run(["grep", "-rlI", "-e", "/root/.pyenv", "-e", "/tmp/pled-deb.", str(tree)],
                           capture_output=True, text=True)
    assert leaks.stdout == "", leaks.stdout  # no trace of the build host's Python or build directory
    package = subprocess.run(["dpkg-deb", "-f", str(deb), "Package"], capture_output=True, text=True).stdout
    assert package.strip() == "pled"
    control = tmp_path / "control"
    subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True)
    assert (control / "conffiles").read_text().split() == ["/etc/pled/pled.toml"]
    # The libraries bundled in the environment (libgfortran, libquadmath, OpenBLAS) are private: no shlibs file
    # declares them, and no ldconfig trigger runs for them (issue 44, finding 6)
    assert not (control / "shlibs").exists() and not (control / "triggers").exists(), sorted(os.listdir(control))
    # The operator docs and the example config, uncompressed, where pled's messages name them (issue 47, item 7)
    docs = tree / "usr/share/doc/pled"
    for installed, source in [("README.md", "README.md"), ("operations.md", "docs/operations.md"),
                              ("protocol.md", "docs/protocol.md"), ("examples/pled.toml", "config/pled.toml")]:
        assert (docs / installed).read_bytes() == (ROOT / source).read_bytes(), installed

    # lintian: no error; each override is used, has its reason above it, and covers only third-party files
    r = subprocess.run(["lintian", "--display-info", "--show-overrides", "--tag-display-limit", "0", str(deb)],
                       capture_output=True, text=True, timeout=600)
    lines = r.stdout.splitlines()
    assert not [line for line in lines if line.startswith("E:")], r.stdout
    assert not [line for line in lines if "unused-override" in line or "mismatched-override" in line], r.stdout
    overridden = [line for line in lines if line.startswith("O:")]
    assert overridden, r.stdout
    site = "usr/lib/pled/lib/python3.11/site-packages/"
    for line in overridden:
        context = re.search(r"\[(.*)\]$", line)
        assert context and context.group(1).startswith(site) and "/pled/" not in context.group(1)[len(site):], line
    text = (ROOT / "debian" / "pled.lintian-overrides").read_text().splitlines()
    for i, line in enumerate(text):
        if line and not line.startswith("#"):
            assert i > 0 and text[i - 1].startswith("#"), f"override without its reason above it: {line}"


@pytest.fixture(scope="module")
def podman():
    with workspace("pled-deb-podman-") as (work, env):
        try:
            base = base_image(env, {})
            if run(["podman", "image", "exists", SYSTEMD_IMAGE], env, check=False).returncode != 0:
                (work / "Containerfile").write_text(
                    f"FROM {base}\nRUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
                    "--no-install-recommends systemd systemd-sysv procps && apt-get clean && "
                    "rm -rf /var/lib/apt/lists/*\n")
                run(["podman", "build", "--format", "docker", "--layers=false", "-f", str(work / "Containerfile"),
                     "-t", SYSTEMD_IMAGE, str(work)], env, timeout=900)
            yield env
        finally:
            run(["podman", "rm", "-f", "-t", "0", NAME], env, check=False)


def sh(env: dict, script: str, check: bool = True, timeout: float = 600,
       name: str = NAME) -> subprocess.CompletedProcess:
    """A shell script run as root in the container."""
    return run(["podman", "exec", "-e", "DEBIAN_FRONTEND=noninteractive", name, "sh", "-c", script], env,
               check=check, timeout=timeout)


def wait_for(env: dict, script: str, what: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while True:
        r = sh(env, script, check=False)
        if r.returncode == 0:
            return r.stdout
        if time.monotonic() > deadline:
            log = sh(env, "journalctl -u pled --no-pager | tail -30", check=False).stdout
            raise AssertionError(f"{what}: not within {timeout} s: {r.stdout}{r.stderr}\n{log}")
        time.sleep(0.2)


def status(env: dict) -> dict:
    return json.loads(sh(env, "pled status --json").stdout)["tables"][0]


def test_install_start_upgrade_and_purge_under_systemd_as_pid_1(debs, podman):
    env = podman
    before = host_settings()
    version = changelog_version()
    upgrade = f"{version}+test1"
    run(["podman", "run", "-d", "--systemd=always", "--name", NAME, SYSTEMD_IMAGE, "/lib/systemd/systemd"], env)
    state = wait_for(env, "systemctl is-system-running --wait | grep -Ex 'running|degraded'", "systemd ready")
    assert sh(env, "cat /proc/1/comm").stdout.strip() == "systemd", state
    for v in debs:
        run(["podman", "cp", str(debs[v]), f"{NAME}:/root/"], env)

    # node exporter's textfile directory, as prometheus-node-exporter makes it: the package's tmpfiles entry gives
    # user pled an ACL entry there, and purge takes it away again
    sh(env, "mkdir -p /var/lib/prometheus/node-exporter")
    # First install: apt resolves the dependencies from Debian's mirror; nothing is enabled or started.
    r = sh(env, f"apt-get update -qq && apt-get install -y ./root/{debs[version].name}", timeout=900)
    assert (r.stdout + r.stderr).count(HINT) == 1, r.stdout
    assert sh(env, "systemctl is-enabled pled", check=False).stdout.strip() == "disabled"
    assert sh(env, "systemctl is-active pled", check=False).stdout.strip() == "inactive"
    user = sh(env, "getent passwd pled").stdout.strip().split(":")
    group = sh(env, "getent group pled").stdout.strip().split(":")
    assert int(user[2]) < 1000 and user[3] == group[2], (user, group)  # a system user whose primary group is pled
    assert "/etc/pled/pled.toml" in sh(env, "dpkg-query -W -f='${Conffiles}' pled").stdout
    assert sh(env, "test -f /usr/lib/systemd/system/pled.service && command -v pled").stdout.strip() == "/usr/bin/pled"
    assert "user:pled:rwx" in sh(env, "getfacl -cp /var/lib/prometheus/node-exporter").stdout
    operator_checks(env)

    # The units as installed: verify passes (systemd 252 ignores the fd-store drop-in's key with one warning), and
    # the sandbox scores what units/ scores here.
    r = sh(env, "systemd-analyze verify pled.service 2>&1")
    assert [line for line in r.stdout.splitlines() if "FileDescriptorStorePreserve" not in line] == [], r.stdout
    exposure = re.compile(r"Overall exposure level for pled.service: ([\d.]+ \w+)")
    inside = exposure.search(sh(env, "SYSTEMD_COLORS=0 systemd-analyze security --offline=true --no-pager "
                                     "/usr/lib/systemd/system/pled.service").stdout)
    here = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager",
                           str(ROOT / "units" / "pled.service")], capture_output=True, text=True,
                          env={**os.environ, "SYSTEMD_COLORS": "0"})
    assert inside and inside.group(1) == exposure.search(here.stdout).group(1), (inside, here.stdout)

    # pled as user pled: the environment's interpreter and numpy work, a sidecar is read.
    assert sh(env, "runuser -u pled -- pled --version").stdout.strip() == f"pled {pled.__version__}"
    sh(env, "pled make-sidecar --layout ples_int4 --shards 3 /srv/ples_int4 && chmod -R a+rX /srv")
    assert "3 shard(s)" in sh(env, "runuser -u pled -- pled inspect /srv/ples_int4").stdout

    # Started on a table, as the hint says.
    sh(env, "sed -i 's|^#\\[\\[table\\]\\]|[[table]]|; s|^#name = .*|name = \"ples_int4\"|; "
            "s|^#path = .*|path = \"/srv/ples_int4\"|' /etc/pled/pled.toml && systemctl enable --now pled")
    wait_for(env, "pled status", "pled ready")
    first = status(env)
    pid = sh(env, "systemctl show -p MainPID --value pled").stdout.strip()
    assert first["origin"] == "staged" and first["bytes_done"] == first["bytes"] > 0, first
    sh(env, "echo '# edited by the operator' >> /etc/pled/pled.toml")

    group_members_reload(env)

    # The upgrade: postinst try-restarts pled, which adopts the table from the fd store.
    r = sh(env, f"apt-get install -y ./root/{debs[upgrade].name}", timeout=900)
    assert HINT not in r.stdout, r.stdout
    assert sh(env, "dpkg-query -W -f='${Version}' pled").stdout == upgrade
    wait_for(env, "pled status", "pled ready after the upgrade")
    after = status(env)
    assert sh(env, "systemctl show -p MainPID --value pled").stdout.strip() != pid  # restarted
    assert after["origin"] == "adopted" and after["bytes_done"] == 0, after
    assert (after["generation"], after["fingerprint"]) == (first["generation"], first["fingerprint"]), after
    assert "adopted from systemd's fd store: generation 1, 8.0 MiB, 0 bytes copied" in sh(
        env, "journalctl -u pled --no-pager -o cat").stdout
    journal = sh(env, "journalctl -u pled --no-pager -o cat").stdout
    assert "tables adopted, preflight not rerun for them: ples_int4 (their memory was allocated" in journal, journal
    assert sh(env, "tail -1 /etc/pled/pled.toml").stdout.strip() == "# edited by the operator"
    # The container's /sys is read-only: ExecStartPre says so in one line (where the host's shmem_enabled is never)
    # and succeeds, so systemctl status shows no failed step (issue 47, item 10)
    assert "status=2" not in sh(env, "systemctl status pled --no-pager -l", check=False).stdout
    if "[never]" in Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text():
        assert "is never and read-only here (a container?): left as it is, pled uses 4 KiB pages" in journal

    # Purge: no process, unit, config or file of pled's; the user stays.
    sh(env, "apt-get purge -y pled")
    assert sh(env, "pgrep -x pled", check=False).returncode == 1
    assert "0 unit files listed" in sh(env, "systemctl list-unit-files 'pled*' --no-pager", check=False).stdout
    assert sh(env, "systemctl cat pled.service", check=False).returncode != 0
    left = sh(env, "find / -xdev \\( -path /proc -o -path /sys -o -path /root -o -path /srv \\) -prune -o "
                   "-name '*pled*' -print").stdout
    assert left == "", left
    assert sh(env, "dpkg-query -W -f='${Status}' pled", check=False).stdout in ("", "unknown ok not-installed")
    purged_leaves_nothing(env)

    run(["podman", "rm", "-f", "-t", "0", NAME], env)
    assert host_settings() == before


def purged_leaves_nothing(env: dict) -> None:
    purged_leaves_nothing_in(env, NAME)


def purged_leaves_nothing_in(env: dict, name: str) -> None:
    """After `apt-get purge pled`: dpkg knows no file of pled's, no ACL entry names pled, no /run/pled; the user and
    group stay, as Debian's policy for sysusers' users has it (docs/operations.md, Install)."""
    listed = sh(env, "dpkg -L pled", check=False, name=name)
    assert listed.returncode != 0 and listed.stdout == "", listed.stdout
    assert "pled" not in sh(env, "getfacl -cp /var/lib/prometheus/node-exporter", name=name).stdout
    assert sh(env, "test -e /run/pled", check=False, name=name).returncode == 1
    assert sh(env, "getent passwd pled", check=False, name=name).returncode == 0


def operator_checks(env: dict) -> None:
    """What a new operator meets on the installed package (issue 47): pled verify from an environment with what
    pled[client] brings (pled and numpy, no xxhash or pydantic), as vLLM's has, gives one line and exit 69."""
    sh(env, "python3.11 -m venv --without-pip /opt/client && s=/usr/lib/pled/lib/python3.11/site-packages && "
            "cp -r $s/pled $s/numpy $s/numpy.libs /opt/client/lib/python3.11/site-packages/")
    r = sh(env, "/opt/client/bin/python -m pled verify", check=False)
    assert r.returncode == 69 and r.stdout == "" and len(r.stderr.splitlines()) == 1, (r.returncode, r.stderr)
    assert r.stderr.startswith("pled verify: needs the Python module xxhash"), r.stderr
    assert "Traceback" not in r.stderr
    sh(env, "rm -rf /opt/client")  # the test's own, not the package's: the purge's check finds no pled left behind


def group_members_reload(env: dict) -> None:
    """A member of group pled may attach, not reload, and is told so."""
    r = sh(env, "id alice >/dev/null 2>&1 || useradd -G pled alice; runuser -u alice -- pled reload", check=False)
    assert r.returncode == 77 and "only root and user pled may reload" in r.stderr, (r.returncode, r.stderr)


def container_shmem(env: dict, name: str) -> int:
    """Shared memory charged to the container's memory cgroup: a table's memfd until the kernel frees it."""
    stat = sh(env, "cat /sys/fs/cgroup/memory/memory.stat 2>/dev/null || cat /sys/fs/cgroup/memory.stat",
              name=name).stdout
    values = dict(line.split() for line in stat.splitlines() if line.count(" ") == 1)
    return int(values.get("total_shmem", values.get("shmem", -1)))


def test_remove_frees_the_tables_memory_on_systemd_254_and_purge_leaves_nothing(debs, podman):
    """systemd 254 keeps the fd store across a stop (the package's preserve-fdstore.conf): `apt-get remove` must
    empty it (prerm: systemctl clean --what=fdstore), or the tables' memory stays taken with no pled to serve it
    (issue 44, finding 6). Shmem is the container's memory cgroup's figure, not the host's."""
    env = podman
    name = f"{NAME}-254"
    if run(["podman", "image", "exists", SYSTEMD_254_IMAGE], env, check=False).returncode != 0:
        with tempfile.TemporaryDirectory(prefix="pled-deb-254-") as work:
            (Path(work) / "Containerfile").write_text(
                f"FROM {SYSTEMD_IMAGE}\nRUN echo 'deb http://deb.debian.org/debian bookworm-backports main' > "
                "/etc/apt/sources.list.d/backports.list && apt-get update -qq && DEBIAN_FRONTEND=noninteractive "
                "apt-get install -y -qq --no-install-recommends -t bookworm-backports systemd systemd-sysv && "
                "apt-get clean && rm -rf /var/lib/apt/lists/*\n")
            run(["podman", "build", "--format", "docker", "--layers=false", "-f", str(Path(work) / "Containerfile"),
                 "-t", SYSTEMD_254_IMAGE, work], env, timeout=900)
    version = changelog_version()
    run(["podman", "run", "-d", "--systemd=always", "--name", name, SYSTEMD_254_IMAGE, "/lib/systemd/systemd"], env)
    try:
        deadline = time.monotonic() + 120
        while sh(env, "systemctl is-system-running --wait | grep -Ex 'running|degraded'", check=False,
                 name=name).returncode != 0:
            assert time.monotonic() < deadline, "systemd in the container not ready within 120 s"
            time.sleep(0.5)
        assert int(sh(env, "systemctl --version", name=name).stdout.split()[1]) >= 254
        run(["podman", "cp", str(debs[version]), f"{name}:/root/"], env)
        sh(env, "mkdir -p /var/lib/prometheus/node-exporter", name=name)
        sh(env, f"apt-get update -qq && apt-get install -y ./root/{debs[version].name}", timeout=900, name=name)
        before = container_shmem(env, name)
        assert before >= 0
        sh(env, "pled make-sidecar --layout ples_int4 --shards 4 --rows 262144 /srv/ples_int4 && chmod -R a+rX /srv "
                "&& sed -i 's|^#\\[\\[table\\]\\]|[[table]]|; s|^#name = .*|name = \"ples_int4\"|; "
                "s|^#path = .*|path = \"/srv/ples_int4\"|' /etc/pled/pled.toml && systemctl enable --now pled",
           name=name)
        deadline = time.monotonic() + 120
        while sh(env, "pled status", check=False, name=name).returncode != 0:
            assert time.monotonic() < deadline, sh(env, "journalctl -u pled --no-pager | tail", name=name).stdout
            time.sleep(0.2)
        region = json.loads(sh(env, "pled status --json", name=name).stdout)["tables"][0]["region_bytes"]
        assert region > 64 * 2**20
        held = container_shmem(env, name) - before
        assert held >= region * 0.9, (held, region)
        # A stop keeps the table (systemd 254's FileDescriptorStorePreserve=yes): the memory stays taken...
        sh(env, "systemctl stop pled", name=name)
        assert container_shmem(env, name) - before >= region * 0.9
        # ...and a start adopts it, and says the preflight was not rerun, and why (issue 47, item 9)
        sh(env, "systemctl start pled", name=name)
        journal = sh(env, "journalctl -u pled --no-pager -o cat", name=name).stdout
        assert "tables adopted, preflight not rerun for them: ples_int4" in journal, journal
        # apt-get remove: prerm stops pled and empties the fd store; the table's memory is free
        sh(env, "apt-get remove -y pled", name=name)
        left = container_shmem(env, name) - before
        assert left < region * 0.1, (left, region)
        assert sh(env, "test -f /etc/pled/pled.toml", check=False, name=name).returncode == 0  # remove keeps it
        sh(env, "apt-get purge -y pled", name=name)
        purged_leaves_nothing_in(env, name)
    finally:
        run(["podman", "rm", "-f", "-t", "0", name], env, check=False)
