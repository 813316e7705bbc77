"""What the kernel says of a mapping, a process and the host's memory, for bench/device/check.py and its
children: /proc/PID/smaps (one mapping), /proc/PID/status and /proc/meminfo, in bytes. Nothing else imported, so a
child reads its own figures before it has loaded anything large.
"""
from __future__ import annotations

SMAPS_FIELDS = ("Size", "KernelPageSize", "Rss", "Pss", "Pss_Shmem", "Shared_Clean", "Shared_Dirty", "Private_Clean",
                "Private_Dirty", "Anonymous", "ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb", "Private_Hugetlb",
                "Locked")
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmPin", "VmLck", "VmPTE", "HugetlbPages")
MEMINFO_FIELDS = ("MemTotal", "MemAvailable", "Shmem", "ShmemHugePages", "ShmemPmdMapped", "AnonPages", "Mlocked",
                  "HugePages_Total", "HugePages_Free", "Hugetlb", "Unevictable")


def _kib_fields(lines, wanted) -> dict[str, int]:
    """``Name:  123 kB`` lines as bytes (HugePages_* are counts, kept as they are)."""
    out = {}
    for line in lines:
        key, _, rest = line.partition(":")
        if key in wanted and rest.split():
            value = int(rest.split()[0])
            out[key] = value * 1024 if rest.strip().endswith("kB") else value
    return out


def smaps_of(address: int, pid: str = "self") -> dict[str, int]:
    """/proc/PID/smaps of the mapping that starts at ``address``, in bytes ({} where there is none)."""
    want, lines, inside = f"{address:x}-", [], False
    with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                inside = line.startswith(want)
            elif inside:
                lines.append(line)
    return _kib_fields(lines, SMAPS_FIELDS)


def status_of(pid: str = "self") -> dict[str, int]:
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        return _kib_fields(f, STATUS_FIELDS)


def meminfo() -> dict[str, int]:
    with open("/proc/meminfo", encoding="ascii") as f:
        return _kib_fields(f, MEMINFO_FIELDS)
