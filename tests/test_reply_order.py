"""Replies come in the order of the calls, even when one of them waits (docs/protocol.md, Framing)."""
import array
import socket

from pled.shared import protocol


def read_replies(sock: socket.socket, n: int) -> list[tuple[bytes, int]]:
    """n NUL-terminated replies, each with the number of fds that came with it."""
    out, buf, fds = [], b"", 0
    while len(out) < n:
        data, anc, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(4 * 4))
        assert data, f"the daemon closed the connection after {len(out)} replies"
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(payload[: len(payload) - len(payload) % 4])
                fds += len(a)
                for fd in a:
                    socket.close(fd)
        buf += data
        while b"\0" in buf and len(out) < n:
            raw, buf = buf.split(b"\0", 1)
            out.append((raw, fds))
            fds = 0
    return out


def test_a_call_behind_a_waiting_attach_is_answered_after_it(sidecar, daemon):
    d = sidecar("ples_int4", shards=4, rows=40_000)  # 16 MB at 8 MB/s: the Attach waits about 2 s
    pled = daemon({"slow": d}, wait="listening on", staging_bandwidth="8MB/s")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(pled.socket)
    try:
        s.sendall(protocol.call(protocol.ATTACH, table="slow", wait=True) + protocol.call(protocol.PING)
                  + protocol.call(protocol.STATUS))
        (first, fds), (second, _), (third, _) = read_replies(s, 3)
    finally:
        s.close()
    assert b'"table":"slow"' in first and fds == 1, first[:200]
    assert second == b'{"parameters":{}}'
    assert b'"uptime_seconds"' in third and b'"state":"ready"' in third
