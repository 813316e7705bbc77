"""What memory this process can really have: /proc/meminfo, the ZFS ARC, and its memory cgroup.

One reader per kernel file, each rooted at ``root`` so tests feed fixture trees
(as psutil does with its procfs path), each returning bytes in a frozen record.
A file that is absent yields None; one that cannot be read or parsed raises
HostInfoUnavailable naming it, and the preflight decides what that means.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 with
# 4 KiB pages); anything this large is no limit on any real machine.
UNLIMITED = 1 << 60
MAX_TEXT = 16 << 20  # bytes of one kernel file read at most (mountinfo on a host of many mounts: a few MB)
MAX_DIGITS = 20  # a u64: no figure a kernel file gives has more, and int() is never asked for a longer one


class HostInfoUnavailable(Exception):
    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path


def _join(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read(MAX_TEXT + 1)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise HostInfoUnavailable(path, f"cannot be read ({err})") from err
    if len(text) > MAX_TEXT:
        raise HostInfoUnavailable(path, f"holds more than {MAX_TEXT} bytes; no kernel file pled reads is that long")
    return text


def number(text: str) -> int | None:
    """``text`` as a count of at most MAX_DIGITS ASCII digits; None if it is not one."""
    return int(text) if len(text) <= MAX_DIGITS and text.isascii() and text.isdigit() else None


@dataclass(frozen=True)
class MemInfo:
    total: int
    free: int
    available: int
    estimated: bool  # True where the kernel has no MemAvailable and we estimated it
    slab_reclaimable: int = 0  # SReclaimable: MemAvailable already counts part of it


def read_meminfo(root: str = "/") -> MemInfo | None:
    path = _join(root, "/proc/meminfo")
    text = _read(path)
    if text is None:
        return None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and (n := number(parts[0])) is not None:
            # Values are kB (KiB) except the HugePages_* counts.
            fields[name] = n * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    if "MemTotal" not in fields or "MemFree" not in fields:
        raise HostInfoUnavailable(path, "has no MemTotal/MemFree lines")
    if "MemAvailable" in fields:  # since Linux 3.14
        return MemInfo(fields["MemTotal"], fields["MemFree"], fields["MemAvailable"], estimated=False,
                       slab_reclaimable=fields.get("SReclaimable", 0))
    # Older kernels: free plus reclaimable file pages and slab, as the kernel itself estimates.
    estimate = (fields["MemFree"] + fields.get("Active(file)", 0) + fields.get("Inactive(file)", 0)
                + fields.get("SReclaimable", 0))
    return MemInfo(fields["MemTotal"], fields["MemFree"], min(estimate, fields["MemTotal"]), estimated=True,
                   slab_reclaimable=fields.get("SReclaimable", 0))


@dataclass(frozen=True)
class ZfsArc:
    """The ZFS ARC (OpenZFS's /proc/spl/kstat/zfs/arcstats): a cache the kernel's MemAvailable leaves out,
    though ZFS gives it back under memory pressure down to its minimum, ``c_min``."""

    size: int
    c_min: int

    @property
    def reclaimable(self) -> int:
        return max(0, self.size - self.c_min)


def read_zfs_arc(root: str = "/") -> ZfsArc | None:
    """The ARC's size and minimum, or None on a host without ZFS."""
    path = _join(root, "/proc/spl/kstat/zfs/arcstats")
    text = _read(path)
    if text is None:
        return None
    fields = {}
    for line in text.splitlines()[2:]:  # a kstat header line, then "name type data"
        parts = line.split()
        if len(parts) == 3 and (n := number(parts[2])) is not None:
            fields[parts[0]] = n
    if "size" not in fields or "c_min" not in fields:
        raise HostInfoUnavailable(path, "has no size and c_min lines")
    return ZfsArc(fields["size"], fields["c_min"])


def own_rss(root: str = "/", pid: int | str = "self") -> int:
    """This process's (or ``pid``'s) resident memory (VmRSS), in bytes; 0 where /proc cannot tell."""
    text = _read(_join(root, f"/proc/{pid}/status")) or ""
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return (number(line.split()[1]) or 0) * 1024 if len(line.split()) > 1 else 0
    return 0


@dataclass(frozen=True)
class CgroupLevel:
    """One memory cgroup on the way from ours to the root, with a limit."""

    path: str  # the cgroup's name, as /proc/self/cgroup writes it
    version: int
    limit: int
    usage: int
    reclaimable: int  # active + inactive file pages: page cache the kernel can drop

    @property
    def headroom(self) -> int:
        """What more can be charged here: the limit less what is charged and cannot be reclaimed.

        Shared memory (memfds, tmpfs) sits on the anon LRU, not the file one, so
        active_file + inactive_file already leave it out: it is not reclaimable
        without swap.
        """
        return max(0, self.limit - max(0, self.usage - self.reclaimable))


@dataclass(frozen=True)
class MemoryCgroup:
    version: int
    path: str  # our own cgroup
    limited: tuple[CgroupLevel, ...]  # every level with a limit, ours first

    @property
    def binding(self) -> CgroupLevel | None:
        """The level with the least headroom: the one that decides."""
        return min(self.limited, key=lambda lv: lv.headroom, default=None)


@dataclass(frozen=True)
class _Mount:
    root: str
    mountpoint: str
    fstype: str
    superopts: frozenset[str]


def _mounts(root: str) -> list[_Mount]:
    path = _join(root, "/proc/self/mountinfo")
    text = _read(path)
    if text is None:
        return []
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) < sep + 4:
            raise HostInfoUnavailable(path, f"unexpected line {line!r}")
        mounts.append(_Mount(fields[3], fields[4], fields[sep + 1], frozenset(fields[sep + 3].split(","))))
    return mounts


