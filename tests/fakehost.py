"""A host's /proc and /sys/fs/cgroup as fixture trees under a directory, for the preflight to read
(tests/test_preflight.py, tests/test_cgroup_reclaimable.py)."""
from pled.daemon.memory import preflight

GiB = 1024**3
KB = 1024
TABLE = int(29.8 * GiB)  # ples_int4, the real sidecar

V1_MOUNT = ("35 30 0:31 {root} /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:16 "
            "- cgroup cgroup rw,memory\n")
V2_MOUNT = "30 23 0:26 {root} /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


class Host:
    """A fixture tree: root/proc/... and root/sys/fs/cgroup/..."""

    def __init__(self, root):
        self.root = root

    def file(self, path, text):
        p = self.root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p

    def meminfo(self, total, free, available=None, slab_reclaimable=0):
        lines = [f"MemTotal: {total // KB} kB", f"MemFree: {free // KB} kB"]
        if available is not None:
            lines.append(f"MemAvailable: {available // KB} kB")
        lines += ["Active(file): 1048576 kB", "Inactive(file): 1048576 kB",
                  f"SReclaimable: {slab_reclaimable // KB} kB", "HugePages_Total: 0"]
        self.file("/proc/meminfo", "\n".join(lines) + "\n")

    def zfs_arc(self, size, c_min):
        """OpenZFS's arcstats as the kernel module writes it (a kstat header, then name type data)."""
        self.file("/proc/spl/kstat/zfs/arcstats", "12 1 0x01 98 26656 1920163911 654183491814\n"
                  "name                            type data\n"
                  "hits                            4    1115656\n"
                  f"c                               4    {size}\n"
                  f"c_min                           4    {c_min}\n"
                  f"c_max                           4    {64 * GiB}\n"
                  f"size                            4    {size}\n"
                  "arc_meta_used                   4    912345\n")

    def v1(self, path, levels, mount_root="/"):
        """levels: {cgroup path: (limit, usage, file_cache)}"""
        self.file("/proc/self/cgroup", f"9:pids:/\n4:memory:{path}\n1:name=systemd:/\n0::/\n")
        self.file("/proc/self/mountinfo", V1_MOUNT.format(root=mount_root))
        for p, (limit, usage, cache) in levels.items():
            d = "/sys/fs/cgroup/memory" + ("" if p == "/" else p)
            self.file(f"{d}/memory.limit_in_bytes", f"{limit}\n")
            self.file(f"{d}/memory.usage_in_bytes", f"{usage}\n")
            self.file(f"{d}/memory.stat", f"cache {cache}\nrss 0\nshmem 0\ntotal_active_file {cache // 2}\n"
                                          f"total_inactive_file {cache - cache // 2}\n")

    def v2(self, path, levels):
        self.file("/proc/self/cgroup", f"0::{path}\n")
        self.file("/proc/self/mountinfo", V2_MOUNT.format(root="/"))
        for p, (limit, usage, cache) in levels.items():
            d = "/sys/fs/cgroup" + ("" if p == "/" else p)
            if limit is not None:
                self.file(f"{d}/memory.max", "max\n" if limit == "max" else f"{limit}\n")
                self.file(f"{d}/memory.current", f"{usage}\n")
                self.file(f"{d}/memory.stat", f"anon 0\nfile {cache}\nshmem 0\nactive_file {cache // 2}\n"
                                              f"inactive_file {cache - cache // 2}\n")
            else:
                (self.root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)

    def check(self, tables=None, margin=0):
        return preflight.check(tables or {"ples_int4": TABLE}, margin, str(self.root))
