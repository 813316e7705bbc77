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


def sh(env: dict, script: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """A shell script run as root in the container."""
    return run(["podman", "exec", "-e", "DEBIAN_FRONTEND=noninteractive", NAME, "sh", "-c", script], env,
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
    assert sh(env, "tail -1 /etc/pled/pled.toml").stdout.strip() == "# edited by the operator"

    # Purge: no process, unit, config or file of pled's; the user stays.
    sh(env, "apt-get purge -y pled")
    assert sh(env, "pgrep -x pled", check=False).returncode == 1
    assert "0 unit files listed" in sh(env, "systemctl list-unit-files 'pled*' --no-pager", check=False).stdout
    assert sh(env, "systemctl cat pled.service", check=False).returncode != 0
    left = sh(env, "find / -xdev \\( -path /proc -o -path /sys -o -path /root -o -path /srv \\) -prune -o "
                   "-name '*pled*' -print").stdout
    assert left == "", left
    assert sh(env, "dpkg-query -W -f='${Status}' pled", check=False).stdout in ("", "unknown ok not-installed")
    assert sh(env, "getent passwd pled", check=False).returncode == 0

    run(["podman", "rm", "-f", "-t", "0", NAME], env)
    assert host_settings() == before
