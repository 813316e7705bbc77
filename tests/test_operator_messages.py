"""What pled tells an operator is true and actionable (issue 47): a command missing a module says which in one line
with its own exit status; a failed connect names the path and the real cause, for each errno a host gives; a group
member's `pled reload` is told who may reload. Real sockets, a real pled and real non-root clients (forked children
that drop to uid 65534); the missing module is made missing in the command's own process (sys.modules[name] = None,
what Python does for a module that is not installed)."""
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from forked import as_user
from harness import clean_env, run_pled, start, unused_gid
from pled import client
from pled.client.connection import Connection
from pled.shared import protocol

ROOT = Path(__file__).resolve().parent.parent


def cli_without(module: str, *argv: str) -> subprocess.CompletedProcess:
    """`pled ARGV` in a process where ``module`` cannot be imported, as in vLLM's environment with pled[client]."""
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            f"from pled.cli import main; sys.exit(main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=60)


@pytest.mark.parametrize(("module", "argv"), [
    ("xxhash", ["verify", "--socket", "/nonexistent/pled.sock"]),  # before it even connects
    ("pydantic", ["preflight", "-c", "/nonexistent/pled.toml"]),
    ("pydantic", ["serve", "-c", "/nonexistent/pled.toml"]),
])
def test_a_command_whose_module_is_missing_says_which_in_one_line_and_exits_69(module, argv):
    r = cli_without(module, *argv)
    assert r.returncode == 69, (r.returncode, r.stderr)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"pled {argv[0]}: needs the Python module {module}, which this environment "
                               f"({sys.prefix}) does not have: it comes with pled's daemon extra "
                               "(pip install 'pled[daemon]')"), r.stderr


def test_the_readmes_exit_statuses_name_each_one_pled_uses():
    text = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| (.*) \|$", text[text.index("Exit status:"):], flags=re.M))
    for code, says in [("0", "clean stop"), ("1", "a difference found"), ("3", "no pled answers"),
                       ("64", "arguments"), ("69", "Python module the command needs is not installed"),
                       ("78", "EX_CONFIG"), ("130", "Ctrl-C")]:
        assert says in rows.get(code, ""), (code, rows)


def connect(path: str) -> str:
    try:
        Connection(path, timeout=2).close()
    except client.ClientError as err:
        return f"{type(err).__name__}: {err}"
    return "connected"


def test_connect_errors_name_the_path_and_the_cause(tmp_path):
    # ENOENT: no socket in an existing directory; and no directory either
    said = connect(str(tmp_path / "pled.sock"))
    assert said.startswith(f"DaemonUnavailable: pled is not running: no socket at {tmp_path}/pled.sock;"), said
    said = connect(str(tmp_path / "run" / "pled.sock"))
    assert said.startswith(f"DaemonUnavailable: pled is not running: pled's socket {tmp_path}/run/pled.sock does "
                           f"not exist, nor its directory {tmp_path}/run "), said
    # ECONNREFUSED: a socket left behind, nobody listening
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()
    said = connect(str(tmp_path / "stale.sock"))
    assert said.startswith(f"DaemonUnavailable: pled is not running: nothing listens at pled's socket "
                           f"{tmp_path}/stale.sock (a socket left by a pled that stopped)"), said
    # not a socket: a regular file, a directory (the first is ECONNREFUSED to the kernel, the second too)
    (tmp_path / "file").write_text("")
    for path, kind in ((tmp_path / "file", "regular file"), (tmp_path, "directory")):
        said = connect(str(path))
        assert said.startswith(f"DaemonUnavailable: pled's socket {path} is not a socket but a {kind}: "), said
    # EAGAIN: a listener whose queue is full
    full = socket.socket(socket.AF_UNIX)
    full.bind(str(tmp_path / "full.sock"))
    full.listen(0)
    queued = []
    try:
        for _ in range(8):
            said = connect_held(str(tmp_path / "full.sock"), queued)
            if said != "connected":
                break
        assert said.startswith(f"DaemonUnavailable: pled at {tmp_path}/full.sock accepts no more connections now "
                               "(its queue is full: Resource temporarily unavailable)"), said
    finally:
        for s in queued:
            s.close()
        full.close()
    # ENOTDIR: a file on the way
    said = connect(str(tmp_path / "file" / "pled.sock"))
    assert said.startswith(f"DaemonUnavailable: cannot connect to pled's socket {tmp_path}/file/pled.sock: Not a "
                           "directory;"), said


def connect_held(path: str, held: list) -> str:
    """connect(), keeping the connection open (a listener's queue fills up)."""
    try:
        held.append(Connection(path, timeout=2))
    except client.ClientError as err:
        return f"{type(err).__name__}: {err}"
    return "connected"


