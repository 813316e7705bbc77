"""An Attach reply carries exactly one fd, the region's (issue 48 class 9a): a reply with none, two, four (all the
client's ancillary buffer takes at once) or five (more: the kernel cuts the control data short, MSG_CTRUNC, and
closes what did not fit) is refused in one line naming the peer's socket, and every fd that arrived is closed:
/proc/self/fd lists the same fds before and after. The server is tests/fakeserver.py's, a real Unix socket sending
real fds (a sealed region's memfd first, then pipes' ends)."""
from __future__ import annotations

import json
import os
import time

import pytest

from fakeserver import FakeServer
from pled.client.connection import ProtocolError
from pled.client.library import attach
from pled.shared import region
from pled.shared.region import ALIGN, Manifest, ShardEntry, TensorEntry


def _region_fd() -> int:
    import fcntl

    shard = ShardEntry(0, "/srv/t/shard_0.safetensors", 64, 1, 2, 3, "a" * 64, ALIGN, 0, "")
    m = Manifest("t", "safetensors", 0, 0, ALIGN, 2 * ALIGN, "f" * 64, (shard,),
                 (TensorEntry("w", 0, "U8", (64,), ALIGN, 64),))
    fd = os.memfd_create("fake-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 2 * ALIGN)
    os.pwrite(fd, region.encode_header(m), 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, region.SEALS)
    return fd


def _fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own
            pass
    return out


REPLY = json.dumps({"parameters": {"table": "t", "generation": 1, "fingerprint": "f" * 64,
                                   "region_bytes": 2 * ALIGN}}).encode()


@pytest.mark.parametrize("count, says", [
    (0, "sent 0 file descriptors for table 't', expected 1"),
    (2, "sent 2 file descriptors with one reply; a reply carries at most 1"),
    (4, "sent 4 file descriptors with one reply; a reply carries at most 1"),
    (5, "cut short the file descriptors pled at"),
], ids=["none", "two", "four", "cut-short"])
def test_an_attach_reply_without_exactly_one_fd_is_refused_and_every_fd_closed(tmp_path, count, says):
    before = _fds()
    sent = [_region_fd()] if count else []
    pipes = [os.pipe() for _ in range(max(0, count - 1) // 2 + 1)]
    sent += [fd for pair in pipes for fd in pair][: max(0, count - 1)]
    server = FakeServer(str(tmp_path / "pled.sock"), REPLY, sent)  # closes the fds it sent when it is done
    try:
        with pytest.raises(ProtocolError) as caught:
            attach("t", socket=server.path, timeout=10, populate=False).close()
    finally:
        server.join()
        for pair in pipes:
            for fd in pair:
                if fd not in sent:
                    os.close(fd)
    said = str(caught.value)
    assert says in said and server.path in said and "\n" not in said, said
    deadline = time.monotonic() + 5  # nothing of ours runs after the refusal; the loop only tolerates a slow GC
    while _fds() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _fds() == before, {k: v for k, v in _fds().items() if before.get(k) != v}
