"""pled's wire format: Varlink-shaped JSON on a Unix stream socket.

Each message is one JSON object followed by a NUL byte. A call is
``{"method": "io.pled.Attach", "parameters": {...}}``; a reply is
``{"parameters": {...}}`` or ``{"error": "io.pled.NoSuchTable", "parameters": {...}}``.
An Attach reply carries the table's memfd as SCM_RIGHTS ancillary data.
See docs/protocol.md. Shared by the daemon and its clients: standard library (and boundary.py) only.
"""
from __future__ import annotations

import json

from pled.shared.boundary import BoundaryError, load_json

ATTACH = "io.pled.Attach"
STATUS = "io.pled.Status"
PING = "io.pled.Ping"
RELOAD = "io.pled.Reload"

NO_SUCH_TABLE = "io.pled.NoSuchTable"
NOT_READY = "io.pled.NotReady"
PERMISSION_DENIED = "io.pled.PermissionDenied"
INVALID_MESSAGE = "io.pled.InvalidMessage"
RELOAD_FAILED = "io.pled.ReloadFailed"
INTERNAL_ERROR = "io.pled.InternalError"  # pled failed handling this call; it serves on
METHOD_NOT_FOUND = "org.varlink.service.MethodNotFound"
INVALID_PARAMETER = "org.varlink.service.InvalidParameter"

DEFAULT_SOCKET = "/run/pled/pled.sock"  # the config's socket, and a client's without $PLED_SOCKET
# A table at least this share in memory is "fully resident": `pled status` is healthy, the daemon does not warn.
FULLY_RESIDENT = 0.9995

MAX_CALL = 64 * 1024  # a call is a method name and a table name: anything bigger is refused
MAX_CALL_DEPTH = 8  # {"parameters": {...}} is 2 levels: deeper nesting is refused before parsing
# The largest reply is Status: every table, and every attached client (at most fdlimit.CONNECTIONS_CAP, each a
# few hundred bytes with its command line), about 2 MB at worst. The manifest travels in the region, not in replies.
MAX_REPLY = 8 * 1024 * 1024
# Values (boundary.load_json's count: commas and brackets outside strings) a reply may hold: a Status of every
# client is ~10 a client. What json.loads builds without calling back (lists, strings) is bounded by this, so a
# client's parse of any reply ends within a fraction of a second of its timeout.
MAX_REPLY_VALUES = 1_000_000


class MessageTooLong(ValueError):
    pass


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\0"


def call(method: str, **parameters) -> bytes:
    return encode({"method": method, "parameters": parameters})


def reply(**parameters) -> dict:
    return {"parameters": parameters}


def error(name: str, **parameters) -> dict:
    return {"error": name, "parameters": parameters}


class Framer:
    """Splits a byte stream into NUL-terminated messages, refusing any longer than ``limit``. Each byte is searched
    for the NUL once, however the stream is cut (a message trickled a byte at a time costs what it costs whole)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._searched = 0  # bytes of _buf known to hold no NUL

    @property
    def pending(self) -> int:
        """Bytes of an incomplete message waiting for the rest."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        messages = []
        while True:
            end = self._buf.find(b"\0", self._searched)
            if end < 0:
                self._searched = len(self._buf)
                break
            if end > self.limit:
                raise MessageTooLong(f"message of {end} bytes exceeds the {self.limit}-byte limit")
            messages.append(bytes(self._buf[:end]))
            del self._buf[: end + 1]
            self._searched = 0
        if len(self._buf) > self.limit:
            raise MessageTooLong(f"message over {self.limit} bytes without a terminating NUL")
        return messages


def parse_call(raw: bytes) -> tuple[str, dict]:
    """(method, parameters) of a call; ValueError says what is wrong with it."""
    try:
        doc = load_json(raw, max_bytes=MAX_CALL, max_depth=MAX_CALL_DEPTH)
    except BoundaryError as err:
        raise ValueError(f"the call {err}") from err
    if not isinstance(doc, dict):
        raise ValueError("a call must be a JSON object")
    method = doc.get("method")
    if not isinstance(method, str):
        raise ValueError('a call needs "method", a string')
    parameters = doc.get("parameters", {})
    if not isinstance(parameters, dict):
        raise ValueError('"parameters" must be an object')
    return method, parameters
