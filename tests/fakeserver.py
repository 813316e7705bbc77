"""A stand-in for pled's socket, for tests of what a client does with replies pled itself never sends."""
from __future__ import annotations

import json
import os
import socket
import threading


class FakeServer:
    """Serves one connection at ``path``: reads one call (kept, parsed, in ``call``), answers ``reply`` (NUL added)
    with ``fds`` on its first byte, then closes everything it holds, the fds it sent included. ``drip``: send one
    byte a second instead, until the client goes away or ``stop`` is set. ``hang``: answer nothing at all, holding
    the connection until ``stop`` is set (a wedged pled: the kernel accepted, the server never answers)."""

    def __init__(self, path: str, reply: bytes, fds: list[int] = (), drip: bool = False, hang: bool = False) -> None:
        self.path, self.reply, self.fds, self.drip, self.hang = path, reply + b"\0", list(fds), drip, hang
        self.stop = threading.Event()
        self.call: dict | None = None
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.bind(path)
        self.listener.listen(1)
        self.listener.settimeout(10)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                call = b""
                while not call.endswith(b"\0"):
                    call += conn.recv(65536) or b"\0"
                self.call = json.loads(call[:-1] or b"null")
                if self.hang:
                    self.stop.wait(60)
                    return
                if self.fds:
                    socket.send_fds(conn, [self.reply[:1]], self.fds)
                else:
                    conn.sendall(self.reply[:1])
                if not self.drip:
                    conn.sendall(self.reply[1:])
                    return
                for i in range(1, len(self.reply)):
                    if self.stop.wait(1.0):
                        return
                    conn.sendall(self.reply[i:i + 1])
        except OSError:  # the client hung up: it is entitled to
            pass
        finally:
            self.listener.close()
            for fd in self.fds:
                os.close(fd)

    def join(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
