"""The fifth attack (issue 44, "Must show"): who gets a writable table's read-write fd is decided by the config pled
loaded, not by what the host's user database says at each Attach.

Finding: ``writers = ["name"]`` was resolved through NSS (``pwd.getpwnam``) on the loop at every Attach. Once the
user was removed from /etc/passwd, every Attach of the table (the non-writers' included) failed with
io.pled.InternalError; once the name was given to another uid, that uid got the read-write fd without any reload;
and a name service that hangs (LDAP, sssd) would hold the loop at each Attach. Names are now resolved once, when the
config is loaded (start, reload), and the uids kept; `allow_groups` alike.

Real processes: pled runs in a mount namespace of its own in which a copy of /etc/passwd, which the test then
changes in place, is bound over /etc/passwd (the host's own file is never touched); the clients are real processes
of real uids (forked children that drop root)."""
import encodings.ascii  # noqa: F401 (a forked child that dropped root cannot import from root's Python any more)
import os
import shutil
from pathlib import Path

import pytest

import harness
from forked import become, in_child
from pled import client
from pled.generator import make_sidecar

pytestmark = [pytest.mark.root, pytest.mark.daemon]

WRITER = harness.unused_gid(4700)  # the uid "a5writer" names at first
OTHER = WRITER + 1  # the uid the name moves to


def passwd_with(path: Path, uid: int | None) -> None:
    """Write (in place: the bind mount holds this inode) the host's /etc/passwd plus a5writer as ``uid``."""
    text = Path("/etc/passwd").read_text()
    if uid is not None:
        text += f"a5writer:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin\n"
    with open(path, "r+") as f:
        f.truncate(0)
        f.write(text)


def attach_as(uid: int | None, sock: str) -> str:
    """Attach table t as ``uid`` (None: root, this process's uid, in a child too) in a forked child: whether it
    got the writer's fd, or the error."""
    def action():
        t = client.attach("t", socket=sock, populate=False)
        try:
            return f"attached writer={t.writer}"
        finally:
            t.close()
    return in_child(action, before=None if uid is None else lambda: become(uid, [0]))  # in pled's group (root)


@pytest.fixture
def served(open_dir, pleds):
    root = Path(open_dir)
    passwd = root / "passwd"
    passwd.write_text("")
    passwd_with(passwd, WRITER)
    sc = root / "sc"
    make_sidecar(str(sc), "ples_int4", shards=2, rows=64)
    for p in [sc, *sc.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c",
              'mount --bind "$0" /etc/passwd && exec "$@"', str(passwd)]
    sock = str(root / "run" / "pled.sock")
    (root / "run").mkdir(mode=0o755)
    pled = harness.start(root, {"t": {"path": str(sc), "gpu_access": "writable", "writers": ["a5writer"],
                                      "verify_interval": 3600}},
                         socket=sock, prefix=prefix)
    pleds.append(pled)
    client.attach("t", socket=sock).close()  # every module an attach needs, imported before a child drops root
    assert attach_as(WRITER, sock) == "attached writer=True"
    assert attach_as(OTHER, sock) == "attached writer=False"
    yield pled, sock, passwd
    shutil.rmtree(sc)


def test_removing_a_writer_from_the_user_database_does_not_fail_every_attach(served):
    pled, sock, passwd = served
    passwd_with(passwd, None)  # `userdel a5writer`, as pled's namespace sees it
    said = [attach_as(None, sock), attach_as(OTHER, sock), attach_as(WRITER, sock)]
    assert said == ["attached writer=False", "attached writer=False", "attached writer=True"], \
        f"after the writer's name left /etc/passwd, attaches said {said}; pled log:\n{pled.log()[-2000:]}"
    assert "Traceback" not in pled.log()


def test_a_writers_name_given_to_another_uid_gives_it_no_write_access_without_a_reload(served):
    pled, sock, passwd = served
    passwd_with(passwd, OTHER)  # the name now names another uid
    said = {"other": attach_as(OTHER, sock), "writer": attach_as(WRITER, sock)}
    assert said == {"other": "attached writer=False", "writer": "attached writer=True"}, \
        f"the config pled loaded names uid {WRITER} the writer; after /etc/passwd changed, attaches said {said}"


def test_a_reload_reads_the_names_again_and_refuses_a_writer_that_is_gone(served):
    pled, sock, passwd = served
    passwd_with(passwd, None)
    r = harness.run_pled("reload", "-c", str(pled.config))
    assert r.returncode != 0 and "a5writer" in r.stderr and len(r.stderr.strip().splitlines()) == 1, \
        (r.returncode, r.stderr)
    assert attach_as(None, sock) == "attached writer=False"  # still serving what it served
    passwd_with(passwd, OTHER)
    harness.run_pled("reload", "-c", str(pled.config))
    assert harness.wait_until(lambda: attach_as(OTHER, sock) == "attached writer=True", 30)


def test_names_in_a_loaded_config_are_resolved_once(tmp_path):
    """The config alone, in a process whose /etc/passwd and /etc/group are copies bound over the host's (a mount
    namespace of its own): after both lose the names, the loaded config still gives the uids and gids they had."""
    import subprocess
    import sys

    passwd, group = tmp_path / "passwd", tmp_path / "group"
    passwd.write_text(Path("/etc/passwd").read_text() + f"a5writer:x:{WRITER}:{WRITER}::/:/usr/sbin/nologin\n")
    group.write_text(Path("/etc/group").read_text() + f"a5group:x:{OTHER}:\n")
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from pled.daemon.config import Config\n"
        "c = Config.model_validate({'allow_groups': ['a5group'], 'table': [{'name': 't', 'path': '/x', "
        "'gpu_access': 'writable', 'writers': ['a5writer', 5]}]})\n"
        "for p in sys.argv[1:]:\n"
        "    with open(p, 'r+') as f:\n"
        "        lines = [l for l in f.read().splitlines(True) if not l.startswith('a5')]\n"
        "        f.seek(0); f.truncate(0); f.write(''.join(lines))\n"
        "print(sorted(c.tables[0].writer_uids), sorted(c.allow_gids))\n")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        'mount --bind "$0" /etc/passwd && mount --bind "$1" /etc/group && shift && exec "$@"',
                        str(passwd), str(group), sys.executable, "-c", code, str(passwd), str(group)],
                       capture_output=True, text=True, timeout=60, cwd=str(Path(__file__).resolve().parent.parent))
    assert r.returncode == 0 and r.stdout.split("\n")[0] == f"[5, {WRITER}] [{OTHER}]", (r.returncode, r.stdout,
                                                                                        r.stderr[-2000:])
