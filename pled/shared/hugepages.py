"""Transparent huge pages for shared memory: what the kernel allows, what a region got.

Huge pages make staging, a client's first touch of the table and its random row
gathers faster (docs/BENCHMARKS.md has the figures), so pled asks for them and
says plainly when it cannot.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

THP = "/sys/kernel/mm/transparent_hugepage"
PMD_SIZE = 2 * 1024 * 1024  # a PMD-mapped huge page on x86-64 and arm64 (4 KiB base pages); region.ALIGN too
ENABLE_HINT = (
    "echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled "
    "(affects only memory that asks for huge pages; pled.service does this in ExecStartPre=)"
)


class PolicyUnreadable(OSError):
    """A THP sysfs file exists but cannot be read (EACCES in a sandbox, say): not the same as no THP."""


@dataclass(frozen=True)
class ShmemPolicy:
    setting: str  # the top-level shmem_enabled choice
    pmd_setting: str | None  # hugepages-<PMD>kB/shmem_enabled, on kernels with per-size THP (6.8+)
    pmd_size: int

    @property
    def effective(self) -> str:
        """What applies to PMD-sized (2 MiB) pages: the per-size knob unless it defers to the top."""
        if self.pmd_setting and self.pmd_setting != "inherit":
            return self.pmd_setting
        return self.setting

    @property
    def allows_huge(self) -> bool:
        # "deny" and "never" refuse; "force" is a test setting that always gives them.
        return self.effective in ("always", "within_size", "advise", "force")


def _selected(path: str) -> str | None:
    """The bracketed choice in a sysfs list such as 'always within_size [advise] never deny force'."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise PolicyUnreadable(err.errno, err.strerror, path) from err
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def read_policy(root: str = "/") -> ShmemPolicy | None:
    """What the kernel allows shared memory; None on a kernel without THP. PolicyUnreadable where a file
    exists but cannot be read."""
    base = os.path.join(root, THP.lstrip("/"))
    setting = _selected(os.path.join(base, "shmem_enabled"))
    if setting is None:
        return None  # a kernel without THP
    try:
        with open(os.path.join(base, "hpage_pmd_size"), encoding="ascii") as f:
            pmd_size = int(f.read())
    except (OSError, ValueError):
        pmd_size = PMD_SIZE
    pmd = _selected(os.path.join(base, f"hugepages-{pmd_size // 1024}kB", "shmem_enabled"))
    return ShmemPolicy(setting, pmd, pmd_size)


def pmd_mapped_bytes(address: int, pid: str = "self") -> int:
    """ShmemPmdMapped of the mapping that starts at ``address``: its bytes mapped by huge pages."""
    want = f"{address:x}-"
    inside = False
    with open(f"/proc/{pid}/smaps", encoding="ascii") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(None, 1)[0]:
                inside = line.startswith(want)
            elif inside and line.startswith("ShmemPmdMapped:"):
                return int(line.split()[1]) * 1024
    return 0
