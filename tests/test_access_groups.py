"""allow_groups against real processes: a client whose supplementary groups (not its primary gid) meet the policy.

The client is a forked child that drops to uid/gid 65534 and sets its supplementary groups with setgroups, so
the test holds however pled learns a peer's groups (/proc/PID/status or SO_PEERGROUPS)."""
import os

import pytest

from forked import as_user
from pled import client

pytestmark = pytest.mark.root
GROUP = 4242  # a gid nobody has: only the child's setgroups gives it


@pytest.mark.parametrize("groups,expected", [([GROUP], "attached"), ([5151, GROUP], "attached"),
                                             ([], "PermissionDenied"), ([5151], "PermissionDenied")])
def test_a_supplementary_group_in_allow_groups_may_attach(sidecar, daemon, open_dir, groups, expected):
    sock = os.path.join(open_dir, "pled.sock")
    pled = daemon({"t": sidecar(shards=1, rows=10)}, socket=sock, allow_groups=[GROUP])
    os.chmod(sock, 0o666)  # the kernel lets anyone connect; pled's own policy decides
    said = as_user(lambda: client.attach("t", socket=sock, populate=False).close() or "attached", groups)
    assert said.startswith(expected), said
    if expected == "PermissionDenied":
        assert "refused pid" in pled.wait_for("uid 65534")
