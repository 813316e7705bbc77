"""Who may attach, with real non-root clients: a forked child drops to uid 65534 with chosen groups
(setgroups, setgid, setuid) and attaches to a real pled whose effective gid is G, as under
pled.service's User=pled/Group=pled with vLLM's SupplementaryGroups=pled.
"""
import encodings.ascii  # noqa: F401  the children cannot import it: Python's stdlib may sit under root's 0700 home
import hashlib
import os

import pytest
import torch

from forked import as_user
from harness import Daemon, start, unused_gid
from pled import client

ROWS = torch.arange(0, 8000, 13)


def gather_digest(sock: str) -> str:
    """Attach to table t and gather rows from it: a digest of what came back."""
    with client.attach("t", socket=sock) as t:
        return "attached " + hashlib.sha256(t.gather(ROWS).float().numpy().tobytes()).hexdigest()


def open_up(sock: str) -> None:
    """Let anyone reach the socket, so that pled's own check decides."""
    os.chmod(os.path.dirname(sock), 0o755)
    os.chmod(sock, 0o666)


def start_in_group(tmp_path, sidecar, open_dir, gid: int, name: str, **keys) -> tuple[Daemon, str]:
    """pled as root with effective (and only) gid ``gid``, serving table t; its socket, in ``open_dir``."""
    sock = os.path.join(open_dir, name, "pled.sock")
    return start(tmp_path, {"t": sidecar(shards=2, rows=4000)}, name=name, socket=sock, group=gid, extra_groups=[],
                 **keys), sock


@pytest.mark.daemon
@pytest.mark.root
def test_members_of_pleds_group_attach_and_others_are_refused(sidecar, tmp_path, open_dir):
    g = unused_gid(61000)
    pled, sock = start_in_group(tmp_path, sidecar, open_dir, g, "run")
    try:
        # The file system's part: socket 0660 and its directory 0750, both group G, as pled made them.
        st, dst = os.stat(sock), os.stat(os.path.dirname(sock))
        assert (st.st_mode & 0o777, st.st_gid, dst.st_mode & 0o777, dst.st_gid) == (0o660, g, 0o750, g)
        # Supplementary group G only (primary gid 65534): the kernel's SO_PEERGROUPS says so, pled admits it.
        member = as_user(lambda: gather_digest(sock), [g])
        # A peer in 300 groups, G last: more than Python's getsockopt buffer holds, read with a larger one.
        many = as_user(lambda: gather_digest(sock), list(range(70000, 70299)) + [g])
        assert member == many == as_user(lambda: gather_digest(sock), None)  # what root gathers
        assert "table t generation 1 to pid" in pled.wait_for("uid 65534")

        # The same uid without G: the socket's mode keeps it out...
        said = as_user(lambda: gather_digest(sock), [])
        assert f"uid 65534 may not search the directory {os.path.dirname(sock)} (mode 0750" in said, said
        # ...and with the mode opened up, pled's own check refuses it.
        open_up(sock)
        said = as_user(lambda: gather_digest(sock), [g + 1])
        assert said.startswith("PermissionDenied") and "refused uid 65534: run it in pled's group" in said, said
        assert "refused pid" in pled.wait_for("refused pid")
    finally:
        pled.stop()


@pytest.mark.daemon
@pytest.mark.root
def test_allow_groups_widens_pleds_group(sidecar, tmp_path, open_dir):
    g = unused_gid(61000)
    other = unused_gid(g + 1)
    pled, sock = start_in_group(tmp_path, sidecar, open_dir, g, "wide", allow_groups=[other])
    try:
        open_up(sock)  # so that the file system lets group `other` in and pled decides
        assert as_user(lambda: gather_digest(sock), [other]).startswith("attached")
        assert as_user(lambda: gather_digest(sock), [other + 1]).startswith("PermissionDenied")
    finally:
        pled.stop()


def test_ids_a_private_user_namespace_does_not_map(tmp_path):
    """PrivateUsers=yes maps root and pled's own ids only; an allow_uids entry outside that can never match."""
    (tmp_path / "uid_map").write_text("         0          0          1\n       998        998          1\n")
    (tmp_path / "gid_map").write_text("         0          0 4294967295\n")
    from pled.daemon.serving.access import unmapped_ids

    assert unmapped_ids("uid", [0, 998, 1000], proc=str(tmp_path)) == {1000}
    assert unmapped_ids("gid", [5, 1000], proc=str(tmp_path)) == set()
    assert unmapped_ids("uid", [1000]) == set()  # this test's own namespace maps everything
