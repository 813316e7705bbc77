"""Values of pled.toml checked before pydantic's own checks (so that a bad one gets one message naming its key),
and the conversions the daemon uses: a huge page size in bytes, a writer's uid."""
from __future__ import annotations

import pwd

from pled.shared.boundary import clip

_PAGE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def writer_uid(writer: int | str) -> int:
    """A ``writers`` entry (a user name or a uid) as a uid; KeyError for a name this host does not know."""
    return writer if isinstance(writer, int) else pwd.getpwnam(writer).pw_uid


def page_size_bytes(text: str) -> int:
    """A huge_page_size ("2M", "1G", "64K") in bytes."""
    return int(text[:-1]) * _PAGE_UNITS[text[-1]]


def _check_page_size(value: str | None) -> str | None:
    if value is not None and not (len(value) <= 6 and value[-1:] in _PAGE_UNITS and value[:-1].isdigit()
                                  and value[0] != "0" and value.isascii()):
        raise ValueError(f"{clip(value, 40)!r} is not a page size; write it as \"2M\" or \"1G\"")
    return value


def _check_numa(value: object) -> object:
    """Before pydantic's own checks, so that a bad value gets one message, not one per member of the union."""
    if value is None or value in ("interleave", "local"):
        return value
    if not isinstance(value, (list, tuple)) or not all(type(n) is int for n in value):
        raise ValueError(f"expected \"interleave\", \"local\" or a list of node numbers such as [0, 1], "
                         f"not {clip(repr(value), 60)}")
    if not value:
        raise ValueError("an empty list of nodes; name at least one, or use \"interleave\" or \"local\"")
    if len(set(value)) != len(value) or not all(0 <= n < 1024 for n in value):
        raise ValueError(f"{list(value)} must name distinct NUMA node numbers from 0 to 1023")
    return value
