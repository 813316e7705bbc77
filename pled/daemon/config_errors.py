"""A config's validation errors in an operator's words: the key as written in the file, and what to do."""
from __future__ import annotations

from pydantic import ValidationError

from pled.shared.config_file import EXAMPLE_CONFIG


def _key(loc: tuple) -> str:
    """('table', 0, 'name') -> 'table[0].name', as a user would find it in the file."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def describe(err: ValidationError) -> str:
    """A pydantic ValidationError as one line per key, each naming the key as a user finds it in the file."""
    lines = []
    for e in err.errors():
        key = _key(tuple(p for p in e["loc"] if p not in ("function-after",)))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = f"unknown key (check its spelling; see {EXAMPLE_CONFIG} for the keys pled knows)"
        elif e["type"] == "string_pattern_mismatch" and key.endswith("name"):
            msg = "a table name is 1-64 letters, digits, '_', '.', '-', starting with a letter or digit"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        lines.append(f"key {key}: {msg}")
    return "; ".join(lines)
