"""Where pled's config file is, its text read within bounds, and the socket it names, with tomllib alone.

The daemon validates the whole file (pled.daemon.config, with pydantic). The commands that only talk to a running
pled (``pled status``, ``reload``, ``verify``; a Kubernetes probe runs ``pled status -c /etc/pled/pled.toml`` every
few seconds) need one key of it, and read it here without importing pydantic or the daemon.
"""
from __future__ import annotations

import os
import tomllib

from pled.shared.boundary import BoundaryError, check_json_depth_text, clip, nesting, read_bounded
from pled.shared.errors import ConfigError
from pled.shared.protocol import DEFAULT_SOCKET

DEFAULT_PATH = "/etc/pled/pled.toml"
# Where the Debian package installs the operator docs (README.md, operations.md, ...) and, in examples/, the example
# config: what messages point an operator to (docs/ and config/ in pled's source hold the same files).
DOCS = "/usr/share/doc/pled"
EXAMPLE_CONFIG = f"{DOCS}/examples/pled.toml"
ENV_VAR = "PLED_CONFIG"
MAX_CONFIG = 1024 * 1024  # a config is a few dozen lines: a bigger file is not one
MAX_DEPTH = 8
# Dots a line may hold. A key lies on one line, and tomllib's time for a dotted key grows with the square of its
# parts (a 16 KiB one took 2 s): bounded per line, the whole file parses in time linear in its size.
MAX_DOTS = 64
MAX_LINE = 16 * 1024  # characters a line may have: pled's config is a few dozen short lines, and tomllib's time on
# one long line (a number, an inline array) grows faster than its length where the line outgrows the caches


def parse_toml(text: str) -> dict:
    """``tomllib.loads`` within bounds: nesting (brackets before, dotted keys after) of at most MAX_DEPTH, at most
    MAX_DOTS dots and MAX_LINE characters a line. BoundaryError or tomllib.TOMLDecodeError (ValueError,
    RecursionError: tomllib's own int() and recursion) say what is wrong; the caller names the file."""
    check_json_depth_text(text, MAX_DEPTH)
    if text.count(".") > MAX_DOTS or len(text) > MAX_LINE:
        for number, line in enumerate(text.split("\n"), 1):
            if len(line) > MAX_LINE:
                raise BoundaryError(f"line {number} has {len(line)} characters; at most {MAX_LINE} are accepted "
                                    "(no line of a pled config is that long)")
            if line.count(".") > MAX_DOTS:
                raise BoundaryError(f"line {number} holds {line.count('.')} dots; at most {MAX_DOTS} are accepted "
                                    "(no key of pled's has more than a few parts)")
    doc = tomllib.loads(text)
    nesting(doc, MAX_DEPTH)  # dotted keys (a.b.c = 1) nest without a bracket
    return doc


def resolve_path(explicit: str | None = None) -> str:
    """-c PATH, else $PLED_CONFIG, else /etc/pled/pled.toml."""
    return explicit or os.environ.get(ENV_VAR) or DEFAULT_PATH


def read_text(explicit: str | None = None) -> tuple[str, str]:
    """(absolute path, text) of the config file; ConfigError (78) naming the file when it is missing or unreadable."""
    path = os.path.abspath(resolve_path(explicit))  # a reload re-reads it from wherever pled runs
    if not os.path.lexists(path):
        raise ConfigError(path, f"no such file; write one (see {EXAMPLE_CONFIG}) or point -c / ${ENV_VAR} at it")
    try:
        return path, read_bounded(path, MAX_CONFIG, "config").decode("utf-8")
    except BoundaryError as err:
        raise ConfigError(path, f"cannot be read: {err}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(path, f"cannot be read: not UTF-8 text ({err.reason} at byte {err.start})") from err


def socket_of(explicit: str | None = None) -> str:
    """The ``socket`` the config file names (the default where it names none), read with tomllib only: what a
    command that talks to a running pled needs of the file. The daemon checks the rest when it loads it."""
    path, text = read_text(explicit)
    try:
        socket = parse_toml(text).get("socket", DEFAULT_SOCKET)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(path, f"not valid TOML: {clip(err)}") from err
    except (BoundaryError, RecursionError, ValueError, OverflowError) as err:  # tomllib's int() and recursion
        raise ConfigError(path, f"not a config pled accepts: {clip(err) or type(err).__name__}") from err
    if not isinstance(socket, str):
        raise ConfigError(path, "key socket: expected the path of pled's Unix socket, a string")
    try:
        return check_socket_path(socket)
    except ValueError as err:
        raise ConfigError(path, f"key socket: {err}") from None


def check_socket_path(value: str) -> str:
    """``value`` if it can be a Unix socket's path, else ValueError saying why (the daemon's check too)."""
    if "\0" in value:
        raise ValueError("contains a NUL byte; a socket path cannot")
    if not value.startswith("/"):
        raise ValueError(f"{clip(value, 80)!r} must be an absolute path")
    if len(value.encode()) > 107:  # sun_path is 108 bytes with its terminating NUL
        raise ValueError(f"{clip(value, 80)!r} is {len(value.encode())} bytes; a Unix socket path may have at most 107")
    return value
