"""Byte sizes: parse "1GiB" from configs, format figures for logs."""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d{1,20}(?:\.\d{1,20})?)\s*([a-zA-Z]*)\s*$")
MAX_SIZE = 2**63 - 1  # what an off_t holds: no size pled is given may exceed it

def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as "512MiB", "1.5 GiB", "4G" (G = GiB)."""
    if isinstance(value, bool):
        raise ValueError("expected a size in bytes or a string like \"1GiB\", got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        if value > MAX_SIZE:
            raise ValueError(f"a size of {len(str(value))} digits is out of range; at most {MAX_SIZE} bytes")
        return value
    match = _SIZE.match(value) if len(value) <= 64 else None
    if not match or match.group(2).lower() not in _UNITS:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise ValueError(f"{shown!r} is not a size: use bytes or a string like \"512MiB\" or \"1GiB\"")
    n = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not n <= MAX_SIZE:
        raise ValueError(f"{value!r} is out of range; at most {MAX_SIZE} bytes")
    return int(n)


def gib(n: int | float) -> str:
    """A figure for a log line: '29.8 GiB', '512.0 MiB' below 1 GiB."""
    if abs(n) >= 1024**3:
        return f"{n / 1024**3:.1f} GiB"
    if abs(n) >= 1024**2:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def rate(nbytes: int, seconds: float) -> str:
    """Throughput in GB/s (decimal, as disks are rated); below 0.1 GB/s in MB/s, so a small file's figure is not
    "0.00 GB/s"."""
    if seconds <= 0:
        return "inf GB/s"
    per_second = nbytes / seconds
    return f"{per_second / 1e9:.2f} GB/s" if per_second >= 1e8 else f"{per_second / 1e6:.1f} MB/s"