def _cgroup_dir(root: str, mount: _Mount, cgroup_path: str) -> str:
    """Where our cgroup appears under a mount, whatever part of the tree the mount shows."""
    if mount.root == "/":
        rel = cgroup_path
    elif cgroup_path == mount.root or cgroup_path.startswith(mount.root + "/"):
        rel = cgroup_path[len(mount.root):]
    else:
        rel = cgroup_path  # a cgroup namespace shows paths relative to its own root
    candidate = _join(_join(root, mount.mountpoint), rel)
    # In a container without a cgroup namespace the path may not exist under the mount: use the mount itself.
    return candidate if os.path.isdir(candidate) else _join(root, mount.mountpoint)


def _int(path: str) -> int | None:
    text = _read(path)
    if text is None:
        return None
    value = text.strip()
    if value == "max":
        return UNLIMITED
    n = number(value)
    if n is None:
        raise HostInfoUnavailable(path, f"holds {value[:40]!r}, not a number")
    return n


def _stat(path: str, keys: tuple[str, ...]) -> int:
    text = _read(path)
    if text is None:
        raise HostInfoUnavailable(path, "is missing")
    fields = dict(line.split(None, 1) for line in text.splitlines() if len(line.split(None, 1)) == 2)
    values = [number(fields.get(k, "0").strip()) for k in keys]
    if None in values:
        raise HostInfoUnavailable(path, f"has a field of {', '.join(keys)} that is not a number")
    return sum(v for v in values if v is not None)


# (limit, usage, memory.stat keys of reclaimable file pages) per version.
_FILES = {
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_active_file", "total_inactive_file")),
    2: ("memory.max", "memory.current", ("active_file", "inactive_file")),
}


@dataclass(frozen=True)
class CgroupPlace:
    """Where this process sits in one controller's hierarchy."""

    version: int  # 1 or 2
    path: str  # as /proc/self/cgroup names it
    top: str  # the hierarchy's mount (under the root)
    directory: str  # this process's cgroup in it (under the root)

    def upwards(self) -> Iterator[tuple[str, str]]:
        """(the level's name in the hierarchy, its directory), from this process's cgroup up to the top."""
        directory = self.directory
        while True:
            rel = os.path.relpath(directory, self.top)
            yield "/" if rel == "." else "/" + rel, directory
            if os.path.normpath(directory) == os.path.normpath(self.top):
                return
            directory = os.path.dirname(directory)


def locate_cgroup(controller: str, root: str = "/") -> CgroupPlace | None:
    """This process's cgroup for ``controller`` ("memory", "hugetlb"): in its v1 hierarchy where one is mounted
    (a hybrid host, v1 controllers beside a v2 tree without them, accounts there), else in the v2 tree; None
    outside both."""
    text = _read(_join(root, "/proc/self/cgroup"))
    if text is None:
        return None
    v1_path = v2_path = None
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            v2_path = path
        elif controller in controllers.split(","):
            v1_path = path
    mounts = _mounts(root)
    v1 = next((m for m in mounts if m.fstype == "cgroup" and controller in m.superopts), None)
    v2 = next((m for m in mounts if m.fstype == "cgroup2"), None)
    if v1_path is not None and v1 is not None:
        version, mount, path = 1, v1, v1_path
    elif v2_path is not None and v2 is not None:
        version, mount, path = 2, v2, v2_path
    else:
        return None
    return CgroupPlace(version, path, _join(root, mount.mountpoint), _cgroup_dir(root, mount, path))


def read_cgroup(root: str = "/") -> MemoryCgroup | None:
    """This process's memory cgroup and every limited level above it, or None outside one."""
    place = locate_cgroup("memory", root)
    if place is None:
        return None
    limit_file, usage_file, file_keys = _FILES[place.version]
    levels = []
    for name, directory in place.upwards():
        limit = _int(os.path.join(directory, limit_file))
        if limit is not None and limit < UNLIMITED:
            usage = _int(os.path.join(directory, usage_file))
            if usage is None:
                raise HostInfoUnavailable(os.path.join(directory, usage_file), "is missing beside its limit")
            reclaimable = _stat(os.path.join(directory, "memory.stat"), file_keys)
            levels.append(CgroupLevel(name, place.version, limit, usage, reclaimable))
    return MemoryCgroup(place.version, place.path, tuple(levels))