@pytest.mark.root
def test_a_directory_this_user_may_not_search_is_permission_denied_with_the_group_to_join(open_dir):
    """The socket's directory 0750 (pled.service's RuntimeDirectoryMode=), group G: uid 65534 outside G is told to
    join G, naming the directory, not "no such file"."""
    g = unused_gid(61100)
    run = os.path.join(open_dir, "run")
    os.mkdir(run, 0o750)
    os.chown(run, 0, g)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(run, "pled.sock"))
    os.chmod(os.path.join(run, "pled.sock"), 0o660)
    os.chown(os.path.join(run, "pled.sock"), 0, g)
    listener.listen()
    try:
        sock = os.path.join(run, "pled.sock")
        said = as_user(lambda: connect(sock), [])
        assert said == (f"PermissionDenied: permission denied: pled's socket {sock}: uid 65534 may not search the "
                        f"directory {run} (mode 0750, owner root, group {g}): add this user to group {g} (usermod "
                        f"-aG {g} USER, then log in again; a unit: SupplementaryGroups={g}), or run as root"), said
        # the directory opened, the socket's own mode refuses: it is named instead
        os.chmod(run, 0o755)
        said = as_user(lambda: connect(sock), [])
        assert said.startswith(f"PermissionDenied: permission denied: pled's socket {sock}: uid 65534 may not write "
                               f"to the socket {sock} (mode 0660, owner root, group {g}): add this user to group "
                               f"{g} "), said
        assert as_user(lambda: connect(sock), [g]) == "connected"  # a member passes both
    finally:
        listener.close()


@pytest.mark.daemon
@pytest.mark.root
def test_a_group_members_reload_is_told_who_may_reload(tmp_path, sidecar, open_dir):
    g = unused_gid(61200)
    sock = os.path.join(open_dir, "run", "pled.sock")
    pled = start(tmp_path, {"t": sidecar(shards=2, rows=256)}, socket=sock, group=g, extra_groups=[])
    try:
        def reload() -> str:
            try:
                client.call(protocol.RELOAD, socket=sock, timeout=10)
            except client.ClientError as err:
                return f"{type(err).__name__}: {err}"
            return "reloaded"

        said = as_user(reload, [g])
        assert said == (f"PermissionDenied: pled at {sock} refused the reload from uid 65534: only root and user pled "
                        "may reload (group pled may only attach); run `sudo pled reload` or `sudo systemctl reload "
                        "pled`"), said
        assert as_user(reload, None) == "reloaded"  # root may
    finally:
        assert pled.stop() == 0


@pytest.mark.daemon
def test_status_shows_content_that_follows_the_bytes_and_names_source_and_region_sizes(tmp_path, sidecar):
    """`pled status`'s CONTENT changes when a table's bytes do (the JSON's fingerprint, of layout and headers, does
    not); SOURCE is the files' bytes, REGION the memfd's with header and alignment, each named (issue 47, item 8)."""
    from pled.shared.sizes import gib

    d = sidecar(shards=3, rows=2000)
    pled = start(tmp_path, {"t": f"{d}/*.safetensors"})  # files without META.json's digests: any bytes go
    try:
        def table() -> tuple[dict, str]:
            st = json.loads(run_pled("status", "--json", "--socket", pled.socket).stdout)["tables"][0]
            return st, run_pled("status", "--socket", pled.socket).stdout

        first, text = table()
        header, row = text.splitlines()[1:3]
        assert header.split() == ["TABLE", "STATE", "FILES", "SOURCE", "REGION", "RESIDENT", "HUGE", "PAGES", "GEN",
                                  "CONTENT"], header
        assert first["region_bytes"] > first["bytes"]  # a header and 2 MiB alignment
        cells = row.split()
        assert cells[2] == "3/3" and " ".join(cells[3:7]) == f"{gib(first['bytes'])} {gib(first['region_bytes'])}"
        assert cells[-1] == first["content_digest"].partition(":")[2][:12], (row, first["content_digest"])
        assert "SOURCE: the files' bytes pled copies; REGION: the memory each table holds, with its header" in text
        # the same headers and sizes, other bytes (one byte of the last shard's data): a reload restages it
        shard = sorted(d.glob("*.safetensors"))[-1]
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        said = pled.reload()
        second, text = table()
        assert second["generation"] == first["generation"] + 1, (said, pled.log()[-3000:])
        assert second["generation"] == first["generation"] + 1
        assert second["fingerprint"] == first["fingerprint"]  # layout and headers: unchanged, as its name now says
        assert second["content_digest"] != first["content_digest"]
        assert text.splitlines()[2].split()[-1] == second["content_digest"].partition(":")[2][:12]
    finally:
        assert pled.stop() == 0
