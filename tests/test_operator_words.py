"""What pled tells an operator is true (issue 47): found by trying the Debian package as a new operator would
(install, config, start, status, reload, restart, verify, upgrade, remove, purge), each checked here on a real pled
serve and the real `pled` command.

- The staging line counts a table's source files by what they are: a sidecar's shards, a glob's files, a model
  checkpoint's files (a checkpoint table's "shards" are the pieces each PLE table is split into, not its files; the
  journal said "staged: 78.5 KiB in 3 shards" for a checkpoint of 3 files).
- `pled status` says when a table's files on disk are no longer the ones it staged (its JSON said
  "sources": "changed: ...", the table view said nothing), and what to do.
- `allow_uids` admits nobody the socket's modes keep out (the docs said it "admits others too"): the uid needs the
  ACL entries operations.md's drop-in gives it (written here as setfacl writes them: the host has no setfacl), and
  then pled's own check decides.
- A socket directory owned by another user is named with both uids: `pled serve` by root beside pled.service said
  "/run/pled belongs to uid 997, who could replace pled's socket; use a directory owned by root or pled's user", where
  uid 997 is user pled.
- A rate below 0.1 GB/s is in MB/s: a checkpoint's small files were staged and verified "(0.00 GB/s)".
- `pled status`, `verify` and `reload` where this user may not (the socket's modes, pled's check, a reload by a group
  member) exit 77, EX_NOPERM, not 1: status's 1 is "a table not ready", verify's 1 "a difference found".
"""
from __future__ import annotations

import encodings.ascii  # noqa: F401  the forked children cannot import it: the stdlib may sit under a 0700 home
import os
import struct

import pytest

import harness
import pled.cli
import pled.verify  # noqa: F401  imported before the fork, as the children may not read the stdlib
from forked import as_user
from harness import unused_gid, write_config
from pled import client
from pled.daemon.sources.safetensors_file import write
from pled.generator import make_checkpoint, make_sidecar
from pled.shared.sizes import rate

ACL_UNDEFINED = 0xFFFFFFFF  # the id of an ACL entry that is not a named user's or group's


def add_user_acl(path: str, uid: int, perm: int) -> None:
    """`setfacl -m u:UID:PERM PATH` on a file with no ACL yet: the owner's, group's and others' entries from its mode,
    the named user's, and the mask (the union of group and named entries), in the kernel's xattr form."""
    mode = os.stat(path).st_mode
    owner, group, other = (mode >> 6) & 7, (mode >> 3) & 7, mode & 7
    entries = [(0x01, owner, ACL_UNDEFINED), (0x02, perm, uid), (0x04, group, ACL_UNDEFINED),
               (0x10, group | perm, ACL_UNDEFINED), (0x20, other, ACL_UNDEFINED)]
    os.setxattr(path, "system.posix_acl_access",
                struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))


@pytest.mark.daemon
def test_the_staging_line_names_shards_files_and_checkpoint_files_and_status_notes_changed_sources(tmp_path, daemon):
    make_sidecar(str(tmp_path / "sidecar"), "ples_int4", shards=2, rows=256)
    make_checkpoint(str(tmp_path / "ckpt"), "nvfp4", {0: 500, 1: 700}, width=64, parts=4, files=3)
    (tmp_path / "glob").mkdir()
    for i in range(2):  # any .safetensors files (no PLE layout's tensors): a generic table, staged file by file
        write(str(tmp_path / "glob" / f"part{i}.safetensors"), [("embed", "U8", (64, 32), bytes(range(256)) * 8)])
    pled = daemon({"side": tmp_path / "sidecar", "qwen": {"checkpoint": tmp_path / "ckpt"},
                   "loose": tmp_path / "glob" / "*.safetensors"})
    log = pled.log()
    assert "table side staged: " in log and "table qwen staged: " in log and "table loose staged: " in log, log
    lines = {name: next(line for line in log.splitlines() if f"table {name} staged: " in line)
             for name in ("side", "qwen", "loose")}
    assert " in 2 shards, " in lines["side"], lines
    assert " in 3 checkpoint files, " in lines["qwen"] and "shard" not in lines["qwen"], lines
    assert " in 2 files, " in lines["loose"] and "shard" not in lines["loose"], lines

    before = harness.run_pled("status", "--socket", pled.socket)
    assert before.returncode == 0 and "source files" not in before.stdout, before.stdout
    changed = tmp_path / "ckpt" / "model-00002-of-00003.safetensors"
    st = os.stat(changed)
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a copy of a new checkpoint over it leaves it
    # Status gives a check's answer again for half a second (a flood of calls starts no check per call): until then
    # it may still say "unchanged"
    after = harness.wait_until(lambda: (r := harness.run_pled("status", "--socket", pled.socket)).returncode == 0
                               and "source files" in r.stdout and r, message="no note on the changed file")
    notes = [line for line in after.stdout.splitlines() if "source files" in line]
    assert notes == ["  note: qwen: served as staged, but its source files are not as pled staged them (changed: "
                     "model-00002-of-00003.safetensors): `pled verify qwen` compares them, `pled reload` stages "
                     "what is there now"], after.stdout


def attached(sock: str) -> str:
    with client.attach("t", socket=sock) as t:
        return f"attached {t.manifest.rows} rows"


@pytest.mark.daemon
@pytest.mark.root
def test_allow_uids_admits_a_uid_only_with_the_acl_entries_of_the_docs_drop_in(tmp_path, sidecar, open_dir):
    g = unused_gid(61000)
    sock = os.path.join(open_dir, "acl", "pled.sock")
    tables = {"t": sidecar(shards=2, rows=300)}
    pled = harness.start(tmp_path, tables, name="acl", socket=sock, group=g, extra_groups=[], allow_uids=[65534])
    try:
        # allow_uids alone: the kernel turns uid 65534 away at the socket's 0750 directory, before pled sees it
        said = as_user(lambda: attached(sock), [])
        assert f"uid 65534 may not search the directory {os.path.dirname(sock)} (mode 0750" in said, said
        # the drop-in's ExecStartPost= lines: setfacl -m u:65534:x /run/pled, setfacl -m u:65534:rw the socket
        add_user_acl(os.path.dirname(sock), 65534, 1)
        add_user_acl(sock, 65534, 6)
        assert as_user(lambda: attached(sock), []) == "attached 600 rows"
        # the ACL without allow_uids: pled's own check refuses the uid
        write_config(tmp_path / "acl.toml", tables, socket=sock, headroom_margin=0)
        assert pled.reload() == "reload done"
        said = as_user(lambda: attached(sock), [])
        assert said.startswith("PermissionDenied") and "refused uid 65534" in said, said
    finally:
        pled.stop()


def cli(*argv: str) -> str:
    """`pled ARGV` in this (forked) process: its exit status, as a str."""
    return str(pled.cli.main(list(argv)))


@pytest.mark.daemon
@pytest.mark.root
def test_status_verify_and_reload_exit_77_where_this_user_may_not(tmp_path, open_dir):
    import xxhash  # noqa: F401  verify's; imported here, as the forked child may not read the stdlib's directory

    g = unused_gid(61300)
    sock = os.path.join(open_dir, "perm", "pled.sock")
    make_sidecar(os.path.join(open_dir, "side"), "ples_int4", shards=2, rows=300)  # verify reads it as the user
    daemon = harness.start(tmp_path, {"t": os.path.join(open_dir, "side")}, name="perm", socket=sock, group=g,
                           extra_groups=[])
    try:
        # outside group g: the 0750 directory keeps the user out
        assert [as_user(lambda c=c: cli(c, "--socket", sock), []) for c in ("status", "verify", "reload")] == \
            ["77"] * 3
        # in group g: status and verify answer (0: healthy, identical); a reload is for root and user pled only
        assert [as_user(lambda c=c: cli(c, "--socket", sock), [g]) for c in ("status", "verify", "reload")] == \
            ["0", "0", "77"]
        # pled's own check: the file system opened up, a uid neither in g nor in allow_uids is refused by pled
        os.chmod(os.path.dirname(sock), 0o755)
        os.chmod(sock, 0o666)
        assert as_user(lambda: cli("status", "--socket", sock), []) == "77"
        assert as_user(lambda: cli("verify", "--socket", sock), []) == "77"
        assert as_user(lambda: cli("verify", "t", "--socket", sock), []) == "77"  # a table named: no Status first
    finally:
        daemon.stop()


def test_a_small_files_rate_is_in_mb_s_not_zero_gb_s():
    assert rate(80424, 0.033) == "2.4 MB/s"  # the checkpoint file of the trial: "0.00 GB/s" before
    assert (rate(6553824, 0.027), rate(10**9, 0.5)) == ("0.24 GB/s", "2.00 GB/s")  # from 0.1 GB/s on, as before


@pytest.mark.daemon
@pytest.mark.root
def test_a_socket_directory_of_another_user_is_named_with_both_uids(tmp_path, sidecar, open_dir):
    run = os.path.join(open_dir, "run")
    os.mkdir(run, 0o750)
    os.chown(run, 65534, 0)  # as /run/pled is pled.service's user's, for a pled started by hand as root
    served = harness.start(tmp_path, {"t": sidecar(shards=1, rows=64)}, socket=os.path.join(run, "pled.sock"))
    try:
        assert (f"the socket's directory {run} belongs to uid 65534, neither root nor uid 0 that this pled runs as, so "
                "uid 65534 could replace this pled's socket; use a directory owned by root or uid 0") in served.log()
    finally:
        served.stop()
